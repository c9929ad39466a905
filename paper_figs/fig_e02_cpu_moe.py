"""e02 as two panels, from its JSON record only (no jax): (left) achieved weight-read
bandwidth of one MoE layer vs M for each variant (ours fine / coarse, FP8 / INT4, and
kt-kernel's AMXFP8_MOE when it ran), with the machine's measured read bandwidth as the
ceiling; (right) median time per layer vs M, log-log.

    python paper_figs/fig_e02_cpu_moe.py [results/e02_cpu_moe_<stamp>.json] --out paper_figs/e02_cpu_moe.png
(without a path: the newest results/e02_cpu_moe_*.json)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from records import newest  # noqa: E402  (paper_figs/records.py)

STYLE = {
    "fp8_fine": ("#c44e52", "-", "ours FP8, fine"),
    "fp8_coarse": ("#c44e52", ":", "ours FP8, coarse"),
    "fp8_fine_layer": ("#c44e52", "--", "ours FP8, fine + shared"),
    "int4_fine": ("#4c72b0", "-", "ours INT4, fine"),
    "int4_coarse": ("#4c72b0", ":", "ours INT4, coarse"),
    "int4_fine_layer": ("#4c72b0", "--", "ours INT4, fine + shared"),
    "kt_fp8": ("#55a868", "-", "kt-kernel AMXFP8_MOE"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("record", type=Path, nargs="?")
    ap.add_argument("--out", type=Path, default=Path("paper_figs/e02_cpu_moe.png"))
    args = ap.parse_args()
    path = args.record or newest("e02_cpu_moe")
    rec = json.loads(path.read_text())
    rows, summary = rec["rows"], rec["summary"]

    fig, (bw_ax, t_ax) = plt.subplots(1, 2, figsize=(11, 4.2))
    for variant, (color, ls, label) in STYLE.items():
        pts = sorted((r["m"], r["gbps"], r["median_s"]) for r in rows if r["variant"] == variant)
        if not pts:
            continue
        ms = [p[0] for p in pts]
        bw_ax.plot(ms, [p[1] for p in pts], color=color, ls=ls, marker="o", ms=3, label=label)
        t_ax.plot(ms, [p[2] * 1e3 for p in pts], color=color, ls=ls, marker="o", ms=3, label=label)
    if summary.get("read_bw_gbps"):
        bw_ax.axhline(summary["read_bw_gbps"], color="k", lw=0.8, label="read bandwidth (probe)")
    bw_ax.set_xscale("log", base=2)
    bw_ax.set_xlabel("tokens M")
    bw_ax.set_ylabel("distinct experts' weight bytes / time (GB/s)")
    bw_ax.set_title("MoE layer weight-read rate")
    t_ax.set_xscale("log", base=2)
    t_ax.set_yscale("log")
    t_ax.set_xlabel("tokens M")
    t_ax.set_ylabel("median time per layer (ms)")
    t_ax.set_title("MoE layer time")
    t_ax.legend(fontsize=7)
    frac = summary.get("moe_decode_bw_fraction")
    kt = summary.get("speedup_vs_kt_kernel")
    note = f"M=1 FP8: {frac:.2f} of read bw" if frac else ""
    if kt:
        note += f", {kt:.2f}x kt-kernel"
    fig.suptitle(f"e02 CPU MoE ({rec['environment'].get('cpu_model', '?')}) {note}", fontsize=9)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out} from {path}")


if __name__ == "__main__":
    main()
