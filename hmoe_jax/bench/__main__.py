"""`python -m hmoe_jax.bench serve ...`: the load generator without the rest of the `hmoe`
CLI (whose parser imports jax), e.g. on a client host; same flags as `hmoe bench serve`."""

from __future__ import annotations

import argparse
import sys

from hmoe_jax.bench import BenchError
from hmoe_jax.bench.args import add_bench_serve_args
from hmoe_jax.bench.runner import cmd_bench_serve


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hmoe_jax.bench")
    sub = ap.add_subparsers(dest="command", required=True)
    add_bench_serve_args(sub.add_parser("serve", help="load generator for an OpenAI-compatible server"))
    args = ap.parse_args(argv)
    try:
        return cmd_bench_serve(args)
    except BenchError as e:
        print(f"hmoe bench: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
