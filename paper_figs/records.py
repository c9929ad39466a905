"""What every figure script shares: the newest JSON record of an experiment (figures are
drawn from records only). Scripts run as `python paper_figs/fig_<experiment>.py`, so this
directory is on sys.path."""

from __future__ import annotations

from pathlib import Path


def newest(name: str, results: Path = Path("results")) -> Path:
    """results/<name>_<UTC stamp>.json with the latest stamp."""
    found = sorted(results.glob(f"{name}_*.json"))
    if not found:
        raise SystemExit(f"no {results}/{name}_*.json: run python -m experiments.{name} first")
    return found[-1]
