"""Shape buckets: lengths rounded up so that requests of similar size share one compiled
program (masked slots cost a little attention work only). Plain python: the model,
the engine and the CLI warm-up all size caches with it, so they compile the same shapes."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

CACHE_BUCKET = 64  # KV-cache length granularity, tokens


def cache_len(tokens: int) -> int:
    """The KV-cache length that holds `tokens` tokens: rounded up to CACHE_BUCKET."""
    if tokens < 0:
        raise ValueError(f"cache_len: tokens must be >= 0, got {tokens}")
    return -(-int(tokens) // CACHE_BUCKET) * CACHE_BUCKET


PREFILL_MIN_BUCKET = 64  # smallest padded prefill chunk, tokens
PREFILL_STEP = 512  # past it, chunks pad to a multiple of this (not the next power of two)


def prefill_bucket(tokens: int) -> int:
    """The padded token count of a prefill chunk of `tokens` tokens: the next power of two
    >= PREFILL_MIN_BUCKET up to PREFILL_STEP (64, 128, 256, 512: the paper policy's 512-token
    chunks), past it the next multiple of PREFILL_STEP. A bounded set of programs covers
    every chunk length; the padded rows (they run attention, the experts and the hops like
    real ones) are under 2x a short chunk and under PREFILL_STEP tokens for a long one (a
    power of two there would nearly double a 1,025-token prompt's work)."""
    if tokens < 1:
        raise ValueError(f"prefill_bucket: tokens must be >= 1, got {tokens}")
    t = int(tokens)
    if t <= PREFILL_STEP:
        return max(PREFILL_MIN_BUCKET, 1 << (t - 1).bit_length())
    return -(-t // PREFILL_STEP) * PREFILL_STEP


def chunk_pad_tokens(schedule: str, tokens: int, start_pos: int, max_len: int) -> int:
    """The token count a prefill chunk of `tokens` real tokens at start_pos runs as
    (Engine.prefill_seq, and the simulator's serving runner prices the same): the cpu
    schedule's chunks pad to prefill_bucket(tokens) when the pool row (max_len slots) has room
    for the padded tail, so a few programs serve every chunk length; any other schedule, or no
    room, runs the exact length. The padded rows cost like real ones (attention, experts,
    hops): on a compute-bound stand-in a 16-token chunk costs about what 64 tokens do."""
    if schedule != "cpu":
        return int(tokens)
    tp = prefill_bucket(tokens)
    return tp if start_pos + tp <= max_len else int(tokens)


def padded_chunk_plan(
    build: Callable[[int], Any], schedule: str, tokens: int, start_pos: int, max_len: int
) -> tuple[Any, int]:
    """(plan, tokens it runs) of a prefill chunk of `tokens` real tokens, as Engine.prefill_seq
    runs it and the simulator's serving runner prices it: build(chunk_pad_tokens(...)), and
    build(tokens) where that padded plan splits the span (its last piece could lack the last
    real token). build(n): the plan of an n-token chunk at start_pos."""
    tp = chunk_pad_tokens(schedule, tokens, start_pos, max_len)
    plan = build(tp)
    if tp > tokens and int(plan.meta.get("chunk_tokens", tp)) < tp:
        return build(tokens), int(tokens)
    return plan, tp


def prefill_buckets(max_tokens: int) -> list[int]:
    """Every prefill_bucket of a chunk of 1..max_tokens tokens."""
    return sorted({prefill_bucket(t) for t in range(1, int(max_tokens) + 1)})


EXPERT_ROWS_MIN = 16  # smallest expert group, token-expert rows
EXPERT_ROWS_STEP = 4096  # past it, a group's rows pad to a multiple of this


def expert_rows_bucket(rows: int) -> int:
    """The static row count of an expert group of `rows` token-expert rows (runtime
    pieces.experts_group and its memory estimate, plan/memory.experts_group_temp): the next
    power of two >= EXPERT_ROWS_MIN up to EXPERT_ROWS_STEP, past it the next multiple of
    EXPERT_ROWS_STEP. A power of two past it doubled a big group's buffers at each step: an
    slp slot's worst case (all T tokens on one expert) went from 32,768 to 65,536 rows between
    a 32K and a 34K prompt, and on the paper's box the ring lost 49 of its 113 slots there, a
    10% cliff in tok/s (tests/test_ring_policy.py)."""
    if rows < 0:
        raise ValueError(f"expert_rows_bucket: rows must be >= 0, got {rows}")
    n = max(int(rows), 1)
    if n <= EXPERT_ROWS_STEP:
        return max(EXPERT_ROWS_MIN, 1 << (n - 1).bit_length())
    return -(-n // EXPERT_ROWS_STEP) * EXPERT_ROWS_STEP


@functools.lru_cache(maxsize=4096)
def expected_expert_rows_bucket(tokens: int, group: int, k: int, experts: int) -> float:
    """The expected static row count pieces.experts_group runs a group of `group` experts
    at, for `tokens` tokens each routed to k of `experts` uniformly (the plans' routing
    estimate): E[expert_rows_bucket(X) * (X > 0)], X the group's token-expert rows (an
    empty group is skipped, ops.experts_acc). One expert's X is Binomial(tokens, k / experts)
    exactly; a group of several is taken as Binomial(tokens * group, k / experts) (the same
    mean; its k picks are distinct, so the true spread is a little narrower). A group's rows
    scatter around their mean and the bucket rounds each draw up: at 64 expected rows a
    quarter to a half of the groups of a 256-token prompt run at 128 rows."""
    n, p = int(tokens) * int(group), min(int(k) / int(experts), 1.0)
    if n <= 0 or p <= 0.0:
        return 0.0
    if p >= 1.0:
        return float(expert_rows_bucket(n))
    mean, sd = n * p, math.sqrt(n * p * (1.0 - p))
    lo, hi = max(1, int(mean - 12 * sd)), min(n, int(math.ceil(mean + 12 * sd)))
    log_p, log_q, log_n = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    total = 0.0
    for x in range(lo, hi + 1):  # mass outside mean +- 12 sd is below 1e-30
        log_pmf = log_n - math.lgamma(x + 1) - math.lgamma(n - x + 1) + x * log_p + (n - x) * log_q
        total += expert_rows_bucket(x) * math.exp(log_pmf)
    return total
