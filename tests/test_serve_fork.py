"""n samples of one prompt share its prefill (Scheduler.submit_group, serve/scheduler.py).

The group's first request prefills the prompt (whole or by chunks, as the policy picks); the
others fork it: a copy of the prefilled KV row and a first token sampled from the shared
prompt logits with their own parameters. The reference is independent of the fork: each
member run alone on a fresh scheduler (its own prefill); the tokens must be equal token for
token (f32 engine, seeded sampling and greedy), and the prompt prefilled once (the policy's
prefill / chunk actions name only the first member). Also: a group larger than the free rows
completes (forks wait for rows; with no prefilled member left one prefills itself),
cancelling the first member leaves the others running, and `n` through the HTTP app.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from hmoe_jax.model.sampling import SamplingParams
from hmoe_jax.serve.scheduler import Scheduler
from tests.helpers import tiny_random_model

FCFS = ("fcfs", {})
CHUNKED = ("paper", dict(long_prompt_tokens=100, chunk_tokens=4, dual_batch="off"))


def model():
    return tiny_random_model()


@functools.cache
def engine():
    from hmoe_jax.engine.engine import Engine

    cfg, params, _ = model()
    return Engine(params, cfg, devices=2, expert_fn="ref", precision="f32", max_batch=4, max_len=64)


def sampled(seed: int, n_new: int = 6, **kw) -> SamplingParams:
    return SamplingParams(max_new_tokens=n_new, temperature=0.9, seed=seed, stop_ids=(), **kw)


def solo(params: SamplingParams, policy=FCFS, prompt=None):
    """The request alone on a fresh scheduler: its own prefill, no fork."""
    sched = Scheduler(engine(), policy[0], **policy[1])
    h = sched.submit(model()[2] if prompt is None else prompt, params)
    sched.drain(120)
    return h.result(1)


def prefilled(sched: Scheduler) -> list[int]:
    """The request ids the policy prefilled (whole prompts and chunks; one id per action)."""
    return [a["request"] for it in sched.log for a in it["actions"] if a["kind"] in ("prefill", "chunk")]


@pytest.mark.parametrize("policy", [FCFS, CHUNKED], ids=["whole", "chunked"])
def test_group_equals_solo_runs_and_prefills_once(policy):
    params = [sampled(1, logprobs=1), sampled(2, logprobs=1), SamplingParams(max_new_tokens=6, stop_ids=())]
    refs = [solo(p, policy) for p in params]
    sched = Scheduler(engine(), policy[0], **policy[1])
    hs = sched.submit_group(model()[2], params)
    sched.drain(120)
    got = [h.result(1) for h in hs]
    for g, r in zip(got, refs):
        assert g.tokens == r.tokens and len(g.tokens) == 6
        np.testing.assert_allclose(
            [e.logprob for e in g.logprobs], [e.logprob for e in r.logprobs], atol=1e-5
        )
    assert refs[0].tokens != refs[1].tokens  # the seeds matter: a fork does not copy its leader's draws
    ids = prefilled(sched)
    assert set(ids) == {hs[0].id}, ids  # only the first member prefilled (by chunks: several actions)
    if policy is CHUNKED:
        assert len(ids) == 3  # 12 tokens by chunks of 4
    assert [g.schedule for g in got[1:]] == ["fork", "fork"]
    assert all(g.meta["kv_copy_bytes"] > 0 for g in got[1:])
    assert engine().pool.in_use == 0


def test_forks_copy_prompt_logprobs():
    params = [sampled(s, n_new=3, prompt_logprobs=2) for s in (4, 5)]
    ref = solo(params[1])
    sched = Scheduler(engine(), "fcfs")
    hs = sched.submit_group(model()[2], params)
    sched.drain(120)
    r = hs[1].result(1)
    assert r.schedule == "fork" and r.tokens == ref.tokens
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(ref.prompt_logprobs)
    np.testing.assert_allclose(
        [e.logprob for e in r.prompt_logprobs[1:]], [e.logprob for e in ref.prompt_logprobs[1:]], atol=1e-5
    )


@pytest.mark.parametrize(
    "n_new,prefills",
    [
        # the first 4 members end together: the last 2 find no prefilled member, one prefills
        ([4, 4, 4, 4, 5, 5], 2),
        # the first member ends early: the waiting forks copy a member still decoding
        ([2, 7, 7, 7, 4, 4], 1),
    ],
)
def test_group_larger_than_the_free_rows_completes(n_new, prefills):
    params = [sampled(10 + i, n) for i, n in enumerate(n_new)]  # 6 members, 4 pool rows
    refs = [solo(p) for p in params]
    sched = Scheduler(engine(), "fcfs")
    hs = sched.submit_group(model()[2], params)
    sched.drain(120)
    assert [h.result(1).tokens for h in hs] == [r.tokens for r in refs]
    assert len(prefilled(sched)) == prefills
    assert engine().pool.in_use == 0


@pytest.mark.parametrize("when", ["before_prefill", "after_fork"])
def test_cancelling_the_first_member_leaves_the_others_running(when):
    params = [sampled(20 + i) for i in range(3)]
    refs = [solo(p) for p in params]
    sched = Scheduler(engine(), "fcfs")
    hs = sched.submit_group(model()[2], params)
    if when == "after_fork":
        sched.step()  # the first member prefills
        sched.step()  # the others fork and all decode
        assert [h.request.schedule for h in hs[1:]] == ["fork", "fork"]
    hs[0].cancel()
    sched.drain(120)
    assert hs[0].result(1).finish_reason == "cancelled"
    for h, r in zip(hs[1:], refs[1:]):
        assert h.result(1).finish_reason == "length" and h.result(1).tokens == r.tokens
    # before its prefill: the next member prefills the prompt itself, the last forks it
    assert prefilled(sched) == ([hs[0].id] if when == "after_fork" else [hs[1].id])
    assert hs[2].request.schedule == "fork"
    assert engine().pool.in_use == 0


def test_group_refuses_bad_input_whole():
    sched = Scheduler(engine(), "fcfs")
    with pytest.raises(ValueError, match="no sampling parameters"):
        sched.submit_group(model()[2], [])
    with pytest.raises(ValueError):
        sched.submit_group(model()[2], [sampled(1), sampled(2, n_new=100)])  # past the 64-token row
    assert not sched.busy  # nothing of the refused group was queued


def test_http_n_shares_the_prefill_and_equals_solo():
    from fastapi.testclient import TestClient

    from hmoe_jax.io.tokenizer import ByteTokenizer
    from hmoe_jax.serve.chat_template import ChatTemplate
    from hmoe_jax.serve.http import ServeOptions, ServerState, create_app

    cfg, _, prompt = model()
    tok = ByteTokenizer(cfg.vocab_size)
    sched = Scheduler(engine(), "fcfs").start()
    opts = ServeOptions(
        model_name="tiny", root="/tiny", vocab_size=cfg.vocab_size, max_model_len=64, eos_ids=cfg.eos_ids
    )
    state = ServerState(sched, tok, ChatTemplate(None, tok.encode), opts)
    body = dict(
        model="tiny", prompt=prompt, max_tokens=5, temperature=0.9, seed=7, ignore_eos=True, logprobs=0
    )
    try:
        with TestClient(create_app(state)) as c:

            def tokens(**kw):
                r = c.post("/v1/completions", json={**body, **kw})
                assert r.status_code == 200, r.text
                return [
                    ch["logprobs"]["tokens"] for ch in sorted(r.json()["choices"], key=lambda ch: ch["index"])
                ]

            before = len(prefilled(sched))
            both = tokens(n=2)
            assert len(prefilled(sched)) == before + 1  # one prefill for the two samples
            assert both == [tokens(seed=7)[0], tokens(seed=8)[0]]  # sample j draws with seed + j
            assert both[0] != both[1]
    finally:
        sched.close()


def test_core_fork_transitions():
    """A fork is WAITING but unqueued (the policy never sees it); forked: -> DECODING holding
    a row, no prefill; queue: into the FCFS queue by submission time."""
    from hmoe_jax.policies.core import RequestState, ServingCore
    from hmoe_jax.policies.registry import get_policy

    core = ServingCore(get_policy("fcfs"), 1)
    core.add(0, 5, 0.0)
    core.add(1, 5, 0.0, fork=True)
    core.add(2, 5, 0.0, fork=True)
    core.add(3, 4, 1.0)
    assert [p.id for p in core.view(2.0, 4).waiting] == [0, 3] and core.waiting() == [0, 3]
    assert core[1].state == RequestState.WAITING and core.busy
    core.forked(1)
    assert core[1].state == RequestState.DECODING and core[1].holds_row and core.rows_held == 1
    with pytest.raises(ValueError, match="cannot be forked"):
        core.forked(1)
    with pytest.raises(ValueError, match="cannot be forked"):
        core.forked(0)  # a queued request is prefilled, not forked
    core.queue(2)
    assert core.waiting() == [0, 2, 3]  # submitted at 0.0: ahead of the request submitted at 1.0
    with pytest.raises(ValueError, match="queued already"):
        core.queue(2)
