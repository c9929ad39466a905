"""Model-level helpers around `forward`: prompt validation, teacher-forced logits and the
plain model's greedy continuation.

Generation itself (sampling, stop ids, timing) is the engine's (hmoe_jax/engine/engine.py,
Engine.generate; `hmoe generate` without --schedule runs its `reference` schedule). What
stays here needs only the model: `greedy_rollout` is the yardstick the engine's schedules
are tested against (one plain forward per token, dense attention, no executor, no pool),
and `teacher_forced_logits` is `hmoe logits`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.model import forward, init_cache
from hmoe_jax.model.moe import ExpertFn, experts_ref
from hmoe_jax.model.params import ModelParams
from hmoe_jax.plan.buckets import cache_len


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


def greedy_rollout(
    params: ModelParams,
    cfg: ModelConfig,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    expert_fn: ExpertFn = experts_ref,
) -> list[int]:
    """The model's greedy continuation: exactly max_new_tokens argmax ids (no stop ids, as
    HF generate with EOS disabled), one prefill then one cached forward per token, on the
    default device. A reference for tests, not a server: no sampling, no timing."""
    ids = check_prompt(cfg, prompt_ids, max_new_tokens)
    # Once: numpy params would otherwise be copied to the device by every forward.
    params = jax.device_put(params)
    cache = init_cache(cfg, 1, cache_len(ids.size + max_new_tokens))
    logits, cache = forward(params, cfg, ids[None, :], cache, 0, expert_fn)
    tokens = [int(np.argmax(np.asarray(logits[0, -1], np.float32)))]
    for pos in range(ids.size, ids.size + max_new_tokens - 1):
        logits, cache = forward(params, cfg, np.array([[tokens[-1]]], np.int32), cache, pos, expert_fn)
        tokens.append(int(np.argmax(np.asarray(logits[0, -1], np.float32))))
    return tokens


def teacher_forced_logits(
    params: ModelParams, cfg: ModelConfig, ids: Sequence[int], expert_fn: ExpertFn = experts_ref
) -> np.ndarray:
    """Logits [T, V] f32 of every position of `ids` (one prefill, no sampling). The cache is
    bucketed like greedy_rollout's, so both share compiled prefills."""
    arr = check_prompt(cfg, ids, 1)[None, :]  # [1, T]
    max_len = cache_len(arr.shape[1])
    logits, _ = forward(params, cfg, arr, init_cache(cfg, 1, max_len), 0, expert_fn)
    return np.asarray(logits)[0]
