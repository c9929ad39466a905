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


def mark_no_fit(ax, rows: list[dict], x: str, y: str) -> None:
    """A red ring on every projected point whose plan does not fit the accelerator's memory
    (the row's fits is false: timed as if it fitted), labelled once."""
    bad = [r for r in rows if r.get("fits") is False]
    label = "fits: false (plan over GPU memory)"
    if bad:
        seen = label in ax.get_legend_handles_labels()[1]
        ax.plot(
            [r[x] for r in bad],
            [r[y] for r in bad],
            "o",
            mfc="none",
            mec="red",
            ms=11,
            label=None if seen else label,
        )
