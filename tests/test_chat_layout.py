"""Layout of the `dsv4_jax/chat/` package: its modules share only public names.

A helper two modules need is made public by the module that owns it, so no module of the package
may take a `_private` name from another one, by `from ... import _name` (absolute or relative) or
by attribute access on an imported module (`parser._name`). Checked on the source (AST), no import.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIR = REPO / "dsv4_jax/chat"
PACKAGE = "dsv4_jax.chat"


def _is_private(name: str) -> bool:
    # Dunders (`__all__`, `__name__`) are the language's, not a module's private helpers.
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _in_package(module: str) -> bool:
    return module == PACKAGE or module.startswith(PACKAGE + ".")


def _dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a chain of attribute accesses on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def private_names_taken(source: str, module: str) -> list[tuple[int, str]]:
    """(line, "owner.name") for each private name that `module` takes from a module of the package.

    `module` is the dotted name of the module whose `source` this is (it resolves relative imports).
    """
    package = module if module == PACKAGE else module.rsplit(".", 1)[0]
    found: list[tuple[int, str]] = []
    module_aliases: dict[str, str] = {}  # local name -> what of the package it is bound to
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                owner = f"{base}.{node.module}" if node.module else base
            else:
                owner = node.module or ""
            if not _in_package(owner):
                continue
            for alias in node.names:
                if _is_private(alias.name):
                    found.append((node.lineno, f"{owner}.{alias.name}"))
                else:  # it may be a submodule, whose private names must not be reached either
                    module_aliases[alias.asname or alias.name] = f"{owner}.{alias.name}"
        elif isinstance(node, ast.Import):
            # Without `as`, `import dsv4_jax.chat.parser` binds `dsv4_jax`: the full chain is seen below.
            module_aliases.update({a.asname: a.name for a in node.names if a.asname and _in_package(a.name)})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            value = _dotted(node.value)
            if value is None:
                continue
            head, _, rest = value.partition(".")
            if head in module_aliases:
                owner = module_aliases[head] + (f".{rest}" if rest else "")
            elif _in_package(value):
                owner = value  # `import dsv4_jax.chat.parser` binds `dsv4_jax`; the chain names it
            else:
                continue
            if _in_package(owner) and owner != module:
                found.append((node.lineno, f"{owner}.{node.attr}"))
    return sorted(found)


def test_checker_finds_private_names_taken_from_the_package():
    src = textwrap.dedent(
        """
        import json
        from dsv4_jax.chat.parser import ChatStreamParser, _held_suffix_len
        from .tokens import _SECRET as secret
        from . import parser, _helpers
        from dsv4_jax.chat import encoder as enc
        import dsv4_jax.chat.encoder
        import dsv4_jax.chat.tokens as tok
        from dsv4_jax.model import _elsewhere
        from json import _default_decoder

        def f(self):
            return parser._State, enc._text_of, tok.BOS, tok.__name__, self._x, json._x, _EFFORT_LEVELS

        g = dsv4_jax.chat.encoder._to_json
        """
    )
    assert [name for _, name in private_names_taken(src, "dsv4_jax.chat.request")] == [
        "dsv4_jax.chat.parser._held_suffix_len",
        "dsv4_jax.chat.tokens._SECRET",
        "dsv4_jax.chat._helpers",
        "dsv4_jax.chat.encoder._text_of",  # same line: by name
        "dsv4_jax.chat.parser._State",
        "dsv4_jax.chat.encoder._to_json",
    ]


def test_chat_modules_take_no_private_name_from_each_other():
    paths = sorted(PACKAGE_DIR.glob("*.py"))
    assert {p.stem for p in paths} >= {"__init__", "tokens", "encoder", "parser", "request"}, paths
    taken = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in paths
        for line, name in private_names_taken(
            path.read_text(encoding="utf-8"), PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"
        )
    ]
    assert not taken, "private names used across dsv4_jax/chat/ (make the helper public where it is " \
        "defined, or move it to the module that owns it):\n" + "\n".join(taken)
