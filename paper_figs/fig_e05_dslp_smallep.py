"""e05 as two panels, from its JSON record only (no jax): (left) projected prefill tok/s on
the paper's machine for dslp (2 GPUs, the engine's f32 plan, and its bf16 what-if) and slp
(1 GPU) vs prompt length, the paper's ~1,800 tok/s as comparison; (right) one MoE layer at
20K under SmallEP vs standard EP: compute and communication seconds.

    python paper_figs/fig_e05_dslp_smallep.py [results/e05_dslp_smallep_<stamp>.json] --out paper_figs/e05_dslp_smallep.png
(without a path: the newest results/e05_dslp_smallep_*.json)
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
    ap.add_argument("--out", type=Path, default=Path("paper_figs/e05_dslp_smallep.png"))
    args = ap.parse_args()
    rec = json.loads((args.record or newest("e05_dslp_smallep")).read_text())
    proj = [r for r in rec["rows"] if r["part"] == "projection"]
    layer = {r["scheme"]: r for r in rec["rows"] if r["part"] == "projection_moe_layer"}
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for sched, style in (("dslp", "o-"), ("slp", "s-")):
        rows = sorted((r for r in proj if r["schedule"] == sched), key=lambda r: r["prompt_len"])
        a.plot(
            [r["prompt_len"] for r in rows],
            [r["prefill_tok_per_s"] for r in rows],
            style,
            label=f"{sched} (projected)",
        )
        mark_no_fit(a, rows, "prompt_len", "prefill_tok_per_s")
        if sched == "dslp":
            a.plot(
                [r["prompt_len"] for r in rows],
                [r["whatif_no_fp8_gemm_tok_per_s"] for r in rows],
                "o:",
                label="dslp without FP8 GEMMs (what-if)",
            )
    a.axhline(rec["paper_value"]["dslp_tok_per_s"], color="grey", ls=":", label="paper dslp ~1,800")
    a.set_xscale("log", base=2)
    a.set_xlabel("prompt (tokens)")
    a.set_ylabel("prefill tok/s")
    s = rec["summary"]
    a.set_title(
        f"paper machine: dslp (2 GPUs) {s['dslp_tok_per_s_32k']:.0f} tok/s at 32K "
        f"(fits: {s['dslp_fits_32k']}) vs slp (1 GPU)",
        fontsize=9,
    )
    a.legend(fontsize=7)
    names = [n for n in ("smallep", "ep") if n in layer]
    comp = [(layer[n]["layer_s"] - layer[n]["comm_s"]) * 1e3 for n in names]
    comm = [layer[n]["comm_s"] * 1e3 for n in names]
    b.bar(names, comp, label="compute")
    b.bar(names, comm, bottom=comp, label="collectives (via host)")
    b.set_ylabel("one MoE layer + its attention at 20K (ms)")
    b.set_title(
        f"SmallEP / EP layer {s['smallep_vs_ep_layer_ratio']:.2f}, EP comm share {s['ep_comm_share']:.2f}",
        fontsize=9,
    )
    b.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()
