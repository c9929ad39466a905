"""The shipped model's training run, from its train_record.json only (no jax): (left) train
and held-out loss (nats/token) vs training tokens; (right) routed-expert load balance
(max/mean tokens per expert in each MoE layer, per training batch) over training, with the
aux-loss-free bias balancing on.

    python paper_figs/fig_train_loss.py [hmoe_jax/assets/deepseek_v3_stdlib/train_record.json] --out paper_figs/train_loss.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DEFAULT = Path(__file__).resolve().parents[1] / "hmoe_jax/assets/deepseek_v3_stdlib/train_record.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("record", nargs="?", type=Path, default=DEFAULT)
    ap.add_argument("--out", type=Path, default=Path("paper_figs/train_loss.png"))
    args = ap.parse_args()
    rec = json.loads(args.record.read_text())
    c = rec["curve"]
    tok = [r["tokens"] / 1e6 for r in c]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    per_step = rec.get("step_train_loss")
    if per_step:
        tps = rec["recipe"]["batch"] * rec["recipe"]["seq_len"] / 1e6
        ax1.plot(
            [(i + 1) * tps for i in range(len(per_step))],
            per_step,
            color="#4c72b0",
            lw=0.8,
            alpha=0.6,
            label="train (each step)",
        )
    ax1.plot(tok, [r["train_loss"] for r in c], "o-", color="#4c72b0", label="train (mean since last point)")
    ax1.plot(tok, [r["heldout_loss"] for r in c], "s-", color="#c44e52", label="held-out files")
    ax1.set_xlabel("training tokens (M)")
    ax1.set_ylabel("loss (nats / token)")
    ax1.set_title(
        f"{rec['model']}: {rec['params'] / 1e6:.1f}M params, held-out {rec['final_heldout_loss']:.3f}",
        fontsize=9,
    )
    ax1.legend(fontsize=8)
    ax1.grid(alpha=0.3)
    n_moe = len(c[0]["train_max_over_mean_load"])
    for j in range(n_moe):
        ax2.plot(tok, [r["train_max_over_mean_load"][j] for r in c], "o-", label=f"MoE layer {j + 1}")
    ax2.axhline(1.0, color="#8c8c8c", ls="--", lw=1)
    ax2.set_xlabel("training tokens (M)")
    ax2.set_ylabel("max / mean tokens per routed expert")
    ax2.set_title("aux-loss-free balancing (e_score_correction_bias)", fontsize=9)
    ax2.legend(fontsize=8)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()
