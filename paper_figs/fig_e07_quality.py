"""e07 as three panels, from its JSON record only (no jax): (left) held-out perplexity gap
to the bf16 master per variant, with the 1% FP8 target and llama.cpp Q4_K_M's ~0.9% at 7B
for scale; (middle) next-token agreement with bf16's argmax; (right) routed-expert load
balance per MoE layer on the held-out tokens, learned score-correction bias vs zeroed.

    python paper_figs/fig_e07_quality.py [results/e07_quality_<stamp>.json] --out paper_figs/e07_quality.png
(without a path: the newest results/e07_quality_*.json)
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
    ap.add_argument("--out", type=Path, default=Path("paper_figs/e07_quality.png"))
    args = ap.parse_args()
    rec = json.loads((args.record or newest("e07_quality")).read_text())
    rows = [r for r in rec["rows"] if r["variant"] != "bf16"]
    base = next(r for r in rec["rows"] if r["variant"] == "bf16")
    names = [r["variant"].replace("_", "\n") + f"\n(top-{r['experts_per_token']})" for r in rows]
    gaps = [100 * (r["ppl"] / base["ppl"] - 1) for r in rows]
    colors = ["#55a868" if r["variant"].startswith("fp8") else "#c44e52" for r in rows]
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(14, 4.2))
    ax1.bar(names, gaps, color=colors)
    ax1.axhline(1.0, color="#4c72b0", ls="--", lw=1, label="FP8 target: 1%")
    ax1.axhline(
        100 * rec["paper_value"]["llama_cpp_q4_k_m_ppl_gap_7b"],
        color="#8c8c8c",
        ls=":",
        lw=1,
        label="llama.cpp Q4_K_M at 7B: ~0.9%",
    )
    ax1.set_ylabel("held-out perplexity gap to bf16 (%)")
    ax1.set_title(f"bf16 perplexity {base['ppl']:.2f} on {base['tokens']:,} held-out tokens", fontsize=9)
    ax1.tick_params(axis="x", labelsize=7)
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3, axis="y")
    ax2.bar(names, [100 * r["agreement_with_bf16"] for r in rows], color=colors)
    ax2.set_ylabel("next-token argmax agreement with bf16 (%)")
    ax2.set_ylim(min(100 * r["agreement_with_bf16"] for r in rows) - 5, 100)
    ax2.tick_params(axis="x", labelsize=7)
    ax2.grid(alpha=0.3, axis="y")
    s = rec["summary"]
    layers = list(range(1, len(s["load_max_over_mean_learned_bias"]) + 1))
    w = 0.38
    ax3.bar(
        [x - w / 2 for x in layers],
        s["load_max_over_mean_learned_bias"],
        w,
        label="learned bias",
        color="#4c72b0",
    )
    ax3.bar(
        [x + w / 2 for x in layers],
        s["load_max_over_mean_zero_bias"],
        w,
        label="bias zeroed",
        color="#dd8452",
    )
    ax3.axhline(1.0, color="#8c8c8c", ls="--", lw=1)
    ax3.set_xticks(layers)
    ax3.set_xlabel("MoE layer")
    ax3.set_ylabel("max / mean tokens per routed expert (held-out)")
    ax3.legend(fontsize=8)
    ax3.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()
