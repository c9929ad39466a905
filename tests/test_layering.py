"""The package layout the README promises, checked: import-linter's contracts in
pyproject.toml (packages point one way; schedules and the plan layer see plain data only),
and modules small enough to read (about 600 lines at most)."""

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
