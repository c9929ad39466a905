"""`hmoe convert`: rewrite a checkpoint in another format (fp8, bf16, f32) or as the shared
host weight arena (io/arena.py).

  hmoe convert --checkpoint IN --out OUT [--format fp8|bf16|f32|arena] [--shard-bytes N]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hmoe_jax.io.errors import InputError


def add_convert_parser(sub: Any) -> None:
    from hmoe_jax.io.writer import DEFAULT_CONVERT_SHARD_BYTES, FORMATS

    cv = sub.add_parser("convert", help="convert a checkpoint (e.g. bf16/f32 -> DeepSeek FP8)")
    cv.add_argument("--checkpoint", type=Path, required=True, help="input checkpoint dir")
    cv.add_argument("--out", type=Path, required=True, help="output checkpoint dir")
    cv.add_argument("--format", choices=[*sorted(FORMATS), "arena"], default="fp8")
    cv.add_argument(
        "--shard-bytes", type=int, default=DEFAULT_CONVERT_SHARD_BYTES, help="max bytes per shard"
    )
    cv.add_argument("--quiet", action="store_true")
    cv.set_defaults(func=cmd_convert)


def cmd_convert(args: argparse.Namespace) -> int:
    from hmoe_jax.io.writer import convert_checkpoint

    if args.shard_bytes is not None and args.shard_bytes <= 0:
        raise InputError(f"--shard-bytes must be > 0, got {args.shard_bytes}")
    if args.format == "arena":  # the shared host weight arena (hmoe_jax.io.arena); no shards
        from hmoe_jax.io.arena import write_arena

        write_arena(args.checkpoint, args.out, progress=not args.quiet)
    else:
        convert_checkpoint(
            args.checkpoint, args.out, fmt=args.format, shard_bytes=args.shard_bytes, progress=not args.quiet
        )
    print(f"wrote {args.out} ({args.format})")
    return 0
