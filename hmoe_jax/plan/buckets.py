"""Shape buckets: lengths rounded up so that requests of similar size share one compiled
program (masked slots cost a little attention work only). Plain python: the model,
the engine and the CLI warm-up all size caches with it, so they compile the same shapes."""

from __future__ import annotations

CACHE_BUCKET = 64  # KV-cache length granularity, tokens


def cache_len(tokens: int) -> int:
    """The KV-cache length that holds `tokens` tokens: rounded up to CACHE_BUCKET."""
    if tokens < 0:
        raise ValueError(f"cache_len: tokens must be >= 0, got {tokens}")
    return -(-int(tokens) // CACHE_BUCKET) * CACHE_BUCKET


PREFILL_MIN_BUCKET = 64  # smallest padded prefill chunk, tokens


def prefill_bucket(tokens: int) -> int:
    """The padded token count of a prefill chunk of `tokens` tokens: the next power of two
    >= PREFILL_MIN_BUCKET. A bounded set of programs covers every chunk length (64, 128,
    256, 512 for the paper policy's 512-token chunks) at < 2x the chunk's work (the padded
    rows run attention, the experts and the hops like real ones; < 64 extra rows below 128)."""
    if tokens < 1:
        raise ValueError(f"prefill_bucket: tokens must be >= 1, got {tokens}")
    return max(PREFILL_MIN_BUCKET, 1 << (int(tokens) - 1).bit_length())


def prefill_buckets(max_tokens: int) -> list[int]:
    """Every prefill_bucket of a chunk of 1..max_tokens tokens."""
    return sorted(
        {prefill_bucket(t) for t in [1, max_tokens] + [1 << k for k in range(6, 31)] if t <= max_tokens}
    )
