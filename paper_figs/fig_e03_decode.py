"""e03 as two panels, from its JSON record only (no jax): (left) projected decode tok/s per
request on the paper's machine vs context length, FP8 and INT4 experts at batch 1 (and FP8
aggregate at the largest batch), the paper's 21.5 / 28 tok/s as comparison marks; (right)
measured here vs simulated decode step of the bench twin per batch size (the validation).

    python paper_figs/fig_e03_decode.py [results/e03_decode_<stamp>.json] --out paper_figs/e03_decode.png
(without a path: the newest results/e03_decode_*.json)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from records import newest  # noqa: E402  (paper_figs/records.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("record", nargs="?", type=Path)
    ap.add_argument("--out", type=Path, default=Path("paper_figs/e03_decode.png"))
    args = ap.parse_args()
    rec = json.loads((args.record or newest("e03_decode")).read_text())
    proj = [r for r in rec["rows"] if r["part"] == "projection" and r["model"] == "deepseek_v3"]
    here = [r for r in rec["rows"] if r["part"] == "measured_here"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    bmax = max(r["batch"] for r in proj)
    for fmt, style in (("fp8", "o-"), ("int4", "s-")):
        rows = sorted(
            (r for r in proj if r["expert_format"] == fmt and r["batch"] == 1), key=lambda r: r["context"]
        )
        a.plot(
            [r["context"] for r in rows],
            [r["decode_tok_per_s"] for r in rows],
            style,
            label=f"{fmt.upper()} B=1 (projected)",
        )
    rows = sorted(
        (r for r in proj if r["expert_format"] == "fp8" and r["batch"] == bmax), key=lambda r: r["context"]
    )
    a.plot(
        [r["context"] for r in rows],
        [r["decode_agg_tok_per_s"] for r in rows],
        "^--",
        label=f"FP8 B={bmax} aggregate",
    )
    pv = rec["paper_value"]
    a.axhline(pv["decode_fp8_tok_per_s"], color="C0", ls=":", label="paper FP8 21.5")
    a.axhline(pv["decode_int4_tok_per_s"], color="C1", ls=":", label="paper INT4 28")
    a.set_xscale("log", base=2)
    a.set_xlabel("context (tokens)")
    a.set_ylabel("decode tok/s")
    a.set_title("DeepSeek-V3 decode, paper machine (simulated)")
    a.legend(fontsize=7)
    xs = range(len(here))
    a2 = [r["measured_step_s"] * 1e3 for r in here]
    s2 = [r["sim_step_s"] * 1e3 for r in here]
    b.bar([x - 0.2 for x in xs], a2, 0.4, label="measured (engine, blocking executor)")
    b.bar([x + 0.2 for x in xs], s2, 0.4, label="simulated (local profile)")
    for x, r in zip(xs, here):
        b.text(x, max(a2[x], s2[x]) * 1.02, f"{r['err_pct']:+.0f}%", ha="center", fontsize=8)
    b.set_xticks(list(xs), [f"B={r['batch']}" for r in here])
    b.set_ylabel("decode step (ms)")
    b.set_title(f"bench twin here: sim error {rec['summary']['sim_error_decode']:.1f}% (mean abs)")
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()
