"""Prefill + incremental decode over the latent cache, with timing.

`generate` measures ttft_s (prefill plus the first sampled token, synchronised with
block_until_ready) and the seconds of every later decode step. Sampling is greedy when
temperature == 0, else temperature + top-p (nucleus) with an explicit PRNG seed.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.model import forward, init_cache
from hmoe_jax.model.moe import ExpertFn, experts_ref
from hmoe_jax.model.params import ModelParams
from hmoe_jax.plan.buckets import cache_len


@dataclasses.dataclass
class GenerateResult:
    tokens: list[int]  # generated ids (the prompt excluded; a stop id is included)
    ttft_s: float  # prefill + first token
    decode_s: list[float]  # one entry per later token

    @property
    def tpot_s(self) -> float:
        """Median seconds per output token after the first (nan if only one token)."""
        return float(np.median(self.decode_s)) if self.decode_s else float("nan")


@functools.partial(jax.jit, static_argnames=("temperature", "top_p"))
def sample(logits: jax.Array, key: jax.Array, temperature: float, top_p: float) -> jax.Array:
    """logits [V] -> token id (int32 scalar). Greedy when temperature == 0."""
    if temperature == 0.0:
        return jnp.argmax(logits).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_p < 1.0:
        order = jnp.argsort(-logits)
        probs = jax.nn.softmax(logits[order])
        # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
        keep_sorted = (jnp.cumsum(probs) - probs) < top_p
        keep = jnp.zeros_like(keep_sorted).at[order].set(keep_sorted)
        logits = jnp.where(keep, logits, -jnp.inf)
    return jax.random.categorical(key, logits).astype(jnp.int32)


def check_prompt(cfg: ModelConfig, prompt_ids: Sequence[int], max_new_tokens: int) -> np.ndarray:
    """Validated prompt ids [T] int32: non-empty, in [0, vocab), and T + max_new_tokens within
    max_position_embeddings; else a one-line ValueError naming the value."""
    ids = np.asarray(list(prompt_ids), np.int64)
    if ids.ndim != 1 or ids.size == 0:
        raise ValueError(f"generate: prompt_ids must be a non-empty 1-D list of ids, got shape {ids.shape}")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        bad = int(ids.max() if ids.max() >= cfg.vocab_size else ids.min())
        raise ValueError(f"generate: token id {bad} out of range [0, {cfg.vocab_size})")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    total = ids.size + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(
            f"generate: prompt ({ids.size} tokens) + max_new_tokens ({max_new_tokens}) = {total} "
            f"exceeds the context max_position_embeddings={cfg.max_position_embeddings}"
        )
    return ids.astype(np.int32)


def generate(
    params: ModelParams,
    cfg: ModelConfig,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    expert_fn: ExpertFn = experts_ref,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_ids: Sequence[int] | None = None,
) -> GenerateResult:
    """Batch-1 generation. stop_ids defaults to cfg.eos_ids; generation stops after a stop
    id is produced (it is returned) or after max_new_tokens."""
    ids = check_prompt(cfg, prompt_ids, max_new_tokens)
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"generate: need temperature >= 0 and 0 < top_p <= 1, got {temperature}, {top_p}")
    stops = set(cfg.eos_ids if stop_ids is None else stop_ids)
    max_len = cache_len(ids.size + max_new_tokens)
    # Once, and finished before the clock starts: later calls reuse the device buffers.
    params = jax.block_until_ready(jax.device_put(params))
    cache = init_cache(cfg, 1, max_len)
    key = jax.random.key(seed)
    temperature, top_p = float(temperature), float(top_p)

    t0 = time.perf_counter()
    logits, cache = forward(params, cfg, ids[None, :], cache, 0, expert_fn)
    key, sub = jax.random.split(key)
    tok = int(sample(logits[0, -1], sub, temperature, top_p).block_until_ready())
    ttft_s = time.perf_counter() - t0

    tokens, decode_s = [tok], []
    pos = ids.size
    while len(tokens) < max_new_tokens and tok not in stops:
        t0 = time.perf_counter()
        logits, cache = forward(params, cfg, np.array([[tok]], np.int32), cache, pos, expert_fn)
        key, sub = jax.random.split(key)
        tok = int(sample(logits[0, -1], sub, temperature, top_p).block_until_ready())
        decode_s.append(time.perf_counter() - t0)
        tokens.append(tok)
        pos += 1
    return GenerateResult(tokens=tokens, ttft_s=ttft_s, decode_s=decode_s)


def teacher_forced_logits(
    params: ModelParams, cfg: ModelConfig, ids: Sequence[int], expert_fn: ExpertFn = experts_ref
) -> np.ndarray:
    """Logits [T, V] f32 of every position of `ids` (one prefill, no sampling). The cache is
    bucketed like generate's, so both share compiled prefills."""
    arr = check_prompt(cfg, ids, 1)[None, :]  # [1, T]
    max_len = cache_len(arr.shape[1])
    logits, _ = forward(params, cfg, arr, init_cache(cfg, 1, max_len), 0, expert_fn)
    return np.asarray(logits)[0]
