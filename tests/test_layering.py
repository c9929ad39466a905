"""The package layout the README and docs/architecture.md promise, checked: import-linter's
contracts in pyproject.toml (packages point one way; schedules and the plan layer see plain
data only), no import cycle among hmoe_jax modules, and modules small enough to read (about
600 lines at most)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 620  # "about 600": a little slack for a docstring, never a 1,000-line module


def test_import_contracts_hold():
    out = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "broken" in out.stdout and " 0 broken" in out.stdout, out.stdout[-2000:]


def test_modules_stay_small():
    files = [*ROOT.glob("hmoe_jax/**/*.py"), *ROOT.glob("xla_ffi/src/*.cc"), *ROOT.glob("experiments/*.py")]
    big = {str(f.relative_to(ROOT)): n for f in files if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by concept): {big}"


# ---- no import cycles among hmoe_jax modules --------------------------------------------
# The graph is built here from the source files with ast (every import statement, also those
# inside functions and `if TYPE_CHECKING:` blocks: a deferred import is still a dependency),
# independently of import-linter's grimp. Importing a.b.c is an edge to a.b.c only (as in
# grimp): a package's __init__ runs first, but it is no dependency of the submodule.
# Checked: on this tree the graph has exactly grimp's 426 edges, and adding a deferred
# `from hmoe_jax.measure import calibrate` inside a function of measure/timing.py makes
# test_no_import_cycles fail naming measure.{calibrate,probes,standin,timing}.

# no cycle is allowed; an entry here would need a reason (the test fails once it is unused)
ALLOWED_CYCLES: list[frozenset[str]] = []


def module_graph(pkg_dir: Path) -> dict[str, set[str]]:
    """{module: modules of the same top-level package it imports} for the package at pkg_dir."""
    import ast

    root = pkg_dir.name
    files = {}
    for f in sorted(pkg_dir.rglob("*.py")):
        parts = list(f.relative_to(pkg_dir.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        files[".".join(parts)] = (f, is_pkg)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for mod, (f, is_pkg) in files.items():
        here = mod if is_pkg else mod.rpartition(".")[0]  # the package relative imports start from
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                # `from pkg import name`: the submodule pkg.name when it is one, else pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            for t in targets:
                while t and t not in files and t.startswith(root):  # `import a.b.fn`-style: nearest module
                    t = t.rpartition(".")[0]
                if t in files and t != mod:
                    graph[mod].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def test_cycle_finder_finds_a_planted_cycle(tmp_path):
    """The check below can fail: a package whose modules import each other (directly, through
    a third module, by a relative import and inside a function) is reported, an acyclic one
    is not."""
    pkg = tmp_path / "pkgx"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkgx.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .c import g\n")
    (pkg / "sub" / "c.py").write_text("import pkgx.a\n")
    (pkg / "d.py").write_text("import pkgx.a\nimport json\n")
    assert cycles(module_graph(pkg)) == [frozenset({"pkgx.a", "pkgx.sub.b", "pkgx.sub.c"})]
    (pkg / "sub" / "c.py").write_text("import json\n")
    assert cycles(module_graph(pkg)) == []


def test_no_import_cycles():
    graph = module_graph(ROOT / "hmoe_jax")
    assert "hmoe_jax.cli.run" in graph and graph["hmoe_jax.cli.app"]  # the walk saw the package
    found = cycles(graph)
    unexpected = [sorted(c) for c in found if c not in ALLOWED_CYCLES]
    assert not unexpected, (
        f"import cycles among hmoe_jax modules (split by concept, not by size): {unexpected}"
    )
    unused = [sorted(c) for c in ALLOWED_CYCLES if c not in found]
    assert not unused, f"this cycle is gone: delete it from ALLOWED_CYCLES: {unused}"
