"""e01 as a bar chart, from its JSON record only (no jax): median M = 1 GEMV time per
variant for each DeepSeek-V3 shape (all cores; hatched: 1 thread), with the time the
FP8 weight bytes would take at the measured read bandwidth drawn as the ceiling line.

    python paper_figs/fig_e01_fp8_gemv.py [results/e01_fp8_gemv_<stamp>.json] --out paper_figs/e01_fp8_gemv.png
(without a path: the newest results/e01_fp8_gemv_*.json)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from records import newest  # noqa: E402  (paper_figs/records.py)

ORDER = ["fp8_ours", "int4_ours", "bf16_torch", "f32_blas", "bf16_xla", "f32_xla", "xla_dequant"]
LABEL = {
    "fp8_ours": "ours FP8",
    "int4_ours": "ours INT4",
    "bf16_torch": "bf16 torch (oneDNN)",
    "f32_blas": "f32 numpy BLAS",
    "bf16_xla": "bf16 XLA",
    "f32_xla": "f32 XLA",
    "xla_dequant": "XLA cast-then-dot (FP8)",
}
COLOR = {
    "fp8_ours": "#c44e52",
    "int4_ours": "#4c72b0",
    "bf16_torch": "#8172b2",
    "f32_blas": "#55a868",
    "bf16_xla": "#ccb974",
    "f32_xla": "#64b5cd",
    "xla_dequant": "#8c8c8c",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("record", nargs="?", type=Path)
    ap.add_argument("--out", type=Path, default=Path("paper_figs/e01_fp8_gemv.png"))
    a = ap.parse_args()
    rec = json.loads((a.record or newest("e01_fp8_gemv")).read_text())
    rows = rec["rows"]
    threads = sorted({r["threads"] for r in rows}, reverse=True)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    ran = {r["variant"] for r in rows}
    order = [v for v in ORDER if v in ran]  # a baseline not installed (torch) is not drawn
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.2 * len(shapes), 4.2), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        width = 0.8 / len(threads)
        for ti, t in enumerate(threads):
            # the ceiling uses the probe of the process that ran our kernels (rows: `process`)
            sel = {
                r["variant"]: r
                for r in rows
                if r["shape"] == shape
                and r["threads"] == t
                and (r["variant"] != "read_bw" or r.get("process", "ours") == "ours")
            }
            xs = [i + ti * width for i, _ in enumerate(order)]
            ys = [sel[v]["median_s"] * 1e3 for v in order]
            ax.bar(
                xs,
                ys,
                width,
                color=[COLOR[v] for v in order],
                hatch=None if ti == 0 else "//",
                edgecolor="black",
                linewidth=0.4,
                label=f"{t} thread{'s' if t > 1 else ''}",
            )
            ceiling_ms = sel["fp8_ours"]["bytes"] / (sel["read_bw"]["gbps"] * 1e9) * 1e3
            ax.hlines(
                ceiling_ms, -0.4, len(order), colors="black", linestyles="--" if ti == 0 else ":", linewidth=1
            )
        n, k = next((r["n"], r["k"]) for r in rows if r["shape"] == shape)
        ax.set_title(f"{shape} [{n}, {k}], M=1")
        ax.set_yscale("log")
        ax.set_ylabel("median time per GEMV (ms)")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(order))])
        ax.set_xticklabels([LABEL[v] for v in order], rotation=50, ha="right", fontsize=8)
    s = rec["summary"]
    fig.suptitle(
        f"e01: FP8 GEMV at {s['fp8_bw_fraction']:.2f} of read bandwidth ({s['read_bw_gbps']:.1f} GB/s); "
        f"{s['speedup_vs_f32_blas']:.1f}x vs f32 BLAS, {s['speedup_vs_xla_dequant']:.0f}x vs XLA dequant; "
        f"INT4/FP8 time {s['int4_time_ratio_vs_fp8']:.2f}  (dashed: FP8 bytes / read bw)",
        fontsize=9,
    )
    fig.tight_layout()
    a.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(a.out, dpi=130)
    print(a.out)


if __name__ == "__main__":
    main()
