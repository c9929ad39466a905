"""The policy invariant (issue 13): every registered policy, driving the request scheduler on
mixed arrival traces (requests arriving while others prefill and decode, cancellations,
short prompts by chunked prefill and long ones by dslp / background slp), gives every
request exactly the tokens it gets alone: the independent reference rollout
(hmoe_jax.model.generate.greedy_rollout: plain model, dense attention, experts_ref), greedy, f32 policy.

Adding one line to hmoe_jax/policies/registry.py brings a new policy under this test.
"""

from __future__ import annotations

import functools
import time

import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.model.generate import greedy_rollout
from hmoe_jax.model.sampling import SamplingParams
from hmoe_jax.policies.base import Chunk, Decode, Pending, PolicyError, Prefill, View
from hmoe_jax.policies.registry import get_policy, policy_names
from hmoe_jax.runtime.synthetic import random_params
from hmoe_jax.serve.request import RequestError
from hmoe_jax.serve.scheduler import Scheduler
from tests.helpers import reference_engine

# Thresholds that make the tiny model take every path: prompts >= 10 tokens are "long"
# (dslp when idle, slp on accelerator 1 while decoding), shorter ones go in chunks of 4.
OPTIONS = {
    "paper": dict(long_prompt_tokens=10, chunk_tokens=4, decode_cap=4),
    "dual": dict(long_prompt_tokens=10, chunk_tokens=4, decode_cap=4),
    "fcfs": dict(decode_cap=4),
}
# (prompt length, new tokens, arrival iteration, cancel at iteration or None)
TRACE = [
    (12, 5, 0, None),  # long, nothing decoding yet -> dslp
    (5, 6, 0, None),  # short -> chunked next to the first one's decode
    (9, 4, 1, None),
    (14, 3, 2, None),  # long while decoding -> slp in the background on accelerator 1
    (3, 8, 2, 5),  # cancelled while decoding
    (7, 2, 3, 3),  # cancelled the iteration it arrives (maybe before it starts)
    (11, 4, 6, None),
    (4, 3, 9, None),
]


@functools.cache
def model():
    cfg = named_model_config("deepseek_v3_tiny")
    params = random_params(cfg, seed=21)
    rng = np.random.default_rng(8)
    prompts = [[int(t) for t in rng.integers(2, cfg.vocab_size, n)] for n, *_ in TRACE]
    refs = [greedy_rollout(params, cfg, p, m) for p, (_, m, _, _) in zip(prompts, TRACE)]
    return cfg, params, prompts, refs


@functools.cache
def engine():
    cfg, params, *_ = model()
    return reference_engine(params, cfg, 2, max_batch=5, max_len=64)


def run_trace(sched: Scheduler, prompts, trace=TRACE):
    handles: dict[int, object] = {}
    it = 0
    while len(handles) < len(trace) or sched.busy:
        for i, (_, n_new, arrival, cancel_at) in enumerate(trace):
            if arrival == it:
                handles[i] = sched.submit(prompts[i], SamplingParams(max_new_tokens=n_new, stop_ids=()))
            if cancel_at == it and i in handles:
                handles[i].cancel()
        if not sched.step():
            time.sleep(0.002)
        it += 1
        assert it < 5000, "scheduler did not finish the trace"
    return handles


@pytest.mark.parametrize("name", policy_names())
def test_every_policy_gives_each_request_its_tokens_alone(name):
    cfg, params, prompts, refs = model()
    eng = engine()
    sched = Scheduler(eng, name, **OPTIONS.get(name, {}))
    handles = run_trace(sched, prompts)
    kinds = {a["kind"] for it in sched.log for a in it["actions"]}
    for i, h in handles.items():
        r = h.result(timeout=1)
        if TRACE[i][3] is None:
            assert r.finish_reason == "length", (i, r.finish_reason, r.error)
            assert r.tokens == refs[i], (name, i, r.schedule)
        else:  # cancelled: whatever it produced is a prefix of its tokens alone
            assert r.finish_reason in ("cancelled", "length")
            assert r.tokens == refs[i][: len(r.tokens)]
        t = r.timings()
        assert t["ttft_s"] is None or t["ttft_s"] >= t["queue_s"] >= 0
    assert eng.pool.in_use == 0  # every row came back (finished and cancelled alike)
    assert "decode" in kinds
    if name in ("paper", "dual"):
        schedules = {h.result().schedule for i, h in handles.items() if TRACE[i][3] is None}
        assert {"dslp", "slp", "cpu (chunked)"} <= schedules, schedules
        assert "chunk" in kinds
    if name == "dual":
        assert any(a.get("micro_batches") == 2 for it in sched.log for a in it["actions"])


def test_background_thread_serves_and_streams():
    cfg, params, prompts, refs = model()
    sched = Scheduler(engine(), "paper", **OPTIONS["paper"]).start()
    try:
        hs = [
            sched.submit(prompts[i], SamplingParams(max_new_tokens=TRACE[i][1], stop_ids=())) for i in (1, 2)
        ]
        streamed = [list(h.stream(timeout=60)) for h in hs]
        assert streamed == [refs[1], refs[2]]
        with pytest.raises(ValueError, match="out of range"):
            sched.submit([cfg.vocab_size + 3], SamplingParams(max_new_tokens=2))
        with pytest.raises(ValueError, match="KV row length"):
            sched.submit([5] * 60, SamplingParams(max_new_tokens=10))
        # still serving after the bad input
        assert (
            sched.submit(prompts[7], SamplingParams(max_new_tokens=3, stop_ids=())).result(60).tokens
            == refs[7]
        )
    finally:
        sched.close()


def test_a_failing_request_ends_with_an_error_and_others_go_on():
    cfg, params, prompts, refs = model()
    eng = engine()
    # a schedule name the engine does not know: the prefill fails inside the loop
    sched = Scheduler(eng, "fcfs", schedule="no_such_schedule")
    h = sched.submit(prompts[1], SamplingParams(max_new_tokens=2, stop_ids=()))
    sched.drain(60)
    with pytest.raises(RequestError, match="no_such_schedule"):
        h.result(1)
    assert eng.pool.in_use == 0
    ok = Scheduler(eng, "fcfs").submit  # a fresh scheduler on the same engine still serves
    assert ok is not None


def view(**kw):
    base = dict(now_s=1000.0, devices=2, free_rows=4, waiting=(), decoding=())
    return View(**{**base, **kw})


def test_paper_policy_decisions():
    p = get_policy("paper", long_prompt_tokens=100, chunk_tokens=16, decode_cap=2, idle_window_s=60)
    one = get_policy("paper", long_prompt_tokens=100)
    long, short = Pending(1, 500, 0, 0.0), Pending(2, 40, 0, 0.0)
    assert p.decide(view(waiting=(long,))) == (Prefill(1, "dslp", (0, 1)),)  # idle node
    recent = view(waiting=(long,), last_decode_s=990.0)
    assert p.decide(recent) == (Prefill(1, "slp", (1,), background=True),)  # decode was recent
    busy = p.decide(view(waiting=(long,), decoding=(7,)))
    assert busy[0] == Prefill(1, "slp", (1,), background=True) and isinstance(busy[1], Decode)
    assert p.decide(view(waiting=(long,), background=(9,), last_decode_s=999.0)) == ()  # lane busy
    assert p.decide(view(waiting=(short,)))[0] == Chunk(2, 16)
    assert p.decide(view(waiting=(Pending(2, 40, 32, 0.0),)))[0] == Chunk(2, 40)
    assert p.decide(view(waiting=(short,), decoding=(3, 4))) == (Decode((3, 4), measure=True),)  # cap
    # a chunk runs after the decode step (every row waits at most one chunk and one step)
    assert p.decide(view(waiting=(short,), decoding=(3,))) == (Decode((3,)), Chunk(2, 16))
    assert one.decide(view(devices=1, waiting=(long,), decoding=(3,))) == (
        Decode((3,)),
        Prefill(1, "slp", (0,)),
    )
    assert one.decide(view(devices=1, waiting=(long,)))[0] == Prefill(1, "slp", (0,))
    # dual "auto": measure plain, then dual, for this batch size ...
    plain = {(2, 1): 0.050}
    assert p.decide(view(decoding=(3, 4), step_times=plain)) == (
        Decode((3, 4), micro_batches=2, measure=True),
    )
    # ... then plain where the dual step was not faster by dual_min_gain ...
    times = {(2, 1): 0.050, (2, 2): 0.049}
    assert p.decide(view(decoding=(3, 4), step_times=times)) == (Decode((3, 4)),)
    # ... and dual where it was
    times = {(2, 1): 0.050, (2, 2): 0.040}
    assert p.decide(view(decoding=(3, 4), step_times=times)) == (Decode((3, 4), micro_batches=2),)
    with pytest.raises(PolicyError, match="unknown option"):
        get_policy("paper", chunk=3)
    with pytest.raises(PolicyError, match="unknown policy"):
        get_policy("nope")
