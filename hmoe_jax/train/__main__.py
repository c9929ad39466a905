"""python -m hmoe_jax.train: train the shipped DeepSeek-V3-architecture model from scratch
on the Python standard library source, then write it in DeepSeek's FP8 release format.

    python -m hmoe_jax.train --out DIR [--bf16-out DIR] [--steps N] [--quick]
    python -m hmoe_jax.train --out DIR --check hmoe_jax/assets/deepseek_v3_stdlib/train_record.json

--check compares the new held-out loss with a record's and exits 1 when they differ by more
than --tolerance (relative; default 2%); with --stop-after N only the first N steps of the
same schedule run, compared with the record's held-out loss at step N. The shipped model was made with
`nice -n 10 python -m hmoe_jax.train --out hmoe_jax/assets/deepseek_v3_stdlib
--bf16-out hmoe_jax/assets/deepseek_v3_stdlib_bf16` (docs/training.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import sys
from pathlib import Path

DEFAULT_TOLERANCE = 0.02


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from hmoe_jax.train.recipe import Recipe

    rc = Recipe()
    p = argparse.ArgumentParser(prog="python -m hmoe_jax.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="FP8 checkpoint directory to write")
    p.add_argument("--bf16-out", type=Path, default=None, help="also write the bf16 master here")
    p.add_argument("--steps", type=int, default=rc.steps)
    p.add_argument("--batch", type=int, default=rc.batch)
    p.add_argument("--seq-len", type=int, default=rc.seq_len)
    p.add_argument("--lr", type=float, default=rc.lr)
    p.add_argument("--seed", type=int, default=rc.seed)
    p.add_argument("--max-files", type=int, default=None, help="use only the first N files (smoke runs)")
    p.add_argument("--quick", action="store_true", help="30 steps on 200 files: checks the pipeline")
    p.add_argument("--check", type=Path, default=None, help="train_record.json to reproduce")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="run only the first N steps of the schedule; with --check, compare with the record's "
        "held-out loss at step N (a multiple of 100)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax
    import numpy as np

    from hmoe_jax.train import data
    from hmoe_jax.train.export import export
    from hmoe_jax.train.loop import train
    from hmoe_jax.train.recipe import MODEL_NAME, Recipe, model_config

    if args.quick:
        args.steps, args.max_files = min(args.steps, 30), args.max_files or 200
    rc = Recipe(
        seed=args.seed,
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        eval_every=max(1, min(Recipe.eval_every, args.steps // 4)),
    )
    log = lambda s: print(s, file=sys.stderr, flush=True)
    corpus = data.load_corpus(heldout_per_mille=rc.heldout_per_mille, max_files=args.max_files)
    cs = corpus.summary()
    log(
        f"corpus {cs['root']}: {cs['train_files']} train files ({cs['train_bytes'] / 1e6:.1f} MB), "
        f"{cs['heldout_files']} held out ({cs['heldout_bytes'] / 1e6:.2f} MB), digest {cs['digest']}"
    )
    tok = data.train_tokenizer([t for _, t in corpus.train], rc.vocab_size)
    train_stream = data.encode_stream(tok, [t for _, t in corpus.train])
    held_stream = data.encode_stream(tok, [t for _, t in corpus.heldout])
    eval_win = data.eval_windows(held_stream, rc.eval_windows, rc.seq_len)
    log(
        f"tokenizer: byte-level BPE, {tok.get_vocab_size()} ids; {train_stream.size:,} train tokens "
        f"({cs['train_bytes'] / train_stream.size:.2f} bytes/token), {held_stream.size:,} held out; "
        f"{rc.steps} steps x {rc.tokens_per_step} tokens = {rc.steps * rc.tokens_per_step:,} tokens"
    )
    cfg = model_config(vocab_size=tok.get_vocab_size())
    res = train(cfg, rc, train_stream, eval_win, log=log, stop_after=args.stop_after)
    n_params = sum(int(x.size) for x in jax.tree_util.tree_leaves(res.params))
    record = {
        "model": MODEL_NAME,
        "params": n_params,
        "recipe": dataclasses.asdict(rc),
        "corpus": cs,
        "tokenizer": {"kind": "byte-level BPE (tokenizers)", "vocab_size": tok.get_vocab_size()},
        "train_tokens": train_stream.size,
        "heldout_tokens_scored": int(eval_win.shape[0] * (eval_win.shape[1] - 1)),
        "final_train_loss": res.final_train_loss,
        "final_heldout_loss": res.final_heldout_loss,
        "heldout_ppl": float(np.exp(res.final_heldout_loss)),
        "heldout_max_over_mean_load": res.heldout_balance,
        "heldout_max_over_mean_load_zero_bias": res.heldout_balance_zero_bias,
        "train_s": res.train_s,
        "compile_s": res.compile_s,
        "curve": res.curve,
        "step_train_loss": res.step_losses,
        "environment": {
            "python": sys.version.split()[0],
            "jax": jax.__version__,
            "cpu": platform.processor() or platform.machine(),
            "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        },
    }
    export(res.params, cfg, tok, record, args.out, args.bf16_out)
    summary = {
        "out": str(args.out),
        "params": n_params,
        "train_s": round(res.train_s, 1),
        "final_train_loss": round(res.final_train_loss, 4),
        "final_heldout_loss": round(res.final_heldout_loss, 4),
        "heldout_max_over_mean_load": [round(x, 2) for x in res.heldout_balance],
        "heldout_max_over_mean_load_zero_bias": [round(x, 2) for x in res.heldout_balance_zero_bias],
    }
    rc_code = 0
    if args.check is not None:
        ref = json.loads(args.check.read_text())
        ref_loss = ref["final_heldout_loss"]
        if args.stop_after is not None and args.stop_after < ref["recipe"]["steps"]:
            at = [c for c in ref["curve"] if c["step"] == args.stop_after]
            if not at:
                raise SystemExit(f"{args.check}: no curve point at step {args.stop_after}")
            ref_loss = at[0]["heldout_loss"]
        rel = abs(res.final_heldout_loss - ref_loss) / ref_loss
        same_data = ref["corpus"]["digest"] == cs["digest"]
        summary.update(
            reference_heldout_loss=ref_loss,
            steps_run=len(res.curve) and res.curve[-1]["step"],
            relative_diff=rel,
            tolerance=args.tolerance,
            same_corpus=same_data,
        )
        if rel > args.tolerance:
            log(f"held-out loss {res.final_heldout_loss:.4f} differs from {ref_loss:.4f} by {rel:.2%}")
            rc_code = 1
    print(json.dumps(summary))
    return rc_code


if __name__ == "__main__":
    sys.exit(main())
