"""`hmoe serve` (the OpenAI-compatible server, hmoe_jax/serve/http_server.py) and
`hmoe bench serve` (the load generator, hmoe_jax/bench/): their flags. docs/serve_http.md.

  hmoe serve [--checkpoint DIR] [--host 127.0.0.1] [--port 8000] [--policy NAME]
             [--policy-option KEY=VALUE ...] [--served-model-name NAME] [--max-model-len N]
             [--max-num-seqs N] [--max-in-flight N] [--devices N] [--precision bf16|f32] [--pd]
             [--api-key KEY] [--max-request-bytes N] [--upload-timeout-s S] [--allowed-hosts H,...] [--allowed-origins O,...]
             [--generation-config auto|none|DIR] [--reasoning-parser deepseek_r1] [--compile-cache DIR|none]
  hmoe bench serve --url URL (--scenario NAME | --dataset FILE) [--endpoint completions|chat]
             [--request-rate R] [--burstiness G] [--max-concurrency C]
             [--goodput ttft:MS tpot:MS e2el:MS] [--result-file FILE]
`bench` needs no jax: main() skips the compilation cache for it (needs_jax=False).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def _serve(args: argparse.Namespace) -> int:
    import time

    from hmoe_jax.cli.run import build_run
    from hmoe_jax.io.errors import InputError
    from hmoe_jax.serve.http_server import configure_compile_cache, serve

    args.t_start_s = time.perf_counter()
    if args.pd and (args.hf_overrides is not None or args.experts_format != "stored"):
        # the --pd workers load the checkpoint themselves, from its path alone
        raise InputError("--pd: --hf-overrides / --experts-format are not passed to the workers; drop --pd")
    configure_compile_cache(args.compile_cache)  # before anything compiles
    return serve(args, build_run(args))


def _bench_serve(args: argparse.Namespace) -> int:
    from hmoe_jax.bench import BenchError
    from hmoe_jax.bench.runner import cmd_bench_serve
    from hmoe_jax.io.errors import InputError

    try:
        return cmd_bench_serve(args)
    except BenchError as e:
        raise InputError(str(e)) from None


def add_serve_parsers(sub: Any) -> None:
    from hmoe_jax.bench.args import add_bench_serve_args
    from hmoe_jax.cli.run import add_generation_config_arg, add_run_args
    from hmoe_jax.policies.registry import DEFAULT_POLICY, policy_names

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, metrics)")
    add_run_args(s)
    add_generation_config_arg(s)
    s.add_argument("--host", default="127.0.0.1", help="bind address (default: localhost only)")
    s.add_argument("--port", type=int, default=8000, help="0: any free port (printed on stderr)")
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        "(default: $HMOE_API_KEY if set, else no key)",
    )
    s.add_argument(
        "--max-request-bytes",
        type=int,
        default=None,
        help="largest request body; past it 413 before the body is read (default 4 MiB)",
    )
    s.add_argument(
        "--upload-timeout-s",
        type=float,
        default=None,
        help="a request body must arrive whole within this many seconds, else 408 (default 60)",
    )
    s.add_argument(
        "--allowed-hosts",
        default=None,
        metavar="H,...",
        help="Host header names answered, '*' any (default: localhost names on loopback, else the --host)",
    )
    s.add_argument(
        "--reasoning-parser",
        choices=("deepseek_r1",),
        default=None,
        help="chat: text up to </think> as reasoning_content (vLLM's flag; default: off, all text is content)",
    )
    s.add_argument(
        "--allowed-origins",
        default=None,
        metavar="O,...",
        help="CORS: browser origins allowed, '*' any (default: none, no CORS headers)",
    )
    s.add_argument(
        "--policy",
        choices=policy_names(),
        default=None,
        help=f"request-scheduling policy (default: {DEFAULT_POLICY}; with --pd: fcfs)",
    )
    s.add_argument(
        "--policy-option", action="append", default=[], metavar="KEY=VALUE", help="policy option, repeatable"
    )
    s.add_argument(
        "--served-model-name", default=None, help="the model id clients send (default: checkpoint name)"
    )
    s.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="prompt + completion tokens per request (default 4096)",
    )
    s.add_argument("--max-num-seqs", type=int, default=8, help="KV pool rows: sequences decoded together")
    s.add_argument(
        "--max-in-flight",
        type=int,
        default=None,
        help="admission bound: accepted unfinished requests; past it 429 + Retry-After (default 8 x max-num-seqs)",
    )
    s.add_argument(
        "--devices", type=int, default=None, help="accelerators (stand-in CPU devices without a GPU)"
    )
    s.add_argument("--precision", choices=["bf16", "f32"], default="bf16")
    s.add_argument(
        "--expert-fn", choices=["auto", "ref", "ffi"], default="auto", help="host routed-expert path"
    )
    s.add_argument(
        "--system",
        default=None,
        help="configs/systems/<NAME>.toml profile or a path, with --devices of its accelerators",
    )
    s.add_argument("--pd", action="store_true", help="prefill/decode disaggregation: two worker processes")
    s.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds to finish in-flight requests on SIGTERM"
    )
    s.add_argument(
        "--no-warmup",
        action="store_true",
        help="do not warm up (every decode batch size and full prefill chunk compiled, one request; "
        "/health answers 503 until done)",
    )
    s.add_argument(
        "--compile-cache",
        default=None,
        metavar="DIR|none",
        help="JAX persistent compilation cache: a restart loads the compiled programs instead of "
        "compiling them (default: $HMOE_CACHE/xla or ~/.cache/hmoe-jax/xla; none: off)",
    )
    s.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="write a Perfetto trace of the serving path (scheduler, HTTP/SSE, compiles) here at shutdown",
    )
    s.add_argument("--trace-engine", action="store_true", help="with --trace: every engine op too (slower)")
    s.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's and hmoe_jax's log lines on stderr (a --pd worker's death and restart: warning)",
    )
    s.set_defaults(func=_serve)

    b = sub.add_parser("bench", help="benchmarks of a running server")
    bsub = b.add_subparsers(dest="bench_command", required=True)
    bs = bsub.add_parser("serve", help="load generator for an OpenAI-compatible server (vLLM's metrics)")
    add_bench_serve_args(bs)
    bs.set_defaults(func=_bench_serve, needs_jax=False)
