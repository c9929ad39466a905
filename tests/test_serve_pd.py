"""Intra-node P/D disaggregation (hmoe_jax/serve/pd.py): two worker processes on their own
stand-in accelerators share ONE host copy of the weights (PSS of the arena mapping), hand
a prefilled KV cache over through shared memory and continue with exactly the tokens of a
solo in-process run (logprobs and prompt logprobs too, against the in-process scheduler's);
a killed decode worker is reported within 2 s and restarted; a cancel
at any stage leaves no KV row or shm segment behind."""

from __future__ import annotations

import logging
import os
import signal
import time

import numpy as np
import pytest

from hmoe_jax.engine.engine import Engine
from hmoe_jax.io.loader import load_checkpoint
from hmoe_jax.io.synthetic import ensure_default_checkpoint
from hmoe_jax.model.sampling import SamplingParams
from hmoe_jax.serve import kvshm
from hmoe_jax.serve.pd import PDCoordinator
from hmoe_jax.serve.request import RequestError

MAX_LEN = 256
PROMPTS = [[5, 17, 2, 99, 41, 8, 63, 12, 7], [101, 3, 55, 9], list(range(30, 70))]
NEW = [10, 14, 6]
# The exact policy: f32 and the jnp host experts (the FFI op rounds activations to bf16, which
# turns the ~1e-6 differences of differently batched programs into ~1e-3 logprob ones).
ENGINE = {"precision": "f32", "expert_fn": "ref"}


@pytest.fixture(scope="module")
def ckpt():
    return ensure_default_checkpoint(progress=False)


@pytest.fixture(scope="module")
def solo(ckpt):
    """Each prompt alone, greedy, in this process (f32: the exact policy)."""
    cfg, params = load_checkpoint(ckpt, progress=False)
    eng = Engine(params, cfg, devices=1, max_len=MAX_LEN, max_batch=1, **ENGINE)
    out = [eng.generate(p, n, stop_ids=()).tokens for p, n in zip(PROMPTS, NEW)]
    eng.close()
    return out


@pytest.fixture(scope="module")
def pd(ckpt):
    c = PDCoordinator(ckpt, engine={**ENGINE, "max_len": MAX_LEN}, touch_weights=True, warm_up=False)
    c.wait_ready(300)
    yield c
    c.close()
    assert not kvshm.leftover_segments(kvshm.segment_name(c.tag, ""))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, stop_ids=())


def _no_orphans(pd: PDCoordinator) -> None:
    deadline = time.monotonic() + 10
    while True:
        st = pd.stats("decode")
        if st["free_rows"] == st["rows"] and st["active"] == 0:
            break
        assert time.monotonic() < deadline, st
        time.sleep(0.05)
    assert not kvshm.leftover_segments(kvshm.segment_name(pd.tag, "")), "an shm segment was orphaned"


def test_handover_continues_exactly_and_the_pair_shares_one_weight_copy(pd, solo):
    handles = [pd.submit(p, _greedy(n)) for p, n in zip(PROMPTS, NEW)]
    got = [h.result(300) for h in handles]
    for r, want in zip(got, solo):
        assert r.finish_reason == "length", r.error
        assert r.tokens == want
        assert r.meta["kv_bytes"] > 0 and r.meta["handover_s"] >= r.meta["import_s"] > 0
        t = r.timings()
        assert t["ttft_s"] > 0 and len(t["itl_s"]) == len(want) - 1
    # One copy: each worker maps (and has touched) all of the arena, and the pair's
    # proportional share of those pages is one copy, not two.
    share = pd.weight_pss()
    size = share["arena_kb"]
    for role, u in share["workers"].items():
        assert u["Rss"] >= 0.95 * size, (role, share)
        assert share["zero_copy"][role] == share["host_weight_bytes"][role] > 0, share  # engine uses the map
    assert share["pss_ratio"] <= 1.1, share
    assert share["rss_ratio"] >= 1.9, share  # RSS would have called it two copies
    _no_orphans(pd)


def test_cancel_in_prefill_and_mid_handover_leaves_nothing(pd, solo):
    early = pd.submit(PROMPTS[2], _greedy(40))
    early.cancel()  # queued or in prefill: the segment is discarded when its prompt is done
    mid = pd.submit(PROMPTS[0], _greedy(60))
    first = next(iter(mid.stream(timeout=120)))  # the first token is back: its KV is in flight
    mid.cancel()
    assert early.result(60).finish_reason == "cancelled"
    r = mid.result(60)
    assert r.finish_reason == "cancelled" and r.tokens[0] == first == solo[0][0]
    after = pd.submit(PROMPTS[1], _greedy(NEW[1])).result(120)
    assert after.tokens == solo[1]
    _no_orphans(pd)


def test_killed_decode_worker_is_reported_within_2s_and_restarted(pd, solo, caplog):
    caplog.set_level(logging.WARNING, logger="hmoe_jax.serve.pd")
    metrics = _metrics_app(pd)
    assert metrics()['hmoe:worker_restarts_total{model_name="pd",role="decode"}'] == 0
    h = pd.submit(PROMPTS[0], _greedy(200))
    it = h.stream(timeout=120)
    for _ in range(3):
        next(it)
    victim = pd.pid("decode")
    t0 = time.perf_counter()
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(RequestError, match=rf"decode worker \(pid {victim}\) died \(killed by SIGKILL\)"):
        h.result(10)
    assert time.perf_counter() - t0 <= 2.0
    assert h.request.finished_s - t0 <= 2.0
    pd.wait_ready(300)
    assert pd.pid("decode") != victim and pd.workers["decode"].restarts == 1
    # the operator's lines: role, pid and signal of the death, then the new pid once it is back
    warned = [r for r in caplog.records if r.name == "hmoe_jax.serve.pd" and r.levelno == logging.WARNING]
    msgs = [r.getMessage() for r in warned]
    assert any(
        f"decode worker pid {victim} died (signal SIGKILL)" in m and "restarting" in m for m in msgs
    ), msgs
    assert any(f"decode worker restarted: pid {pd.pid('decode')} ready" in m for m in msgs), msgs
    after = metrics()
    assert after['hmoe:worker_restarts_total{model_name="pd",role="decode"}'] == 1
    assert after['hmoe:worker_restarts_total{model_name="pd",role="prefill"}'] == 0
    assert "vllm:kv_cache_usage_perc" not in after  # P/D has no one KV pool to report
    nxt = pd.submit(PROMPTS[1], _greedy(NEW[1])).result(300)
    assert nxt.finish_reason == "length" and nxt.tokens == solo[1]
    _no_orphans(pd)


def _metrics_app(pd: PDCoordinator):
    """The HTTP app on this coordinator, wired as `hmoe serve --pd` wires it: its /metrics."""
    from fastapi.testclient import TestClient

    from hmoe_jax.serve.chat_template import ChatTemplate
    from hmoe_jax.serve.http import ServeOptions, ServerState, create_app
    from hmoe_jax.serve.metrics import parse_metrics
    from tests.serve_stub import TOK

    opts = ServeOptions(model_name="pd", root="/pd", vocab_size=pd.cfg.vocab_size, max_model_len=MAX_LEN)
    state = ServerState(
        pd, TOK, ChatTemplate(None, TOK.encode), opts, healthy=lambda: pd.healthy, worker_restarts=pd.restarts
    )
    client = TestClient(create_app(state))
    return lambda: parse_metrics(client.get("/metrics").text)


def test_bad_requests_are_refused_at_submit(pd):
    with pytest.raises(ValueError, match="out of range"):
        pd.submit([pd.cfg.vocab_size + 5], _greedy(2))
    with pytest.raises(ValueError, match="logit_bias: token id"):
        pd.submit([5, 17, 2], SamplingParams(max_new_tokens=2, logit_bias=((pd.cfg.vocab_size, 1.0),)))
    with pytest.raises(ValueError, match="KV row length"):
        pd.submit(list(np.arange(200) % 50), _greedy(100))
    assert pd.healthy


ATOL = 1e-4  # tests/test_sampling_processors.py's: f32 log-softmax in different processes


@pytest.mark.slow  # ~70 s on 2 cores: the in-process scheduler's compiles
def test_logprobs_cross_the_pipe_equal_to_the_in_process_scheduler(pd, ckpt):
    """The prefill worker's first-token and prompt logprobs and the decode worker's per-step
    ones arrive on the request as the in-process scheduler puts them there (same greedy
    request, same engine options; only the processes differ). max_new_tokens=1 ends at the
    prefill worker (no handover); a penalised request's logprobs stay the raw model's."""
    from hmoe_jax.serve.scheduler import Scheduler

    cases = [
        (PROMPTS[0], SamplingParams(max_new_tokens=6, stop_ids=(), logprobs=3, prompt_logprobs=2)),
        (PROMPTS[1], SamplingParams(max_new_tokens=1, stop_ids=(), logprobs=0, prompt_logprobs=0)),
        (PROMPTS[1], SamplingParams(max_new_tokens=5, stop_ids=(), logprobs=1, repetition_penalty=1.5)),
        (PROMPTS[0], _greedy(3)),  # asked for none: gets none
    ]
    got = [h.result(300) for h in [pd.submit(p, sp) for p, sp in cases]]
    cfg, params = load_checkpoint(ckpt, progress=False)
    eng = Engine(params, cfg, devices=1, max_len=MAX_LEN, max_batch=4, **ENGINE)
    sched = Scheduler(eng)
    handles = [sched.submit(p, sp) for p, sp in cases]
    sched.drain(300)
    want = [h.result(1) for h in handles]
    eng.close()
    for (prompt, sp), r, w in zip(cases, got, want):
        assert r.finish_reason == w.finish_reason == "length", r.error
        assert r.tokens == w.tokens
        assert [e.token for e in r.logprobs] == ([] if sp.logprobs is None else r.tokens)
        assert [e.token for e in r.logprobs] == [e.token for e in w.logprobs]
        np.testing.assert_allclose(
            [e.logprob for e in r.logprobs], [e.logprob for e in w.logprobs], atol=ATOL
        )
        for a, b in zip(r.logprobs, w.logprobs):
            assert len(a.top) == len(b.top) == sp.logprobs
            np.testing.assert_allclose([x for _, x in a.top], [x for _, x in b.top], atol=ATOL)
        if sp.prompt_logprobs is None:
            assert r.prompt_logprobs is None
            continue
        assert len(r.prompt_logprobs) == len(prompt) and r.prompt_logprobs[0] is None
        assert [e.token for e in r.prompt_logprobs[1:]] == prompt[1:]
        np.testing.assert_allclose(
            [e.logprob for e in r.prompt_logprobs[1:]], [e.logprob for e in w.prompt_logprobs[1:]], atol=ATOL
        )
    _no_orphans(pd)
