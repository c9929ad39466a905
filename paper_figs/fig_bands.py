"""A tornado per headline projection, from a bands record only (no jax, no simulator): for
each input the band varies, the projection with that input at the low and at the high end
of its stated range (the others central), widest swing on top; the central value as a line,
the band (one-at-a-time runs and the two corners) shaded. Inputs that moved nothing are left
out and counted in the title. A headline whose plan does not fit is marked "fits: false".

    python paper_figs/fig_bands.py [results/bands_<stamp>.json] --out-dir paper_figs
(without a path: the newest results/bands_*.json); writes <out-dir>/tornado_<headline>.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from records import newest  # noqa: E402  (paper_figs/records.py)

TOP = 12  # inputs drawn per headline (the rest are listed in the record)


def tornado(h: dict, out: Path) -> None:
    rows = [r for r in h["inputs"] if r["swing"] > 0][:TOP]
    idle = len([r for r in h["inputs"] if r["swing"] == 0])
    c = h["central"]
    fig, ax = plt.subplots(figsize=(8, 0.45 * max(len(rows), 3) + 1.6))
    ax.axvspan(h["low"], h["high"], color="0.92", label=f"band [{h['low']:.4g}, {h['high']:.4g}]")
    for i, r in enumerate(reversed(rows)):
        lo, hi = r["at_low"], r["at_high"]
        ax.barh(
            i, lo - c, left=c, color="tab:blue", height=0.6, label="input at its low end" if i == 0 else None
        )
        ax.barh(
            i,
            hi - c,
            left=c,
            color="tab:orange",
            height=0.6,
            label="input at its high end" if i == 0 else None,
        )
    ax.axvline(c, color="k", lw=1, label=f"central {c:.4g}")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r['key']} ({r['kind']})" for r in reversed(rows)], fontsize=8)
    ax.set_xlabel(h["metric"])
    fits = "" if h.get("fits", True) else "  [fits: false]"
    ax.set_title(
        f"{h['label']}{fits}\n{h['profile']}: {len(rows)} inputs shown, {idle} with no effect",
        fontsize=10,
    )
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("record", nargs="?", type=Path)
    ap.add_argument("--out-dir", type=Path, default=Path("paper_figs"))
    args = ap.parse_args()
    rec = json.loads((args.record or newest("bands")).read_text())
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, h in rec["headlines"].items():
        out = args.out_dir / f"tornado_{name}.png"
        tornado(h, out)
        print(out)


if __name__ == "__main__":
    main()
