"""One SLP prefill trace as a timeline: a row per resource (host->accelerator link,
accelerator, unloader, ...), a bar per op, loads labelled with their layer, so the copy of
layer i+1 under the compute of layer i is visible. Reads the Chrome trace JSON only
(written by `hmoe generate --trace FILE` or `python -m experiments.e20_slp_overlap`).

    python paper_figs/fig_slp_trace.py results/slp_trace.json --out paper_figs/slp_trace.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "load": "#4c72b0",
    "experts_acc": "#dd8452",
    "attn": "#55a868",
    "dense_ffn": "#8172b3",
    "route": "#937860",
    "shared": "#da8bc3",
    "combine": "#8c8c8c",
    "unload": "#ccb974",
    "embed": "#64b5cd",
    "final": "#64b5cd",
    "experts_cpu": "#c44e52",
    "d2h": "#999999",
    "h2d": "#999999",
}


def family(kind: str) -> str:
    """Map op kinds of any schedule (e.g. dslp_load, cp_attn) onto the legend's families."""
    if kind in COLORS:
        return kind
    for key, fam in (
        ("load", "load"),
        ("attn", "attn"),
        ("expert", "experts_acc"),
        ("moe", "experts_acc"),
        ("unload", "unload"),
        ("release", "unload"),
    ):
        if key in kind:
            return fam
    return kind


def read_trace(path: Path) -> tuple[list[str], list[dict], dict]:
    d = json.loads(path.read_text())
    names = {
        e["tid"]: e["args"]["name"]
        for e in d["traceEvents"]
        if e.get("ph") == "M" and e["name"] == "thread_name"
    }
    order = {
        e["tid"]: e["args"]["sort_index"]
        for e in d["traceEvents"]
        if e.get("ph") == "M" and e["name"] == "thread_sort_index"
    }
    tracks = [names[t] for t in sorted(names, key=lambda t: order.get(t, t))]
    slices = [e for e in d["traceEvents"] if e.get("ph") == "X"]
    return tracks, slices, d.get("otherData", {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path)
    ap.add_argument("--out", type=Path, default=Path("paper_figs/slp_trace.png"))
    ap.add_argument("--plan", type=int, default=0, help="which plan of the trace (0: the prefill)")
    args = ap.parse_args()
    tracks, slices, meta = read_trace(args.trace)
    # one plan (the prefill is plan 0; decode steps follow as plans 1, 2, ...)
    prefill = [s for s in slices if s["args"].get("plan", 0) == args.plan]
    tracks = [t for t in tracks if any(s["args"]["resource"] == t for s in prefill)]
    row = {t: i for i, t in enumerate(tracks)}
    fig, ax = plt.subplots(figsize=(12, 0.6 + 0.55 * len(tracks)))
    for s in prefill:
        kind = family(s["name"].split()[0])
        y = row[s["args"]["resource"]]
        ax.broken_barh(
            [(s["ts"] / 1e3, max(s["dur"], 1.0) / 1e3)],
            (y - 0.4, 0.8),
            facecolors=COLORS.get(kind, "#333333"),
            edgecolor="white",
            linewidth=0.3,
        )
        if kind == "load" and s["dur"] > 0:
            ax.text(
                (s["ts"] + s["dur"] / 2) / 1e3,
                y,
                str(s["args"].get("layer", "")),
                ha="center",
                va="center",
                fontsize=6,
                color="white",
            )
    ax.set_yticks(range(len(tracks)), tracks)
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    plans = meta.get("plans", [{}])
    p = plans[args.plan] if args.plan < len(plans) else {}
    title = f"{p.get('schedule', 'trace')} prefill, {p.get('num_tokens', '?')} tokens, ring {p.get('ring_slots', '-')} slots"
    if meta.get("link_gbps"):
        title += f", link capped at {meta['link_gbps']} GB/s (emulation)"
    ax.set_title(title, fontsize=10)
    handles = [
        plt.Rectangle((0, 0), 1, 1, color=COLORS[k]) for k in ("load", "experts_acc", "attn", "unload")
    ]
    fig.legend(
        handles,
        ["copy (load, layer no.)", "grouped expert GEMM", "attention", "slot release"],
        fontsize=7,
        loc="lower center",
        ncol=4,
        frameon=False,
    )
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(args.out, dpi=150)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
