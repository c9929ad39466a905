"""Padded prefill chunks (Engine.prefill_seq, plan/buckets.py prefill_bucket): a cpu chunk of
any length runs as the next power of two >= 64 tokens (past 512: the next multiple of 512), so a few programs serve every
prompt. The padding must change nothing real: each chunked prompt's logits and greedy
tokens equal the independent reference (hmoe_jax.model.generate: plain model, dense
attention, experts_ref, unpadded), prompt logprobs too, and the runs really were padded."""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.model.generate import greedy_rollout, teacher_forced_logits
from hmoe_jax.model.sampling import SamplingParams
from hmoe_jax.plan.buckets import chunk_pad_tokens, padded_chunk_plan, prefill_bucket, prefill_buckets
from hmoe_jax.runtime.synthetic import random_params
from tests.helpers import reference_engine


@functools.cache
def model():
    cfg = named_model_config("deepseek_v3_tiny")
    return cfg, random_params(cfg, seed=3)


@functools.cache
def engine():
    cfg, params = model()
    eng = reference_engine(params, cfg, 1, max_batch=2, max_len=192)
    # one plan chunk per prefill_seq span (the padded span must not be split by the plan)
    eng.system = dataclasses.replace(eng.system, cpu_prefill_chunk_tokens=4096)
    return eng


def _prompt(n: int, seed: int) -> list[int]:
    cfg, _ = model()
    return [int(t) for t in np.random.default_rng(seed).integers(1, cfg.vocab_size, n)]


def test_prefill_bucket_rule():
    got = [prefill_bucket(t) for t in (1, 63, 64, 65, 476, 512, 513, 1025, 1536, 1537)]
    assert got == [64, 64, 64, 128, 512, 512, 1024, 1536, 1536, 2048]
    assert prefill_buckets(512) == [64, 128, 256, 512]
    assert prefill_buckets(1500) == [64, 128, 256, 512, 1024, 1536]
    for t in range(1, 3000):  # the padding is never more than 2x, nor 512 tokens past 512
        b = prefill_bucket(t)
        assert t <= b < max(2 * t, 128) and (t <= 512 or b - t < 512)
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        prefill_bucket(0)


def test_chunk_pad_rule_by_hand():
    """What a chunk runs as (the engine and the simulator's serving runner both use it): the
    cpu schedule pads to the bucket when the row has room, nothing else pads."""
    assert chunk_pad_tokens("cpu", 16, 0, 512) == 64
    assert chunk_pad_tokens("cpu", 16, 448, 512) == 64  # the padded tail ends at slot 512
    assert chunk_pad_tokens("cpu", 16, 449, 512) == 16  # ... one slot past the row: exact
    assert chunk_pad_tokens("cpu", 100, 0, 128) == 128
    assert chunk_pad_tokens("cpu", 100, 1, 128) == 100
    for schedule in ("auto", "slp", "dslp", "ep"):
        assert chunk_pad_tokens(schedule, 16, 0, 512) == 16
    for t in range(1, 700):
        for start, max_len in ((0, 4096), (0, t), (3, 700)):
            fits = start + prefill_bucket(t) <= max_len
            assert chunk_pad_tokens("cpu", t, start, max_len) == (prefill_bucket(t) if fits else t)


def test_padded_chunk_plan_falls_back_where_the_plan_splits_the_padded_span():
    """The engine and the simulator build a chunk's plan through padded_chunk_plan: the padded
    length, unless that plan's own chunks are shorter than it (its last piece could lack the
    last real token), then the exact length."""

    class P:  # a plan's meta is all the rule reads
        def __init__(self, n, chunk):
            self.n, self.meta = n, ({} if chunk is None else {"chunk_tokens": chunk})

    built = []

    def build(chunk):
        def b(n):
            built.append(n)
            return P(n, chunk)

        return b

    plan, n = padded_chunk_plan(build(None), "cpu", 16, 0, 512)
    assert (plan.n, n, built) == (64, 64, [64])
    built.clear()
    plan, n = padded_chunk_plan(build(64), "cpu", 16, 0, 512)  # one chunk of 64: not split
    assert (plan.n, n, built) == (64, 64, [64])
    built.clear()
    plan, n = padded_chunk_plan(build(32), "cpu", 16, 0, 512)  # split into 32s: exact length
    assert (plan.n, n, built) == (16, 16, [64, 16])
    built.clear()
    plan, n = padded_chunk_plan(build(8), "slp", 16, 0, 512)  # not padded: nothing to undo
    assert (plan.n, n, built) == (16, 16, [16])


def _chunked(eng, ids, chunk, params):
    seq = eng.admit(ids, params)
    pads = []
    try:
        while not eng.prefill_seq(seq, "cpu", int(seq.pos) + chunk):
            pads.append(seq.plan_meta["padded_tokens"])
        pads.append(seq.plan_meta["padded_tokens"])
        while not seq.done:
            eng.step([seq])
    finally:
        if not seq.done:
            eng.cancel(seq)
    return seq, pads


@pytest.mark.parametrize("n, chunk", [(21, 8), (70, 32), (100, 64)])
def test_padded_chunks_give_the_reference_tokens_and_logits(n, chunk):
    cfg, params = model()
    eng = engine()
    ids = _prompt(n, n)
    seq, pads = _chunked(eng, ids, chunk, SamplingParams(max_new_tokens=4, stop_ids=()))
    # every chunk was padded (none is a power of two >= 64 but the 64-token ones)
    lens = [min(chunk, n - t) for t in range(0, n, chunk)]
    assert pads == [prefill_bucket(t) - t for t in lens] and any(pads)
    assert seq.tokens == greedy_rollout(params, cfg, ids, 4)
    ref = teacher_forced_logits(params, cfg, ids)[-1]
    np.testing.assert_allclose(np.asarray(seq.prefill_logits)[-1], ref, rtol=2e-5, atol=2e-5)


def test_padded_prefill_keeps_prompt_logprobs_and_all_logits():
    cfg, params = model()
    eng = engine()
    ids = _prompt(37, 1)
    ref = np.asarray(jax.nn.log_softmax(teacher_forced_logits(params, cfg, ids), axis=-1))
    seq, pads = _chunked(eng, ids, 16, SamplingParams(max_new_tokens=1, stop_ids=(), prompt_logprobs=2))
    assert pads == [48, 48, 59]
    lps = seq.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    for t in range(1, len(ids)):  # entry t: the logprob of prompt[t] given prompt[:t]
        assert lps[t].token == ids[t]
        np.testing.assert_allclose(lps[t].logprob, ref[t - 1, ids[t]], rtol=1e-4, atol=1e-4)
        assert [tok for tok, _ in lps[t].top] == list(np.argsort(-ref[t - 1])[:2])
    # whole prompt with all_logits: exactly its positions, equal to the reference's
    seq = eng.admit(ids, SamplingParams(max_new_tokens=1, stop_ids=()))
    eng.prefill_seq(seq, "cpu", all_logits=True)
    assert seq.plan_meta["padded_tokens"] == 64 - 37
    got = np.asarray(seq.prefill_logits)
    assert got.shape == (37, cfg.vocab_size)
    np.testing.assert_allclose(got, teacher_forced_logits(params, cfg, ids), rtol=2e-5, atol=2e-5)


def test_no_room_for_the_padding_runs_the_exact_length():
    cfg, params = model()
    eng = engine()
    # a row of 192 slots: the 70-token chunk at 100 would pad to 128 tokens, past the row
    ids = _prompt(170, 4)
    seq, pads = _chunked(eng, ids, 100, SamplingParams(max_new_tokens=2, stop_ids=()))
    assert pads == [28, 0]
    assert seq.tokens == greedy_rollout(params, cfg, ids, 2)
