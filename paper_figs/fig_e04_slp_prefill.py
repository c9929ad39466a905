"""e04 as two panels, from its JSON record only (no jax): (left) projected TTFT vs prompt
length on the paper's machine (one RTX 5090) for the cpu schedule and slp, the 30 s budget
and the paper's "32K within 30 s" as comparison, with slp without FP8 GEMMs as a what-if; (right) measured here vs simulated prefill
time of the bench twin per schedule and length (the validation).

    python paper_figs/fig_e04_slp_prefill.py [results/e04_slp_prefill_<stamp>.json] --out paper_figs/e04_slp_prefill.png
(without a path: the newest results/e04_slp_prefill_*.json)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from records import mark_no_fit, newest  # noqa: E402  (paper_figs/records.py)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("record", nargs="?", type=Path)
    ap.add_argument("--out", type=Path, default=Path("paper_figs/e04_slp_prefill.png"))
    args = ap.parse_args()
    rec = json.loads((args.record or newest("e04_slp_prefill")).read_text())
    proj = [r for r in rec["rows"] if r["part"] == "projection"]
    here = [r for r in rec["rows"] if r["part"] == "measured_here"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for sched, style in (("cpu", "s-"), ("slp", "o-")):
        rows = sorted((r for r in proj if r["schedule"] == sched), key=lambda r: r["prompt_len"])
        a.plot(
            [r["prompt_len"] for r in rows], [r["ttft_s"] for r in rows], style, label=f"{sched} (projected)"
        )
        mark_no_fit(a, rows, "prompt_len", "ttft_s")
        if sched == "slp":
            wi = [r for r in rows if "whatif_no_fp8_gemm_ttft_s" in r]
            a.plot(
                [r["prompt_len"] for r in wi],
                [r["whatif_no_fp8_gemm_ttft_s"] for r in wi],
                "o:",
                label="slp without FP8 GEMMs (what-if)",
            )
    a.axhline(30, color="grey", ls=":", label="30 s TTFT budget")
    a.plot([32768], [30], "r*", ms=12, label="paper: 32K within 30 s")
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("prompt (tokens)")
    a.set_ylabel("TTFT (s)")
    s = rec["summary"]
    a.set_title(
        f"paper machine, 1 GPU: slp {s['slp_tok_per_s_20k']:.0f} tok/s at 20K (paper ~1,200)", fontsize=9
    )
    a.legend(fontsize=7)
    xs = range(len(here))
    m = [r["measured_prefill_s"] for r in here]
    p = [r["sim_prefill_s"] for r in here]
    b.bar([x - 0.2 for x in xs], m, 0.4, label="measured (engine)")
    b.bar([x + 0.2 for x in xs], p, 0.4, label="simulated (local profile)")
    for x, r in zip(xs, here):
        b.text(x, max(m[x], p[x]) * 1.02, f"{r['err_pct']:+.0f}%", ha="center", fontsize=8)
    labels = [
        f"{r['schedule']}\nT={r['prompt_len']}" + (f"\n{r['link_gbps']} GB/s" if r.get("link_gbps") else "")
        for r in here
    ]
    b.set_xticks(list(xs), labels, fontsize=7)
    b.set_ylabel("prefill (s)")
    b.set_title(f"bench twin here: sim error {s['sim_error_prefill']:.1f}% (mean abs)", fontsize=9)
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()
