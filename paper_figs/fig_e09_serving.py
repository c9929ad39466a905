"""e09 as two panels, from its JSON record only (no jax): (left) TPOT while all c clients
decode through `hmoe serve`, next to the engine's own c-row step measured in the same run
(and llama-server's TPOT when the record has it); (right) where a served token's time goes,
per client count: the breakdown from the server's trace (engine decode, chunked prefill,
scheduler, HTTP/SSE path), ms per output token.

    python paper_figs/fig_e09_serving.py [results/e09_serving_<stamp>.json] --out paper_figs/e09_serving.png
(without a path: the newest results/e09_serving_*.json)
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from records import newest  # noqa: E402  (paper_figs/records.py)

PARTS = [
    ("engine_decode", "engine decode step", "#c44e52"),
    ("engine_chunk", "chunked prefill", "#dd8452"),
    ("scheduler", "scheduler work", "#55a868"),
    ("http_detok", "detok + SSE chunk", "#4c72b0"),
    ("http_send", "ASGI send", "#8172b3"),
]


def peer_tpot(rec: dict, clients: int) -> float:
    """Median of llama-server's per-round TPOT rows (records before the summary key)."""
    xs = [
        r["tpot_all_decoding_ms"]
        for r in rec["rows"]
        if r.get("part") == "decode" and r.get("server") == "llama-server" and r.get("clients") == clients
        and r.get("tpot_all_decoding_ms") is not None
    ]  # fmt: skip
    return statistics.median(xs) if xs else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("record", nargs="?", type=Path)
    ap.add_argument("--out", type=Path, default=Path("paper_figs/e09_serving.png"))
    args = ap.parse_args()
    path = args.record or newest("e09_serving")
    rec = json.loads(path.read_text())
    sm, clients = rec["summary"], rec["config"]["clients"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(clients))
    w = 0.27
    step = [sm.get(f"engine_step_ms_b{c}") or 0 for c in clients]
    tpot = [sm.get(f"tpot_all_decoding_ms_c{c}") or 0 for c in clients]
    ax1.bar([i - w for i in x], step, w, color="#8c8c8c", label="engine step, c rows (same run)")
    ax1.bar(list(x), tpot, w, color="#c44e52", label="hmoe serve TPOT, all c decoding")
    if any(f"llama_server_output_tok_s_c{c}" in sm for c in clients):
        # llama-server's TPOT while all c decode, the same measure as ours (median of its
        # rounds' rows; records before the summary key have only the rows). c / output tok/s
        # would also count its prefills and be ~1.8x its TPOT at one client
        peer = [sm.get(f"llama_server_tpot_all_decoding_ms_c{c}") or peer_tpot(rec, c) for c in clients]
        ax1.bar([i + w for i in x], peer, w, color="#4c72b0", label="llama-server TPOT, all c decoding")
    for i, c in enumerate(clients):
        if (o := sm.get(f"serve_overhead_c{c}")) is not None:
            ax1.annotate(f"{o:.2f}x", (i, tpot[i]), ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(list(x), [f"{c} client{'s' if c > 1 else ''}" for c in clients])
    ax1.set_ylabel("ms per output token")
    ax1.set_ylim(0, 1.35 * max(step + tpot + [1.0]))  # room for the legend above the bars
    ax1.legend(fontsize=8, loc="upper left")
    ax1.set_title("TPOT vs the engine's own step")
    bottoms = [0.0] * len(clients)
    for key, label, color in PARTS:
        vals = [sm.get(f"breakdown_c{c}_{key}_ms") or 0 for c in clients]
        ax2.bar(list(x), vals, 0.5, bottom=bottoms, color=color, label=label)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax2.set_xticks(list(x), [f"{c}" for c in clients])
    ax2.set_xlabel("clients")
    ax2.set_ylabel("ms per output token (server trace)")
    ax2.legend(fontsize=8)
    ax2.set_title("where a served token's time goes")
    load = sm.get("load_avg_before")
    fig.suptitle(f"e09 serving ({path.stem}; load average before {load})", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()
