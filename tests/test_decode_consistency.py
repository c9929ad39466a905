"""Invariants of the cached paths (MaxText's decode-consistency test and friends): greedy
decode with the latent cache equals the teacher-forced argmax rollout; chunked prefill
equals one-shot prefill; a batch of two decodes like each row alone.

All calls share one cache length (greedy_rollout's 64-token bucket) and a few token counts, so
the whole file compiles the forward only five times."""

from __future__ import annotations

import numpy as np
import pytest

from hmoe_jax.model.generate import greedy_rollout, teacher_forced_logits
from hmoe_jax.model.model import forward, init_cache
from hmoe_jax.plan.buckets import CACHE_BUCKET
from tests.hf_ref import build_hf_model, params_from_state, tiny_config

P, N = 9, 24  # prompt tokens, generated tokens: sequences of 33, teacher-forced T = 32
S = CACHE_BUCKET


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config("deepseek_v3_tiny", num_hidden_layers=2, first_k_dense_replace=1)
    _, state = build_hf_model(cfg, seed=3)
    params = params_from_state(cfg, state)
    prompt = [int(t) for t in np.random.default_rng(4).integers(2, cfg.vocab_size, size=P)]
    tokens = greedy_rollout(params, cfg, prompt, N)
    seq = np.asarray(prompt + tokens, np.int32)
    tf = teacher_forced_logits(params, cfg, seq[:-1].tolist())  # [32, V]: row i predicts seq[i+1]
    return cfg, params, tokens, seq, tf


def test_greedy_decode_equals_teacher_forced_rollout(model):
    _, _, tokens, seq, tf = model
    assert len(tokens) == N
    assert tf[P - 1 :].argmax(-1).tolist() == tokens == seq[P:].tolist()


def test_decode_step_logits_equal_teacher_forced(model):
    """Stronger than argmax equality: the logits of every cached decode step match."""
    cfg, params, _, seq, tf = model
    logits, cache = forward(params, cfg, seq[None, :P], init_cache(cfg, 1, S), 0)
    steps = [np.asarray(logits[0])]
    for pos in range(P, len(seq) - 1):
        logits, cache = forward(params, cfg, seq[None, pos : pos + 1], cache, pos)
        steps.append(np.asarray(logits[0]))
    out = np.concatenate(steps)  # [32, V]
    np.testing.assert_allclose(out, tf, rtol=0, atol=1e-5 * np.abs(tf).max())


def test_chunked_prefill_equals_one_shot(model):
    cfg, params, _, seq, tf = model
    t = len(seq) - 1
    _, one_cache = forward(params, cfg, seq[None, :t], init_cache(cfg, 1, S), 0)
    cache = init_cache(cfg, 1, S)
    parts = []
    for start in (0, P, 2 * P):  # three chunks of P: start_pos > 0 with T > 1
        logits, cache = forward(params, cfg, seq[None, start : start + P], cache, start)
        parts.append(np.asarray(logits[0]))
    for pos in range(3 * P, t):  # the rest token by token
        logits, cache = forward(params, cfg, seq[None, pos : pos + 1], cache, pos)
        parts.append(np.asarray(logits[0]))
    np.testing.assert_allclose(np.concatenate(parts), tf, rtol=0, atol=1e-5 * np.abs(tf).max())
    for got, ref in ((cache.latent, one_cache.latent), (cache.k_rope, one_cache.k_rope)):
        got, ref = np.asarray(got), np.asarray(ref)
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
        assert not got[:, :, t:].any()  # nothing written past the tokens


def test_batch_rows_are_independent(model):
    cfg, params, _, seq, _ = model
    rows = np.stack([seq[:P], seq[P : 2 * P]])  # [2, P]
    both, cache = forward(params, cfg, rows, init_cache(cfg, 2, S), 0)
    step, _ = forward(params, cfg, rows[:, :1], cache, P)
    for r in range(2):
        alone, c1 = forward(params, cfg, rows[r : r + 1], init_cache(cfg, 1, S), 0)
        alone_step, _ = forward(params, cfg, rows[r : r + 1, :1], c1, P)
        scale = np.abs(np.asarray(alone)).max()
        np.testing.assert_allclose(np.asarray(both[r]), np.asarray(alone[0]), rtol=0, atol=1e-5 * scale)
        np.testing.assert_allclose(np.asarray(step[r]), np.asarray(alone_step[0]), rtol=0, atol=1e-5 * scale)
