"""e22 as two panels, from its JSON record only (no jax): (left) decode throughput (tokens/s
summed over the batch) vs batch size B, ours measured, next to what the bytes each step
must read allow at the probe's bandwidth (roofline) and the paper's batch gains applied to
our B=1 (comparison column); (right) step time relative to B=1, measured vs the bytes ratio.

    python paper_figs/fig_e22_batched_decode.py [results/e22_batched_decode_<stamp>.json] --out paper_figs/e22_batched_decode.png
(without a path: the newest results/e22_batched_decode_*.json)
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
    ap.add_argument("--out", type=Path, default=Path("paper_figs/e22_batched_decode.png"))
    args = ap.parse_args()
    path = args.record or newest("e22_batched_decode")
    rec = json.loads(path.read_text())
    rows = sorted(rec["rows"], key=lambda r: r["batch"])
    b = [r["batch"] for r in rows]
    tps = [r["tokens_per_s"] for r in rows]
    roof = [r["batch"] * r["probe_gbps_median"] * 1e9 / r["step_bytes"] for r in rows]
    base = rows[0]
    paper = {1: 1.0, **{int(k[5]): v for k, v in rec["paper_value"].items()}}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(b, tps, "o-", color="#c44e52", label="ours, measured")
    ax1.plot(b, roof, "s--", color="#8c8c8c", label="read roofline of each step's bytes")
    pb = [k for k in sorted(paper) if k in b]
    ax1.plot(
        pb,
        [paper[k] * base["tokens_per_s"] for k in pb],
        "^:",
        color="#4c72b0",
        label="paper's gains x our B=1",
    )
    ax1.set_xlabel("batch size B (sequences per decode step)")
    ax1.set_ylabel("decode tokens/s (whole batch)")
    ax1.set_xticks(b)
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    ax2.plot(
        b,
        [r["step_s_median"] / base["step_s_median"] for r in rows],
        "o-",
        color="#c44e52",
        label="step time / B=1",
    )
    ax2.plot(
        b,
        [r["step_bytes"] / base["step_bytes"] for r in rows],
        "s--",
        color="#8c8c8c",
        label="step bytes / B=1",
    )
    ax2.set_xlabel("batch size B")
    ax2.set_ylabel("relative to B=1")
    ax2.set_xticks(b)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    cfg = rec["config"]
    fig.suptitle(
        f"e22 batched decode, DeepSeek-V3 bench twin ({cfg['layers']} layers x {cfg['routed_experts']} experts, "
        f"{cfg['precision']}): {path.stem}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
