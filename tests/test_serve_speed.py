"""Serving at the engine's speed (issue 26): the serving trace's per-token breakdown
(serve/servetrace.py) against sums worked out by hand; the scheduler's warm-up (every decode
batch size compiled, the policy's dual/plain arms measured before serving, on scratch rows
that leave no trace in what requests get); a measured decode step that compiled is no
measurement (the policy asks for the arm again)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.model.generate import greedy_rollout
from hmoe_jax.model.sampling import SamplingParams
from hmoe_jax.plan.trace import TraceRecorder
from hmoe_jax.runtime.synthetic import random_params
from hmoe_jax.serve.scheduler import Scheduler
from hmoe_jax.serve.servetrace import COMPILE, HTTP, SCHED, breakdown, span
from tests.helpers import reference_engine

MS = 1_000_000  # ns


def _s(resource: str, name: str, t0_ms: float, t1_ms: float) -> dict:
    return {
        "resource": resource,
        "name": name,
        "start_ns": int(t0_ms * MS),
        "end_ns": int(t1_ms * MS),
        "args": {},
    }


def test_breakdown_sums_each_part_per_output_token():
    slices = [
        _s(SCHED, "decide", 0, 1),
        _s(SCHED, "decode", 1, 41),
        _s(SCHED, "emit", 41, 42),
        _s(HTTP, "wait", 41, 44),
        _s(HTTP, "detok", 44, 45),
        _s(HTTP, "send", 45, 46),
        _s(SCHED, "chunk", 42, 100),
        _s(SCHED, "decode", 100, 140),
        _s(COMPILE, "backend_compile_duration", 100, 120),
        _s(SCHED, "idle", 140, 150),
    ]
    b = breakdown(slices, tokens=2)
    assert b["engine_decode"] == pytest.approx(80 / 2)
    assert b["engine_chunk"] == pytest.approx(58 / 2)
    assert b["engine_prefill"] == 0
    assert b["scheduler"] == pytest.approx((1 + 1) / 2)
    assert b["idle"] == pytest.approx(10 / 2)
    assert (b["http_wait"], b["http_detok"], b["http_send"]) == pytest.approx((1.5, 0.5, 0.5))
    assert b["compile"] == pytest.approx(10)
    assert (b["decode_steps"], b["mean_step_ms"]) == (2, pytest.approx(40))
    assert b["per_token_wall"] == pytest.approx(150 / 2) and b["unaccounted"] == pytest.approx(0)
    # a window keeps the slices inside it only
    w = breakdown(slices, tokens=1, window_ns=(0, 42 * MS))
    assert (
        w["engine_decode"] == pytest.approx(40)
        and w["engine_chunk"] == 0
        and w["wall_ms"] == pytest.approx(42)
    )
    with pytest.raises(ValueError, match="tokens must be >= 1"):
        breakdown(slices, tokens=0)
    with pytest.raises(ValueError, match="no slices in the window"):
        breakdown(slices, tokens=1, window_ns=(10_000 * MS, 10_001 * MS))


def test_span_records_its_extras_and_nothing_without_a_trace():
    tr = TraceRecorder()
    with span(tr, SCHED, "decide", k=1) as info:
        info["actions"] = ["x"]
    with span(None, SCHED, "decide") as info:
        info["ignored"] = True
    (s,) = tr.slices
    assert (s["resource"], s["name"], s["args"]) == (SCHED, "decide", {"k": 1, "actions": ["x"]})
    assert s["end_ns"] >= s["start_ns"]


PROMPTS = [(5, 6), (3, 5), (6, 4)]  # (prompt tokens, new tokens): short, by chunks


@functools.cache
def model():
    cfg = named_model_config("deepseek_v3_tiny")
    params = random_params(cfg, seed=26)
    rng = np.random.default_rng(26)
    prompts = [[int(t) for t in rng.integers(2, cfg.vocab_size, n)] for n, _ in PROMPTS]
    refs = [greedy_rollout(params, cfg, p, m) for p, (_, m) in zip(prompts, PROMPTS)]
    return cfg, params, prompts, refs


@functools.cache
def engine():
    cfg, params, *_ = model()
    return reference_engine(params, cfg, 1, max_batch=3, max_len=64)


def serve_all(sched: Scheduler) -> list[list[int]]:
    _, _, prompts, _ = model()
    hs = [
        sched.submit(p, SamplingParams(max_new_tokens=m, stop_ids=())) for p, (_, m) in zip(prompts, PROMPTS)
    ]
    sched.drain(300)
    return [h.result(1).tokens for h in hs]


@pytest.mark.slow
def test_warm_up_measures_the_policys_arms_and_leaves_requests_their_tokens():
    eng = engine()
    _, _, _, refs = model()
    trace = TraceRecorder()
    sched = Scheduler(eng, "paper", trace=trace, trace_engine=False, decode_cap=3, chunk_tokens=4)
    info = sched.warm_up(3, rounds=2, pos=8)
    # every batch size compiled; the arms the paper policy's dual "auto" compares, measured
    assert info["batches"] == 3
    assert set(info["arms"]) == {"2x1", "2x2", "3x1", "3x2"}
    assert set(sched.step_times) == {(2, 1), (2, 2), (3, 1), (3, 2)}
    assert all(t > 0 for t in sched.step_times.values())
    assert eng.pool.in_use == 0 and sched.last_decode_s is None  # scratch rows, no request decoded
    assert len([s for s in trace.slices if s["name"] == "warm_up"]) == 3
    # serving after it: no step is measured any more, and each request gets its tokens alone
    assert serve_all(sched) == refs
    decodes = [a for it in sched.log for a in it["actions"] if a["kind"] == "decode"]
    assert decodes and not any(a["measure"] for a in decodes)
    assert eng.pool.in_use == 0
    # the trace has the loop's phases, in order within an iteration
    names = {s["name"] for s in trace.slices if s["resource"] == SCHED}
    assert {"intake", "decide", "chunk", "decode", "emit"} <= names
    sched.close()


class _AlwaysCompiling:
    """A compile counter that moves on every read: every step looks as if it compiled."""

    def __init__(self) -> None:
        self.n = 0

    @property
    def compiles(self) -> int:
        self.n += 1
        return self.n

    def uninstall(self) -> None: ...


@pytest.mark.slow
def test_a_measured_step_that_compiled_is_not_recorded():
    eng = engine()
    _, _, _, refs = model()
    sched = Scheduler(eng, "paper", decode_cap=3, chunk_tokens=4)
    sched.compiles.uninstall()
    sched.compiles = _AlwaysCompiling()
    assert serve_all(sched) == refs
    # never a clean measurement: the policy kept asking for the plain arm, never ran dual
    assert sched.step_times == {}
    multi = [
        a for it in sched.log for a in it["actions"] if a["kind"] == "decode" and len(a["requests"]) >= 2
    ]
    assert multi and all(a["measure"] and a["micro_batches"] == 1 for a in multi)
    # with the real counter (shapes compiled above), the first measured step of an arm counts
    sched2 = Scheduler(eng, "paper", decode_cap=3, chunk_tokens=4)
    assert serve_all(sched2) == refs
    assert (2, 1) in sched2.step_times
    sched2.close()


def test_compile_listener_sees_a_new_shape_compile_and_stops_when_uninstalled():
    import jax
    import jax.numpy as jnp

    from hmoe_jax.serve.servetrace import CompileListener

    tr = TraceRecorder()
    c = CompileListener(tr).install()
    f = jax.jit(lambda x: x * 3 + 1)
    f(jnp.ones(11)).block_until_ready()
    n = c.compiles
    assert n >= 1 and any(
        s["resource"] == COMPILE and s["name"] == "backend_compile_duration" for s in tr.slices
    )
    f(jnp.ones(11)).block_until_ready()  # the same shape: cached, no compile
    assert c.compiles == n
    c.uninstall()
    f(jnp.ones(13)).block_until_ready()  # a new shape compiles, unseen
    assert c.compiles == n
