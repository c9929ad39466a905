"""Warm shapes (issue #28 item 5): after start-up the server serves without compiling on the
request path. /health answers 503 {"status": "warming"} while warm-up runs (held here by
an event, not by timing), then 200; then 8 concurrent requests, a 1,500-token prompt (two
512-token chunks and a 476-token one) and a 700-token one (512 + 188) run without one
backend compile (jax's own compile events, counted by the scheduler's CompileListener):
Engine.prefill_seq pads each cpu chunk to a power of two >= 64 (plan/buckets.py
prefill_bucket) and warm-up compiles each such shape of the policy's chunks (64, 128, 256,
512 tokens). A P/D worker warms itself on start and after a restart: its first request
compiles nothing in it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from fastapi.testclient import TestClient

from hmoe_jax.engine.engine import Engine
from hmoe_jax.io.loader import load_checkpoint
from hmoe_jax.io.synthetic import ensure_default_checkpoint
from hmoe_jax.model.sampling import SamplingParams
from hmoe_jax.serve.chat_template import ChatTemplate
from hmoe_jax.serve.http import ServeOptions, ServerState, create_app
from hmoe_jax.serve.http_server import start_warm_up
from hmoe_jax.serve.scheduler import Scheduler


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, stop_ids=())


@pytest.fixture(scope="module")
def ckpt():
    return ensure_default_checkpoint(progress=False)


class _Tok:
    name = "ids"

    def encode(self, text: str) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        return " ".join(map(str, ids))


@pytest.mark.slow
def test_health_warming_then_no_compile_for_8_concurrent_and_1500_and_700_token_prompts(
    ckpt, no_persistent_compile_cache
):
    cfg, params = load_checkpoint(ckpt, progress=False)
    eng = Engine(params, cfg, devices=1, max_len=2048, max_batch=8)
    sched = Scheduler(eng, "paper").start()
    hold = threading.Event()
    real_warm_up = sched.warm_up

    def held_warm_up(*a, **kw):
        hold.wait(120)
        return real_warm_up(*a, **kw)

    sched.warm_up = held_warm_up
    opts = ServeOptions(model_name="t", root=str(ckpt), vocab_size=cfg.vocab_size, max_model_len=eng.max_len)
    state = ServerState(sched, _Tok(), ChatTemplate(None, _Tok().encode), opts, healthy=lambda: sched.healthy)
    client = TestClient(create_app(state))
    try:
        warm = start_warm_up(state, cfg.vocab_size, 8)
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["status"] == "warming"
        hold.set()
        warm.join(900)
        assert not warm.is_alive()
        assert client.get("/health").status_code == 200
        info = sched.warm_up_info
        assert info["prefill_prompts"] == [64, 128, 256, 512]
        before = sched.compiles.compiles
        assert before > 0  # the listener sees compiles (warm-up had to compile)
        hs = [sched.submit([40 + 7 * k + j for j in range(8)], _greedy(6)) for k in range(8)]
        for n in (1500, 700):  # last chunks of 476 and 188 tokens: padded to 512 and 256
            hs.append(sched.submit([(11 * j) % (cfg.vocab_size - 1) + 1 for j in range(n)], _greedy(3)))
        outs = [h.result(timeout=600) for h in hs]
        assert [o.finish_reason for o in outs] == ["length"] * 10
        assert sched.compiles.compiles == before, "a request compiled on the request path"
    finally:
        sched.close()
        eng.close()


@pytest.mark.slow
def test_pd_worker_first_request_after_restart_compiles_nothing(ckpt):
    from hmoe_jax.serve.pd import PDCoordinator
    from hmoe_jax.serve.pd_worker import WARM_PROMPT_TOKENS

    prompt = list(range(20, 20 + WARM_PROMPT_TOKENS))
    with PDCoordinator(ckpt, engine={"max_len": 256}) as pd:
        pd.wait_ready(600)
        for restart in (False, True):
            if restart:
                victim = pd.pid("decode")
                os.kill(victim, signal.SIGKILL)
                deadline = time.monotonic() + 60
                while pd.pid("decode") in (victim, None) and time.monotonic() < deadline:
                    time.sleep(0.05)  # the coordinator notices the death and respawns
                pd.wait_ready(600)
                assert pd.pid("decode") != victim and pd.workers["decode"].restarts == 1
                # the restarted worker's warm-up is in its ready info, before any request
                assert pd.workers["decode"].info["warm_up_s"] > 0
            c0 = {role: pd.stats(role)["compiles"] for role in ("prefill", "decode")}
            out = pd.submit(prompt, _greedy(5)).result(300)
            assert out.finish_reason == "length" and len(out.tokens) == 5
            c1 = {role: pd.stats(role)["compiles"] for role in ("prefill", "decode")}
            assert c1 == c0, f"first request compiled in a worker (restart={restart}): {c0} -> {c1}"


class _HeldBackend:
    """A stub with the in-process scheduler's warm-up surface: warm_up waits for `go`."""

    def __init__(self):
        from tests.serve_stub import StubBackend

        self.stub, self.go, self.warmed = StubBackend([7, 8]), threading.Event(), False
        self.policy = type("P", (), {"options": {"decode_cap": 2}})()

    def submit(self, prompt_ids, params=None):
        return self.stub.submit(prompt_ids, params)

    def run_exclusive(self, fn):
        return fn()

    def warm_up(self, cap):
        assert self.go.wait(60)
        self.warmed = True
        return {"batches": cap, "arms": {}}


def test_health_is_503_warming_until_warm_up_ends():
    from tests.serve_stub import app_for

    backend = _HeldBackend()
    c, state = app_for(backend)
    assert c.get("/health").status_code == 200  # no warm-up started: live
    t = start_warm_up(state, 512, 2)
    for _ in range(3):  # held: stays warming however often it is asked
        r = c.get("/health")
        assert r.status_code == 503, r.text
        body = r.json()
        assert body["status"] == "warming" and body["error"]["code"] == "warming"
    backend.go.set()
    t.join(30)
    assert backend.warmed and not state.warming
    assert c.get("/health").status_code == 200
