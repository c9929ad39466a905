"""The suite's own rules, checked on its sources: a test file imports neither another test
file (shared code lives in the helper modules) nor `experiments.*` (an experiment is tested
by running it as a process); the lanes' markers are declared and the default run leaves the
slow and timing lanes out."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

TESTS = Path(__file__).resolve().parent
HELPERS = {"helpers", "hf_ref", "kernel_helpers", "hlo_read", "conftest", "serve_stub"}


def _imported_modules(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append(node.module)
    return out


def _violations(paths) -> list[str]:
    bad = []
    for path in paths:
        for mod in _imported_modules(path):
            top, _, rest = mod.partition(".")
            if top == "experiments" or (top == "tests" and rest and rest.split(".")[0] not in HELPERS):
                bad.append(f"{path.name}: {mod}")
    return bad


def test_no_test_imports_a_test_module_or_an_experiment():
    bad = _violations(sorted(TESTS.glob("*.py")))
    assert not bad, bad


def test_the_rule_sees_a_bad_import(tmp_path):
    """The check above can fail: a file importing a test module and an experiment."""
    f = tmp_path / "test_x.py"
    f.write_text(
        "from tests.test_dist_ops import x\nimport experiments.e01_fp8_gemv\nfrom tests.helpers import y\n"
    )
    assert _violations([f]) == ["test_x.py: tests.test_dist_ops", "test_x.py: experiments.e01_fp8_gemv"]


def test_lanes_declared_and_left_out_of_the_default_run():
    ini = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    declared = {m.split(":")[0] for m in ini["markers"]}
    assert declared == {"slow", "timing"}
    assert "-m 'not slow and not timing'" in ini["addopts"]
