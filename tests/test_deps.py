"""The declared dependencies are what the package imports: every third-party module that
hmoe_jax imports (ast over its source) comes from a distribution declared in pyproject.toml,
the runtime list holds nothing the package never imports, and the `hmoe` command line's
module-level import closure needs the runtime list only (extras are imported where used).
Module -> distribution comes from the installed metadata (importlib.metadata), not from
the code under test."""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "hmoe_jax"
OURS = {"hmoe_jax", "_hmoe_ffi", "__future__"}
# jaxlib is imported through jax, and pinned beside it: jax==X needs jaxlib==X
RUNTIME_NOT_IMPORTED = {"jaxlib": "jax's backend, pinned to jax's version"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_norm(Requirement(r).name) for r in proj["dependencies"]}
    extras = {k: {_norm(Requirement(r).name) for r in v} for k, v in proj["optional-dependencies"].items()}
    return runtime, extras


def _module_name(f: Path) -> str:
    parts = list(f.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(f: Path) -> list[tuple[str, bool]]:
    """(imported module, at module level and unguarded) for every absolute import in f.
    Guarded: inside a function, or in a try whose handlers catch ImportError."""
    tree = ast.parse(f.read_text(), str(f))
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            child_top = top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ("ImportError", "ModuleNotFoundError")
                for h in child.handlers
            ):
                child_top = False
            if isinstance(child, ast.Import):
                out.extend((a.name, top) for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                out.append((child.module, top))
            visit(child, child_top)

    visit(tree, True)
    return out


def _third_party(mod: str) -> str | None:
    top = mod.split(".")[0]
    return None if top in OURS or top in sys.stdlib_module_names else top


@functools.cache
def _top_level_to_dists() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()  # scans every installed distribution: once


def _dists(top: str) -> set[str]:
    dists = _top_level_to_dists().get(top)
    assert dists, f"hmoe_jax imports {top!r}, which no installed distribution provides"
    return {_norm(d) for d in dists}


def test_every_import_is_declared():
    runtime, extras = _declared()
    usable = runtime | set().union(*(v for k, v in extras.items() if k != "test"))
    missing = {}
    for f in sorted(PKG.rglob("*.py")):
        for mod, _ in _imports(f):
            top = _third_party(mod)
            if top is not None and not _dists(top) & usable:
                missing.setdefault(top, []).append(str(f.relative_to(ROOT)))
    assert not missing, f"imported but declared in no runtime dependency or extra: {missing}"


def test_runtime_dependencies_are_imported():
    runtime, _ = _declared()
    imported = set()
    for f in PKG.rglob("*.py"):
        for mod, _ in _imports(f):
            if (top := _third_party(mod)) is not None:
                imported |= _dists(top)
    unused = runtime - imported - set(RUNTIME_NOT_IMPORTED)
    assert not unused, f"runtime dependencies the package never imports (move them to an extra): {unused}"


def test_the_command_line_needs_only_runtime_dependencies():
    """What `import hmoe_jax.cli` loads at module level (following module-level imports of
    hmoe_jax modules, and the packages above each) imports only runtime dependencies:
    `hmoe --help` works on a plain install; serve/bench/int4cache packages load where used."""
    runtime, _ = _declared()
    files = {_module_name(f): f for f in PKG.rglob("*.py")}
    seen, todo, bad = set(), ["hmoe_jax.cli"], {}
    while todo:
        mod = todo.pop()
        if mod in seen or mod not in files:
            continue
        seen.add(mod)
        parent = mod.rpartition(".")[0]
        todo.append(parent)  # importing a.b.c runs a/__init__ and a/b/__init__ first
        for imp, top in _imports(files[mod]):
            if not top:
                continue
            if imp.split(".")[0] == "hmoe_jax":
                todo += [imp, imp.rpartition(".")[0]]  # a module, or a name in a package
            elif (tp := _third_party(imp)) is not None and not _dists(tp) & runtime:
                bad.setdefault(tp, []).append(mod)
    assert "hmoe_jax.cli.app" in seen and "hmoe_jax.cli.generate" in seen, sorted(seen)
    assert not bad, f"module-level imports of extras reachable from `hmoe`: {bad}"


def test_the_checks_see_a_violation(tmp_path):
    """_imports tells module-level from guarded imports, and an undeclared import is caught."""
    f = tmp_path / "m.py"
    f.write_text(
        "import numpy\nimport hmoe_jax.config\n"
        "try:\n    import fastapi\nexcept ImportError:\n    fastapi = None\n"
        "def g():\n    import orbax.checkpoint\n"
    )
    assert _imports(f) == [
        ("numpy", True),
        ("hmoe_jax.config", True),
        ("fastapi", False),
        ("orbax.checkpoint", False),
    ]
    runtime, extras = _declared()
    assert "orbax-checkpoint" not in runtime and "orbax-checkpoint" in extras["int4cache"]
    assert "safetensors" not in runtime and not _dists("pytest") & runtime  # pytest is test-only
