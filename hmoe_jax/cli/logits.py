"""`hmoe logits`: teacher-forced logits of every position of a token sequence.

hmoe logits [--checkpoint DIR] --tokens 1,2,3 --out FILE.npy
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hmoe_jax.cli.run import add_run_args, build_run, check_context, check_ids, parse_tokens
from hmoe_jax.io.errors import InputError


def add_logits_parser(sub: Any) -> None:
    lg = sub.add_parser("logits", help="teacher-forced logits of every position")
    add_run_args(lg)
    lg.add_argument("--tokens", required=True, help="token ids, comma-separated")
    lg.add_argument("--out", type=Path, required=True, help="output .npy, float32 [T, vocab]")
    lg.set_defaults(func=cmd_logits)


def cmd_logits(args: argparse.Namespace) -> int:
    import numpy as np

    from hmoe_jax.model.generate import teacher_forced_logits

    ids = parse_tokens(args.tokens)
    if not args.out.parent.is_dir():  # before the forward pass, not after it
        raise InputError(f"--out: directory {args.out.parent} does not exist")
    run = build_run(args)
    check_ids(ids, run.cfg.vocab_size, "--tokens")
    check_context(len(ids), 0, run, "--tokens")
    logits = np.asarray(teacher_forced_logits(run.params, run.cfg, ids, run.expert_fn), np.float32)  # [T, V]
    np.save(args.out, logits)
    print(f"wrote {args.out}: float32 {list(logits.shape)} logits ({run.model})")
    return 0
