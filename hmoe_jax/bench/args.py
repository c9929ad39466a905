"""The flags of `hmoe bench serve` / `python -m hmoe_jax.bench serve` (argparse only: the
`hmoe` CLI builds its parser from this without importing the HTTP client)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hmoe_jax.bench.workload import SCENARIOS


def add_bench_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--scenario", choices=SCENARIOS, help="a built-in request mix")
    src.add_argument("--dataset", type=Path, help="JSON Lines: {'prompt': text or ids, 'output_len': N}")
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument("--model", default=None, help="model id (default: the server's first /v1/models entry)")
    p.add_argument(
        "--num-prompts", type=int, default=None, help="requests (scenarios decode_n, random; dataset cap)"
    )
    p.add_argument("--prompt-len", type=int, default=32, help="short prompts, tokens")
    p.add_argument("--output-len", type=int, default=32, help="decode streams' output tokens")
    p.add_argument("--long-prompt-len", type=int, default=1024, help="the long prefill's prompt tokens")
    p.add_argument("--range-ratio", type=float, default=0.0, help="scenario random: lengths +- this fraction")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="requests in flight at most (closed loop)"
    )
    p.add_argument(
        "--goodput", nargs="+", default=None, metavar="NAME:MS", help="SLOs: ttft:MS tpot:MS e2el:MS"
    )
    p.add_argument("--percentiles", default="50,90,99", help="comma-separated percentiles to report")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let the model stop at EOS (lengths vary)")
    p.add_argument("--no-initial-test", action="store_true", help="skip the one-request check before the run")
    p.add_argument("--result-file", type=Path, default=None, help="also write the JSON result here")
    p.add_argument(
        "--extra-body",
        default=None,
        metavar="JSON",
        help="fields merged into every request body, e.g. '{\"cache_prompt\": false}' for llama-server",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
