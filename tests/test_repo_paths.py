"""Nothing in the packages or the tests reads a fixed path outside the repository.

On our machines a `shared/` folder sits beside the checkout; on a user's fresh clone and in CI it
does not. Data the tests need lives under `tests/fixtures/`. Allowed: temporary directories made
at run time, user-given model paths and the built-in model's `~/.cache/dsv4-jax`.

The scan reads the source (AST), so it finds both string literals that name outside places and
`Path(__file__)` climbs (`.parents[k]`, `.parent.parent`) above the repository root.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCANNED = ("dsv4_jax", "pallas_kernels", "serve", "tests", "benchmarks")

# Absolute places of particular machines; a literal starting with one is a fixed outside path.
_MACHINE_ROOTS = ("/work", "/home", "/root", "/mnt", "/data", "/opt", "/srv", "/Users", "C:\\")
_ALLOWED_HOME = ("~/.cache/dsv4-jax",)


def _literal_problem(text: str) -> str | None:
    if "../" in text or "..\\" in text:
        return "climbs out with '..'"
    if "shared/golden" in text or "shared/docs" in text or "shared/tools" in text:
        return "names the team's shared/ folder"
    if text.startswith(_MACHINE_ROOTS):
        return "is an absolute path of one machine"
    if text.startswith("~") and not text.startswith(_ALLOWED_HOME):
        return "is a path in a home directory"
    return None


def _climb(node: ast.AST) -> int | None:
    """How many directories an expression climbs from `__file__`: `Path(__file__).resolve()
    .parents[k]` climbs k + 1, each `.parent` one; None if it does not start at `__file__`."""
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents":
        base = _climb(node.value.value)
        index = node.slice.value if isinstance(node.slice, ast.Constant) else None
        return None if base is None or not isinstance(index, int) else base + index + 1
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        base = _climb(node.value)
        return None if base is None else base + 1
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in ("resolve", "absolute"):
            return _climb(func.value)
        if isinstance(func, ast.Name) and func.id == "Path" and node.args:
            return _climb(node.args[0])
        if isinstance(func, ast.Attribute) and func.attr in ("dirname", "abspath", "realpath") and node.args:
            inner = _climb(node.args[0])
            return None if inner is None else inner + (func.attr == "dirname")
    if isinstance(node, ast.Name) and node.id == "__file__":
        return 0
    return None


def outside_paths(source: str, depth: int) -> list[tuple[int, str]]:
    """(line, why) for each place in `source` (a file `depth` folders below the repository root)
    that reaches outside the repository."""
    tree = ast.parse(source)
    prose = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # docstrings cite, never read
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
            why = _literal_problem(node.value)
            if why:
                found.append((node.lineno, f"{node.value[:60]!r} {why}"))
        climb = _climb(node) if isinstance(node, (ast.Subscript, ast.Attribute)) else None
        if climb is not None and climb - 1 > depth:  # climbing depth + 1 from the file reaches the root
            found.append((node.lineno, f"climbs {climb} levels from a file {depth} below the root"))
    return found


def test_checker_finds_outside_paths_and_allows_inside_ones():
    src = textwrap.dedent(
        """
        '''Docstrings may cite shared/docs/dsv4_architecture.md.'''
        from pathlib import Path
        A = Path(__file__).resolve().parents[2] / "shared/golden/x.jsonl"
        B = Path(__file__).resolve().parents[1] / "fixtures"
        C = Path(__file__).parent.parent.parent / "x"
        D = Path(__file__).parent / "fixtures"
        E = "/work/shared/docs/x.md"
        F = "../other/file"
        G = "~/.cache/dsv4-jax"
        H = "~/models"
        I = "/v1/chat/completions"
        """
    )
    found = outside_paths(src, depth=1)  # as if the file were tests/x.py
    lines = sorted({line for line, _ in found})
    assert lines == [4, 6, 8, 9, 11], found


def test_packages_and_tests_read_no_fixed_path_outside_the_repository():
    this = Path(__file__).resolve()  # the checker itself spells out what it looks for
    files = [
        f for d in SCANNED if (REPO / d).is_dir() for f in sorted((REPO / d).rglob("*.py")) if f.resolve() != this
    ]
    assert len(files) >= 40, len(files)  # the globs found the packages and the tests
    bad = [
        f"{path.relative_to(REPO)}:{line}: {why}"
        for path in files
        for line, why in outside_paths(path.read_text(encoding="utf-8"), len(path.relative_to(REPO).parts) - 1)
    ]
    assert not bad, "fixed paths outside the repository (copy the data under tests/fixtures/):\n" + "\n".join(bad)
