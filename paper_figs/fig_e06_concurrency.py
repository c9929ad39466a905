"""e06 as one figure, drawn from its JSON record only:
(a) aggregate decode throughput at batch B over batch 1, ours beside the paper's;
(b) one dual-batch decode step as a timeline: accelerator and CPU-expert ops of the two
    micro-batches (mb0, mb1), so attention of one overlapping the experts of the other shows;
(c) TTFT / TPOT inflation of the 1P+1D and 1P+2D mixes over each request alone, per backend,
    with the paper's 15% line, measured here and projected (simulator) on the paper's machine;
(d) the simulator against the measured mixes: simulated vs measured p90 TTFT and TPOT of
    every replayed group, with the 15% band.

    python paper_figs/fig_e06_concurrency.py [results/e06_concurrency_*.json] --out paper_figs/e06_concurrency.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from records import newest  # noqa: E402  (paper_figs/records.py)

MB_COLORS = {"mb0": "#4c72b0", "mb1": "#dd8452"}


def panel_batch(ax, rec: dict) -> None:
    rows = [r for r in rec["rows"] if r["part"] == "batch"]
    base = next(r for r in rows if r["batch"] == 1)["tok_per_s_median"]
    bs = [r["batch"] for r in rows]
    ours = [r["tok_per_s_median"] / base for r in rows]
    paper = [1.0] + [rec["paper_value"].get(f"batch{b}_throughput_gain") for b in bs[1:]]
    proj = {r["batch"]: r["gain"] for r in rec["rows"] if r["part"] == "projection_batch"}
    w = 0.27
    ax.bar([i - w for i in range(len(bs))], ours, w, label="ours (measured here)", color="#4c72b0")
    if proj:
        ax.bar(
            [i for i, b in enumerate(bs) if b in proj],
            [proj[b] for b in bs if b in proj],
            w,
            label="ours (projected, paper machine)",
            color="#8172b2",
        )
    ax.bar(
        [i + w for i in range(len(bs)) if paper[i] is not None],
        [p for p in paper if p is not None],
        w,
        label="paper",
        color="#bbbbbb",
    )
    ax.set_xticks(range(len(bs)), [f"B={b}" for b in bs])
    ax.set_ylabel("decode tokens/s over B=1")
    ax.set_title("(a) batched decode")
    ax.legend(fontsize=8)


def panel_trace(ax, rec: dict) -> None:
    tr = next((r for r in rec["rows"] if r["part"] == "dual_trace"), None)
    if not tr or not tr["slices"]:
        ax.set_title("(b) no dual trace in the record")
        return
    tracks = sorted(
        {(s["resource"], s["batch"]) for s in tr["slices"] if s["batch"] in MB_COLORS},
        key=lambda t: (not t[0].startswith("acc"), t[0], t[1]),
    )
    y = {t: i for i, t in enumerate(tracks)}
    for s in tr["slices"]:
        key = (s["resource"], s["batch"])
        if key not in y:
            continue
        ax.barh(
            y[key],
            s["dur_us"] / 1e3,
            left=s["start_us"] / 1e3,
            height=0.7,
            color=MB_COLORS[s["batch"]],
            edgecolor="black",
            linewidth=0.3,
        )
    ax.set_yticks(range(len(tracks)), [f"{r} {b}" for r, b in tracks], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms")
    d = next((r for r in rec["rows"] if r["part"] == "dual" and r["batch"] == tr["batch"]), None)
    sub = f": gain {d['dual_gain_vs_sequential']:.2f}x, bound {d['bound']:.2f}x" if d else ""
    ax.set_title(f"(b) one dual-batch step, B={tr['batch']}{sub}", fontsize=9)


def panel_mix(ax, rec: dict) -> None:
    rows = [r for r in rec["rows"] if r["part"] in ("mix", "projection_mix") and r["mix"] != "1P"]
    labels, ttft, tpot = [], [], []
    for r in rows:
        where = "projected" if r["part"] == "projection_mix" else "here"
        labels.append(f"{r['backend'].split(' (')[0]} {r['mix']}\n({where})")
        ttft.append(r["ttft_inflation"])
        tpot.append(r.get("tpot_inflation", 0.0))
    w = 0.38
    xs = range(len(rows))
    ax.bar([i - w / 2 for i in xs], ttft, w, label="TTFT", color="#55a868")
    ax.bar([i + w / 2 for i in xs], tpot, w, label="TPOT", color="#c44e52")
    ax.axhline(1.15, color="black", linestyle="--", linewidth=0.8, label="paper: < 1.15")
    ax.set_xticks(list(xs), labels, fontsize=6, rotation=30, ha="right")
    ax.set_ylabel("over the request alone")
    ax.set_yscale("log")
    ax.set_title("(c) mixed prefill/decode")
    ax.legend(fontsize=7)


def panel_validation(ax, rec: dict) -> None:
    rows = [r for r in rec["rows"] if r["part"] == "sim_validation"]
    if not rows:
        ax.set_title("(d) no simulator validation in the record")
        return
    for metric, color in (("ttft_s", "#55a868"), ("tpot_s", "#c44e52")):
        pts = [(r[metric]["measured_p90"], r[metric]["simulated_p90"]) for r in rows if metric in r]
        ax.scatter(
            [m for m, _ in pts], [s for _, s in pts], s=14, color=color, label=f"p90 {metric[:-2].upper()}"
        )
    lo = min(
        min(r[m]["measured_p90"], r[m]["simulated_p90"]) for r in rows for m in ("ttft_s", "tpot_s") if m in r
    )
    hi = max(
        max(r[m]["measured_p90"], r[m]["simulated_p90"]) for r in rows for m in ("ttft_s", "tpot_s") if m in r
    )
    xs = [lo / 1.5, hi * 1.5]
    ax.plot(xs, xs, color="black", linewidth=0.8)
    ax.fill_between(xs, [x * 0.85 for x in xs], [x * 1.15 for x in xs], color="#dddddd", label="within 15%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured here (s)")
    ax.set_ylabel("simulated (s)")
    s = rec["summary"]
    ax.set_title(
        f"(d) simulator vs measured: p90 error TTFT {s.get('sim_error_ttft_p90', float('nan')):.0f}%, "
        f"TPOT {s.get('sim_error_tpot_p90', float('nan')):.0f}%",
        fontsize=9,
    )
    ax.legend(fontsize=7)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("record", nargs="?", type=Path)
    ap.add_argument("--out", type=Path, default=Path("paper_figs/e06_concurrency.png"))
    args = ap.parse_args()
    path = args.record or newest("e06_concurrency")
    rec = json.loads(path.read_text())
    fig, axes = plt.subplots(2, 2, figsize=(14, 8.5))
    panel_batch(axes[0][0], rec)
    panel_trace(axes[0][1], rec)
    panel_mix(axes[1][0], rec)
    panel_validation(axes[1][1], rec)
    fig.suptitle(f"e06 concurrency ({rec['config']['model']}; {path.name})", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=130)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
