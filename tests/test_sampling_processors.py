"""Logit processors, min-p and logprobs (issue #28): the jitted sampler against the numpy
f64 references written token by token (model/sampling.py *_ref), the engine's logprobs
against a teacher-forced forward of the same model, and the scheduler's streamed logprobs."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from hmoe_jax.model.sampling import (
    RowHistory,
    SamplingParams,
    _filter_row,
    filtered_probs_ref,
    logprobs_ref,
    process_logits_ref,
    process_rows,
    processor_inputs,
    sample_batch,
    token_logprobs,
)
from tests.helpers import tiny_random_model

# ------------------------------------------------------------------ the sampler alone


def _case(rng, v: int):
    """A random row: logits with both signs, a prompt and an output with repeats."""
    logits = rng.normal(0, 3, v).astype(np.float32)
    prompt = rng.integers(0, v, rng.integers(1, 6)).tolist()
    output = rng.integers(0, v, rng.integers(0, 8)).tolist()
    stops = set(rng.integers(0, v, rng.integers(1, 3)).tolist())
    return logits, RowHistory(np.asarray(prompt, np.int32), output, stops)


PROCESSORS = [
    SamplingParams(),
    SamplingParams(min_tokens=5, max_new_tokens=16),
    SamplingParams(logit_bias=((1, 5.0), (3, -100.0), (0, 0.5))),
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.6),
    SamplingParams(frequency_penalty=1.5),
    SamplingParams(presence_penalty=-2.0),
    SamplingParams(
        presence_penalty=0.5,
        frequency_penalty=-0.7,
        repetition_penalty=1.3,
        logit_bias=((2, 3.0),),
        min_tokens=4,
    ),
]


@pytest.mark.parametrize("v", [8, 17, 64])
def test_processors_match_the_reference(v):
    rng = np.random.default_rng(v)
    rows = [(_case(rng, v), p) for p in PROCESSORS for _ in range(3)]
    logits = np.stack([c[0] for c, _ in rows])
    params = [p for _, p in rows]
    history = [c[1] for c, _ in rows]
    got = np.asarray(process_rows(logits, *processor_inputs(params, history)))
    for i, (p, h) in enumerate(zip(params, history)):
        ref = process_logits_ref(logits[i], p, h)
        assert np.array_equal(np.isinf(got[i]), np.isinf(ref)), f"row {i} {p}: -inf positions differ"
        fin = np.isfinite(ref)
        np.testing.assert_allclose(got[i][fin], ref[fin], rtol=1e-6, atol=1e-5, err_msg=f"row {i} {p}")
        if not p.processed:  # neutral parameters leave the row bit-identical
            assert np.array_equal(got[i], logits[i])


def test_min_tokens_masks_stop_ids_only_while_too_few_tokens():
    v = 8
    logits = np.zeros((2, v), np.float32)
    p = SamplingParams(min_tokens=2, max_new_tokens=4)
    h = [RowHistory(np.array([0]), [5], {3, 4}), RowHistory(np.array([0]), [5, 6], {3, 4})]
    got = np.asarray(process_rows(logits, *processor_inputs([p, p], h)))
    assert np.isneginf(got[0, [3, 4]]).all() and np.isfinite(got[0, [0, 1, 2, 5, 6, 7]]).all()
    assert np.isfinite(got[1]).all()


@pytest.mark.parametrize("min_p", [0.0, 0.05, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("t,p,k", [(1.0, 1.0, 0), (0.7, 0.9, 0), (1.5, 0.8, 5)])
def test_min_p_filter_matches_the_reference(min_p, t, p, k):
    rng = np.random.default_rng(int(min_p * 100) + k)
    for v in (8, 33):
        logits = rng.normal(0, 2, v).astype(np.float32)
        got = np.asarray(
            jax.nn.softmax(_filter_row(logits, np.float32(t), np.float32(p), np.int32(k), min_p))
        )
        ref = filtered_probs_ref(logits, t, p, k, min_p)
        assert np.array_equal(got > 0, ref > 0), f"kept sets differ: {got} vs {ref}"
        np.testing.assert_allclose(got, ref, atol=1e-6)


def test_plain_rows_are_bit_identical_beside_processed_rows():
    rng = np.random.default_rng(0)
    v = 64
    logits = rng.normal(0, 3, (5, v)).astype(np.float32)
    plain = [
        SamplingParams(),
        SamplingParams(temperature=0.9, top_p=0.8, seed=7),
        SamplingParams(temperature=1.2, top_k=10, seed=3),
    ]
    procd = [
        SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, logit_bias=((4, 2.0),)),
        SamplingParams(temperature=0.8, min_p=0.1, presence_penalty=1.0, seed=11),
    ]
    hist = [RowHistory(np.array([1, 2, 3]), [4, 4, 9], {0}) for _ in range(5)]
    steps = [3] * 5
    alone_plain = sample_batch(logits[:3], plain, steps[:3])
    alone_procd = sample_batch(logits[3:], procd, steps[3:], hist[3:])
    mixed = sample_batch(logits, plain + procd, steps, hist)
    assert mixed[:3].tolist() == alone_plain.tolist()
    assert mixed[3:].tolist() == alone_procd.tolist()
    # the greedy processed row is the argmax of the reference-processed logits
    assert mixed[3] == int(np.argmax(process_logits_ref(logits[3], procd[0], hist[3])))


def test_processed_rows_need_their_history():
    with pytest.raises(ValueError, match="RowHistory"):
        sample_batch(np.zeros((1, 8), np.float32), [SamplingParams(presence_penalty=1.0)], [0])


def test_a_bias_of_100_forces_a_token_greedy_and_sampled():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (4, 64)).astype(np.float32)
    ps = [SamplingParams(logit_bias=((37, 100.0),))] + [
        SamplingParams(temperature=1.0, seed=s, logit_bias=((37, 100.0),)) for s in range(3)
    ]
    hist = [RowHistory(np.array([0]), [], set())] * 4
    assert sample_batch(logits, ps, [0] * 4, hist).tolist() == [37] * 4


def test_token_logprobs_match_the_reference_ties_lower_id_first():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 2, (3, 40)).astype(np.float32)
    logits[1, [3, 9, 20]] = logits[1].max() + 1.0  # a three-way tie at the top
    chosen, ks = [5, 20, 0], [0, 4, 20]
    got = token_logprobs(logits, [0, 1, 2], chosen, ks)
    for i, g in enumerate(got):
        ref = logprobs_ref(logits[i], chosen[i], ks[i])
        assert g.token == ref.token and abs(g.logprob - ref.logprob) < 1e-5
        assert [t for t, _ in g.top] == [t for t, _ in ref.top]
        np.testing.assert_allclose([x for _, x in g.top], [x for _, x in ref.top], atol=1e-5)
    assert [t for t, _ in got[1].top[:3]] == [3, 9, 20]
    sub = token_logprobs(logits, [2], [7], [1])  # only the rows that asked
    assert len(sub) == 1 and abs(sub[0].logprob - logprobs_ref(logits[2], 7, 1).logprob) < 1e-5


# ------------------------------------------------------------------ the engine


def model():
    return tiny_random_model()


@functools.cache
def engine():
    from tests.helpers import reference_engine

    cfg, params, _ = model()
    return reference_engine(params, cfg, 1, max_batch=4, max_len=64)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


ATOL = 1e-4  # f32 engine vs the f32 reference forward (log-softmax of logits of O(1..10))


def _check(got, lp_row: np.ndarray, token: int, k: int) -> None:
    assert got.token == token
    assert abs(got.logprob - lp_row[token]) < ATOL
    top = [t for t, _ in got.top]
    assert len(top) == k
    np.testing.assert_allclose([x for _, x in got.top], lp_row[top], atol=ATOL)
    np.testing.assert_allclose(sorted(lp_row, reverse=True)[:k], [x for _, x in got.top], atol=ATOL)


def test_engine_logprobs_equal_a_teacher_forced_forward():
    from hmoe_jax.model.generate import teacher_forced_logits

    cfg, params, prompt = model()
    eng = engine()
    sp = SamplingParams(max_new_tokens=5, stop_ids=(), logprobs=3, prompt_logprobs=2)
    seq = eng.start(prompt, sp, schedule="cpu")
    while not seq.done:
        eng.step([seq])
    lp = _log_softmax(teacher_forced_logits(params, cfg, prompt + seq.tokens[:-1]))
    p = len(prompt)
    assert len(seq.logprobs) == len(seq.tokens) == 5
    for i, tok in enumerate(seq.tokens):
        _check(seq.logprobs[i], lp[p - 1 + i], tok, 3)
    assert len(seq.prompt_logprobs) == p and seq.prompt_logprobs[0] is None
    for t in range(1, p):
        _check(seq.prompt_logprobs[t], lp[t - 1], prompt[t], 2)
    assert seq.prefill_logits.shape[0] == 1  # prompt logprobs did not bring [T, V] to the host

    # chunked: the same entries, chunk by chunk
    seq2 = eng.admit(prompt, sp)
    for end in (5, 9, None):
        eng.prefill_seq(seq2, "cpu", end)
    assert seq2.tokens[:1] == seq.tokens[:1]
    assert [e.token for e in seq2.prompt_logprobs[1:]] == prompt[1:]
    np.testing.assert_allclose(
        [e.logprob for e in seq2.prompt_logprobs[1:]], [e.logprob for e in seq.prompt_logprobs[1:]], atol=ATOL
    )
    eng.cancel(seq2)


def test_engine_penalised_greedy_follows_the_reference_processors():
    """Each greedy token is the argmax of the reference-processed teacher-forced logits; the
    request gets the same tokens alone and beside a plain greedy one."""
    from hmoe_jax.model.generate import teacher_forced_logits

    cfg, params, prompt = model()
    eng = engine()
    sp = SamplingParams(
        max_new_tokens=6, stop_ids=(), repetition_penalty=1.4, frequency_penalty=0.8, presence_penalty=0.5
    )
    alone = eng.generate(prompt, 6, schedule="cpu", stop_ids=(), sampling=sp).tokens
    tf = teacher_forced_logits(params, cfg, prompt + alone[:-1])
    for i, tok in enumerate(alone):
        ref = process_logits_ref(
            tf[len(prompt) - 1 + i], sp, RowHistory(np.asarray(prompt), alone[:i], set())
        )
        assert tok == int(np.argmax(ref)), f"token {i}"
    s1 = eng.start(prompt, sp, schedule="cpu")
    s2 = eng.start(prompt[:7], SamplingParams(max_new_tokens=6, stop_ids=()), schedule="cpu")
    plain = eng.generate(prompt[:7], 6, schedule="cpu", stop_ids=()).tokens
    while not (s1.done and s2.done):
        eng.step([s for s in (s1, s2) if not s.done])
    assert s1.tokens == alone and s2.tokens == plain


def test_engine_min_tokens_suppresses_stop_and_bias_forces_a_token():
    cfg, _, prompt = model()
    eng = engine()
    first = eng.generate(prompt, 1, schedule="cpu", stop_ids=()).tokens[0]
    stopped = eng.generate(prompt, 4, schedule="cpu", stop_ids=(first,)).tokens
    assert stopped == [first]
    sp = SamplingParams(max_new_tokens=4, stop_ids=(first,), min_tokens=3)
    held = eng.generate(prompt, 4, schedule="cpu", stop_ids=(first,), sampling=sp).tokens
    assert first not in held[:3] and len(held) >= 3
    forced = eng.generate(
        prompt, 4, schedule="cpu", stop_ids=(), sampling=SamplingParams(logit_bias=((41, 100.0),))
    ).tokens
    assert forced == [41] * 4
    with pytest.raises(ValueError, match=f"token id {cfg.vocab_size} is not below"):
        eng.admit(prompt, SamplingParams(logit_bias=((cfg.vocab_size, 1.0),)))
    assert eng.pool.in_use == 0


SCHED_CASES = [
    ("fcfs", {}, None),
    ("paper", dict(long_prompt_tokens=100, chunk_tokens=4, dual_batch="off"), "chunk"),
    # the long prompt arrives while a short one decodes: an slp prefill on the background lane
    ("paper", dict(long_prompt_tokens=8, chunk_tokens=4, dual_batch="off", idle_window_s=60.0), "background"),
]


@pytest.mark.parametrize("policy,opts,path", SCHED_CASES)
def test_scheduler_streams_logprobs_aligned_with_tokens(policy, opts, path):
    """Through the scheduler (whole, chunked and background-lane prefills): one logprob per
    token, the prompt logprobs set before the first token, equal to the engine run alone."""
    from hmoe_jax.serve.scheduler import Scheduler

    cfg, params, prompt = model()
    eng = sched_engine()
    solo = engine()
    sp = SamplingParams(max_new_tokens=4, stop_ids=(), logprobs=2, prompt_logprobs=1)
    ref = solo.start(prompt, sp, schedule="cpu")
    while not ref.done:
        solo.step([ref])
    sched = Scheduler(eng, policy, **opts)
    h2 = sched.submit(prompt[:5], SamplingParams(max_new_tokens=8, stop_ids=()))
    if path == "background":  # let the short one start decoding first
        for _ in range(3):
            sched.step()
    h = sched.submit(prompt, sp)
    first_prompt_lps = []
    h._listeners.append(lambda: first_prompt_lps.append(h.request.prompt_logprobs))
    sched.drain(120)
    acts = [a for it in sched.log for a in it["actions"]]
    if path == "chunk":
        assert any(a["kind"] == "chunk" for a in acts), acts
    if path == "background":
        assert any(a["kind"] == "prefill" and a["background"] for a in acts), acts
    r = h.result(1)
    assert r.tokens == ref.tokens and [e.token for e in r.logprobs] == r.tokens
    np.testing.assert_allclose([e.logprob for e in r.logprobs], [e.logprob for e in ref.logprobs], atol=ATOL)
    assert first_prompt_lps and first_prompt_lps[0] is not None  # set before the first token
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(prompt)
    np.testing.assert_allclose(
        [e.logprob for e in r.prompt_logprobs[1:]], [e.logprob for e in ref.prompt_logprobs[1:]], atol=ATOL
    )
    assert h2.result(1).logprobs == [] and h2.result(1).prompt_logprobs is None
    assert eng.pool.in_use == 0


@functools.cache
def sched_engine():
    from hmoe_jax.engine.engine import Engine

    cfg, params, _ = model()
    return Engine(params, cfg, devices=2, expert_fn="ref", precision="f32", max_batch=4, max_len=64)
