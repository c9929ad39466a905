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
