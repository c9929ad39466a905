"""Per-request measurements and the summary `hmoe bench serve` reports, with vLLM's
definitions (vllm/benchmarks/serve.py `calculate_metrics`) and JSON key names:

- TTFT: request sent -> first chunk carrying non-empty text.
- ITL: every gap between consecutive non-empty chunks, pooled over all requests.
- E2EL: request sent -> last chunk with choices.
- TPOT, per request: (E2EL - TTFT) / (output tokens - 1), for requests with > 1 token;
  output tokens from the server's usage (stream_options.include_usage), else the number
  of non-empty chunks.
- goodput: requests per second meeting every SLO given (ttft / tpot / e2el, in ms; a
  request of one token counts TPOT 0 for it).
Each of ttft, tpot, itl, e2el gets mean_/median_/std_ (population std, numpy's default) and
p<P>_ keys in ms, P from the percentile list (vLLM: "p99" for 99, "p99.9" for 99.9).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

MS = 1000.0
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclasses.dataclass
class RequestOutput:
    prompt_len: int
    success: bool = False
    ttft: float = 0.0  # seconds
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0  # E2EL, seconds
    output_tokens: int = 0
    generated_text: str = ""
    error: str = ""
    start_s: float = 0.0  # perf_counter when sent (the attempt that got a response)
    retries: int = 0  # attempts that failed before the server sent any byte (client.py)


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 500.0, 'tpot': 50.0} (ms)."""
    out: dict[str, float] = {}
    for it in items:
        name, sep, val = it.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"--goodput: expected NAME:MS with NAME in {GOODPUT_METRICS}, got {it!r}")
        try:
            ms = float(val)
        except ValueError:
            raise ValueError(f"--goodput {it!r}: {val!r} is not a number of milliseconds") from None
        if ms < 0:
            raise ValueError(f"--goodput {it!r}: must be >= 0 ms")
        out[name] = ms
    return out


def percentile_key(p: float) -> str:
    return f"p{int(p)}" if float(p) == int(p) else f"p{p}"


def _summary(name: str, values: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    v = np.asarray(values if len(values) else [0.0], np.float64) * MS
    out = {
        f"mean_{name}_ms": float(np.mean(v)),
        f"median_{name}_ms": float(np.median(v)),
        f"std_{name}_ms": float(np.std(v)),
    }
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = float(np.percentile(v, p))
    return out


def calculate_metrics(
    outputs: Sequence[RequestOutput],
    duration_s: float,
    *,
    goodput: Mapping[str, float] | None = None,
    percentiles: Sequence[float] = (50, 90, 99),
) -> dict[str, Any]:
    ttfts, tpots, all_tpots, itls, e2els, out_lens = [], [], [], [], [], []
    total_input = completed = good = 0
    for o in outputs:
        if not o.success:
            out_lens.append(0)
            continue
        n = o.output_tokens
        out_lens.append(n)
        total_input += o.prompt_len
        tpot = 0.0
        if n > 1:
            tpot = (o.latency - o.ttft) / (n - 1)
            tpots.append(tpot)
        all_tpots.append(tpot)
        itls.extend(o.itl)
        ttfts.append(o.ttft)
        e2els.append(o.latency)
        completed += 1
    if goodput:
        per = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        names = list(goodput)
        for vals in zip(*(per[k] for k in names)):
            good += all(v * MS <= goodput[k] for k, v in zip(names, vals))
    dur = max(duration_s, 1e-9)
    total_output = sum(out_lens)
    res: dict[str, Any] = {
        "duration": duration_s,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / dur,
        "request_goodput": good / dur if goodput else None,
        "output_throughput": total_output / dur,
        "total_token_throughput": (total_input + total_output) / dur,
    }
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        res.update(_summary(name, vals, percentiles))
    res.update(
        input_lens=[o.prompt_len for o in outputs],
        output_lens=out_lens,
        ttfts=[o.ttft if o.success else None for o in outputs],
        itls=[o.itl for o in outputs],
        errors=[o.error for o in outputs],
    )
    return res


def paired_ratios(ours: Mapping[Any, float], theirs: Mapping[Any, float]) -> list[float]:
    """Side-by-side ratios of two servers' runs keyed alike (e.g. (round, repeat) of runs
    made back to back, so a shared machine's phase moves both): ours[k] / theirs[k] for each
    key both have, in key order. A key missing on either side (a failed run) has no pair."""
    return [float(ours[k]) / float(theirs[k]) for k in sorted(ours) if k in theirs and theirs[k]]
