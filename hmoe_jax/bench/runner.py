"""Run a benchmark: send the requests at their arrival times (and triggers), at most
max_concurrency at once, time each (client.py), summarise (stats.py).

    hmoe bench serve --url http://127.0.0.1:8000 --scenario decode_n --num-prompts 4
    hmoe bench serve --url ... --dataset prompts.jsonl --request-rate 2 --burstiness 0.5 \
        --max-concurrency 8 --goodput ttft:500 tpot:50

Before the run, one request (the first, at most 4 output tokens) checks that the server
answers (vLLM's initial test run); --no-initial-test skips it. Progress goes to stderr; the
summary table, then one JSON line (vLLM's keys) to stdout, and to --result-file.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import sys
import time
from collections.abc import Sequence
from typing import Any

import httpx

from hmoe_jax.bench import BenchError
from hmoe_jax.bench.client import limits, payload, send
from hmoe_jax.bench.stats import RequestOutput, calculate_metrics, parse_goodput
from hmoe_jax.bench.workload import (
    BenchRequest,
    ScenarioSizes,
    arrival_gaps,
    load_dataset,
    scenario,
)


@dataclasses.dataclass
class BenchConfig:
    url: str
    endpoint: str = "completions"  # or "chat"
    model: str | None = None
    request_rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    goodput: dict[str, float] = dataclasses.field(default_factory=dict)
    percentiles: tuple[float, ...] = (50, 90, 99)
    seed: int = 0
    ignore_eos: bool = True
    initial_test: bool = True
    progress: bool = True
    timeout_s: float = 6 * 3600  # vLLM's client timeout
    extra_body: dict[str, Any] = dataclasses.field(default_factory=dict)  # merged into every body


def _api(cfg: BenchConfig) -> str:
    return "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"


async def _model_id(client: httpx.AsyncClient) -> str:
    r = await client.get("/v1/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_benchmark(cfg: BenchConfig, requests: Sequence[BenchRequest]) -> dict[str, Any]:
    if not requests:
        raise ValueError("no requests to send")
    chat = cfg.endpoint == "chat"
    timeout = httpx.Timeout(cfg.timeout_s)
    async with httpx.AsyncClient(base_url=cfg.url.rstrip("/"), limits=limits(), timeout=timeout) as client:
        model = cfg.model or await _model_id(client)

        def body(r: BenchRequest, n_out: int | None = None) -> dict[str, Any]:
            return payload(
                model,
                r.prompt,
                n_out or r.output_len,
                chat=chat,
                ignore_eos=cfg.ignore_eos,
                extra=cfg.extra_body,
            )

        if cfg.initial_test:
            first = requests[0]
            o = await send(
                client, _api(cfg), body(first, min(first.output_len, 4)), first.prompt_len, chat=chat
            )
            if not o.success:
                raise RuntimeError(f"initial test request failed: {o.error}")
        bar = _progress(len(requests), cfg.progress)
        firsts = [asyncio.Event() for _ in requests]
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

        async def one(i: int, r: BenchRequest) -> RequestOutput:
            for j in r.after_first_token_of:
                await firsts[j].wait()
            if sem is not None:
                async with sem:
                    o = await send(
                        client, _api(cfg), body(r), r.prompt_len, chat=chat, on_first_token=firsts[i].set
                    )
            else:
                o = await send(
                    client, _api(cfg), body(r), r.prompt_len, chat=chat, on_first_token=firsts[i].set
                )
            firsts[i].set()  # a failed request must not hold back its dependants forever
            bar.update(1)
            return o

        gaps = arrival_gaps(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
        t0 = time.perf_counter()
        tasks = []
        for i, (r, gap) in enumerate(zip(requests, gaps)):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(i, r)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
    res = calculate_metrics(outputs, duration, goodput=cfg.goodput, percentiles=cfg.percentiles)
    res["generated_texts"] = [o.generated_text for o in outputs]
    res["retries"] = [o.retries for o in outputs]
    res["start_s"] = [o.start_s - t0 for o in outputs]
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if chat else "openai",
        "endpoint": _api(cfg),
        "model_id": model,
        "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "goodput": cfg.goodput or None,
        **res,
    }


class _NoBar:
    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


def _progress(total: int, on: bool) -> Any:
    if not on:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, file=sys.stderr, desc="requests", unit="req")


def summary_lines(r: dict[str, Any], percentiles: Sequence[float]) -> list[str]:
    from hmoe_jax.bench.stats import percentile_key

    lines = [
        "============ Serving Benchmark Result ============",
        f"Successful requests:                     {r['completed']}",
        f"Failed requests:                         {r['failed']}",
        f"Benchmark duration (s):                  {r['duration']:.2f}",
        f"Total input tokens:                      {r['total_input_tokens']}",
        f"Total generated tokens:                  {r['total_output_tokens']}",
        f"Request throughput (req/s):              {r['request_throughput']:.2f}",
        f"Output token throughput (tok/s):         {r['output_throughput']:.2f}",
        f"Total token throughput (tok/s):          {r['total_token_throughput']:.2f}",
    ]
    if r.get("request_goodput") is not None:
        lines.append(f"Request goodput (req/s):                 {r['request_goodput']:.2f}")
    for name, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                        ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):  # fmt: skip
        lines.append(f"{'-' * 10}{title}{'-' * 10}")
        lines.append(f"Mean {name.upper()} (ms):{r[f'mean_{name}_ms']:>26.2f}")
        lines.append(f"Median {name.upper()} (ms):{r[f'median_{name}_ms']:>24.2f}")
        for p in percentiles:
            k = percentile_key(p)
            lines.append(f"P{k[1:]} {name.upper()} (ms):{r[f'{k}_{name}_ms']:>26.2f}")
    lines.append("=" * 50)
    return lines


def cmd_bench_serve(args: argparse.Namespace) -> int:
    try:
        goodput = parse_goodput(args.goodput or [])
        percentiles = tuple(float(p) for p in args.percentiles.split(",") if p.strip())
        if args.dataset is not None:
            reqs = load_dataset(args.dataset, args.num_prompts)
        else:
            sizes = ScenarioSizes(
                num_prompts=args.num_prompts or 8,
                prompt_len=args.prompt_len,
                output_len=args.output_len,
                long_prompt_len=args.long_prompt_len,
                range_ratio=args.range_ratio,
            )
            reqs = scenario(args.scenario, sizes, args.seed)
        if args.max_concurrency is not None and args.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
        arrival_gaps(1, args.request_rate, args.burstiness)  # validates both
        extra = json.loads(args.extra_body) if args.extra_body else {}
        if not isinstance(extra, dict):
            raise ValueError(f"--extra-body must be a JSON object, got {args.extra_body!r}")
    except json.JSONDecodeError as e:
        raise BenchError(f"--extra-body is not valid JSON: {e}") from None
    except (ValueError, OSError) as e:
        raise BenchError(str(e)) from None
    cfg = BenchConfig(
        url=args.url,
        endpoint=args.endpoint,
        model=args.model,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        goodput=goodput,
        percentiles=percentiles,
        seed=args.seed,
        ignore_eos=not args.no_ignore_eos,
        initial_test=not args.no_initial_test,
        progress=not args.quiet,
        extra_body=extra,
    )
    try:
        res = asyncio.run(run_benchmark(cfg, reqs))
    except (httpx.HTTPError, RuntimeError, OSError) as e:
        raise BenchError(f"bench serve against {args.url}: {e}") from None
    res["scenario"] = args.scenario
    res["dataset"] = str(args.dataset) if args.dataset else None
    for line in summary_lines(res, percentiles):
        print(line)
    line = json.dumps(res)
    if args.result_file is not None:
        args.result_file.write_text(line + "\n")
    print(line)
    return 0
