"""One serving core, two clocks (hmoe_jax/policies/core.py).

The real Scheduler (the tiny model on 2 stand-in accelerators) and the simulator serve one
request trace with the same policy; the sequence of actions the policy produced must be the
same in both (the simulator's serving loop cannot drift from the real one unnoticed). The
trace avoids what depends on wall-clock durations (background prefills adopted whenever
they end, measured dual-batch arms): every request arrives at once, only the first prompt is
long. fcfs is also checked against its decisions worked out by hand.

P/D is a policy-driven mode: fcfs runs there, a policy the workers cannot run (paper:
chunks, dslp, dual-batch decode) is refused with what it asks for, by the coordinator, the
simulator and `hmoe serve --pd`; the coordinator honours fcfs's options.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.model.sampling import SamplingParams
from hmoe_jax.plan.profile import load_profile
from hmoe_jax.policies.base import PolicyError
from hmoe_jax.policies.core import AdmissionError, RequestState, ServingCore, check_fits
from hmoe_jax.policies.registry import get_policy
from hmoe_jax.sim.events import SimError
from hmoe_jax.sim.serve import SimRequest, SimServer

ROOT = Path(__file__).resolve().parents[1]
MAX_BATCH, MAX_LEN = 4, 64
# (prompt tokens, new tokens), all submitted before the first iteration
TRACE = [(12, 5), (5, 6), (9, 4), (3, 8), (6, 3)]
OPTIONS = {
    "fcfs": dict(decode_cap=3),
    "paper": dict(long_prompt_tokens=10, chunk_tokens=4, decode_cap=3, dual_batch="off"),
    "dual": dict(long_prompt_tokens=10, chunk_tokens=4, decode_cap=3),
}


@functools.cache
def engine():
    from hmoe_jax.engine.engine import Engine
    from hmoe_jax.runtime.synthetic import random_params

    cfg = named_model_config("deepseek_v3_tiny")
    params = random_params(cfg, seed=5)
    return cfg, Engine(
        params, cfg, devices=2, expert_fn="ref", precision="f32", max_batch=MAX_BATCH, max_len=MAX_LEN
    )


def _by_index(log: list[dict], ids: list[int]) -> list[list[dict]]:
    """The log's actions per iteration (times dropped) with request ids as trace indices."""
    at = {rid: i for i, rid in enumerate(ids)}
    out = []
    for it in log:
        acts = []
        for a in it["actions"]:
            a = dict(a)
            if "request" in a:
                a["request"] = at[a["request"]]
            if "requests" in a:
                a["requests"] = [at[r] for r in a["requests"]]
            acts.append(a)
        out.append(acts)
    return out


def scheduler_actions(name: str) -> list[list[dict]]:
    from hmoe_jax.serve.scheduler import Scheduler

    cfg, eng = engine()
    rng = np.random.default_rng(3)
    sched = Scheduler(eng, name, **OPTIONS[name])
    hs = [
        sched.submit(
            rng.integers(2, cfg.vocab_size, n).tolist(), SamplingParams(max_new_tokens=m, stop_ids=())
        )
        for n, m in TRACE
    ]
    sched.drain(300)
    for h, (_, m) in zip(hs, TRACE):
        assert len(h.result(1).tokens) == m
    assert eng.pool.in_use == 0
    return _by_index(sched.log, [h.id for h in hs])


def simulator_actions(name: str) -> list[list[dict]]:
    cfg = named_model_config("deepseek_v3_tiny")
    prof = load_profile("local").with_accelerators(2)
    srv = SimServer(cfg, prof, name, max_batch=MAX_BATCH, max_len=MAX_LEN, **OPTIONS[name])
    res = srv.run([SimRequest(0.0, n, m) for n, m in TRACE])
    assert [len(r.token_s) for r in res] == [m for _, m in TRACE]
    return _by_index(srv.log, list(range(len(TRACE))))


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_the_scheduler_and_the_simulator_take_the_same_actions(name):
    real, sim = scheduler_actions(name), simulator_actions(name)
    assert real == sim
    kinds = {a["kind"] for it in real for a in it}
    if name != "fcfs":
        assert {"prefill", "chunk", "decode"} <= kinds  # dslp, then chunks beside decode steps
        assert real[0] == [
            {"request": 0, "schedule": "dslp", "devices": [0, 1], "background": False, "kind": "prefill"}
        ]
    if name == "dual":
        assert any(a.get("micro_batches") == 2 for it in real for a in it)


def test_fcfs_takes_the_actions_worked_out_by_hand():
    """All five at once, decode_cap 3: one whole prefill per iteration before the decode
    step of those decoding when the iteration began; no prefill while 3 decode; request 0
    (5 tokens: its first from the prefill, 4 decode steps) ends in iteration 5, so
    iteration 6 prefills request 3."""

    def pre(i):
        return {"request": i, "schedule": "auto", "devices": [0], "background": False, "kind": "prefill"}

    def dec(*ids):
        return {"requests": list(ids), "micro_batches": 1, "measure": False, "kind": "decode"}

    want = [
        [pre(0)],
        [pre(1), dec(0)],
        [pre(2), dec(0, 1)],
        [dec(0, 1, 2)],
        [dec(0, 1, 2)],
        [pre(3), dec(1, 2)],
    ]
    assert simulator_actions("fcfs")[: len(want)] == want


def test_the_core_lifecycle():
    core = ServingCore(get_policy("fcfs", decode_cap=2), devices=1)
    core.add(7, 10, 0.0)
    core.add(8, 3, 0.5)
    assert core.waiting() == [7, 8] and core.rows_held == 0
    core.admit(7)
    core.prefilling(7, background=True)
    v = core.view(1.0, free_rows=3)
    assert [p.id for p in v.waiting] == [8] and v.background == (7,) and v.decoding == ()
    core.decoding(7)
    assert core[7].state == RequestState.DECODING == "decoding"
    core.admit(8)
    assert core.chunked(8, 2) is False and core.waiting() == [8] and core.view(1, 1).waiting[0].prefilled == 2
    assert core.chunked(8, 3) is True and core.waiting() == []
    assert core.rows_held == 2
    assert core.cancel(8).state == RequestState.DONE and core.rows_held == 1 and 8 not in core
    assert core.finish(8) is None  # a second end is a no-op
    core.decoded(2.0, (1, 1), 0.25)
    assert core.view(3.0, 1).last_decode_s == 2.0 and core.step_times == {(1, 1): 0.25}
    with pytest.raises(ValueError, match="added twice"):
        core.add(7, 1, 0.0)
    check_fits(60, 4, 64)
    with pytest.raises(AdmissionError, match=r"= 65 tokens exceed the engine's KV row length of 64"):
        check_fits(60, 5, 64)


def test_pd_runs_fcfs_and_refuses_the_paper_policy():
    from hmoe_jax.io.synthetic import ensure_default_checkpoint
    from hmoe_jax.serve.pd import PDCoordinator

    cfg = named_model_config("deepseek_v3_tiny")
    prof = load_profile("local").with_accelerators(2)
    with pytest.raises(SimError, match="P/D: policy 'paper' may ask for chunk, dual_batch"):
        SimServer(cfg, prof, "paper", pd=True)
    # refused before any worker starts
    with pytest.raises(PolicyError, match="P/D: policy 'paper' may ask for chunk"):
        PDCoordinator(ensure_default_checkpoint(progress=False), "paper")
    srv = SimServer(cfg, prof, pd=True, max_batch=MAX_BATCH, max_len=MAX_LEN, schedule="cpu", decode_cap=1)
    assert srv.policy.name == "fcfs"
    res = srv.run([SimRequest(0.0, n, m) for n, m in TRACE[:2]])
    assert [r.schedule for r in res] == ["cpu", "cpu"]  # the policy's option reached the prefills
    assert [len(r.token_s) for r in res] == [m for _, m in TRACE[:2]]


def test_hmoe_serve_pd_refuses_the_paper_policy():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "hmoe_jax.cli", "serve", "--pd", "--port", "0", "--no-warmup"]
    out = subprocess.run(
        [*cmd, "--policy", "paper"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode != 0
    assert "--policy paper: P/D: policy 'paper' may ask for chunk" in out.stderr, out.stderr[-2000:]
    out = subprocess.run(
        [*cmd, "--devices", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode != 0 and "--devices 3 with --pd" in out.stderr, out.stderr[-2000:]


@pytest.mark.slow
def test_pd_coordinator_honours_the_policys_options():
    """fcfs with schedule=cpu, decode_cap=1 on the worker processes: every prompt prefilled
    by the cpu schedule, the second sent only once the first has finished decoding."""
    from hmoe_jax.io.synthetic import ensure_default_checkpoint
    from hmoe_jax.serve.pd import PDCoordinator

    ckpt = ensure_default_checkpoint(progress=False)
    with PDCoordinator(
        ckpt, "fcfs", engine={"precision": "f32", "max_len": 128}, schedule="cpu", decode_cap=1, warm_up=False
    ) as pd:
        pd.wait_ready(300)
        hs = [pd.submit([5, 17, 2, 99, 41], SamplingParams(max_new_tokens=4, stop_ids=())) for _ in range(2)]
        rs = [h.result(300) for h in hs]
        assert [r.schedule for r in rs] == ["cpu", "cpu"]
        assert rs[1].started_s >= rs[0].finished_s
        assert rs[0].tokens == rs[1].tokens
        prefills = [a for it in pd.log for a in it["actions"] if a["kind"] == "prefill"]
        assert [a["schedule"] for a in prefills] == ["cpu", "cpu"]


def test_hmoe_serve_pd_passes_policy_system_devices_and_expert_fn_to_the_coordinator(monkeypatch):
    """`hmoe serve --pd` hands every flag it honours to the coordinator (a stand-in that
    records its arguments: no worker starts)."""
    import hmoe_jax.serve.pd as pd_mod
    from hmoe_jax.cli.app import build_parser
    from hmoe_jax.cli.run import build_run
    from hmoe_jax.plan.system import load_system
    from hmoe_jax.serve.http_server import build_state

    seen = {}

    class Recorder:
        healthy = True

        def __init__(self, checkpoint, policy, **kw):
            seen.update(checkpoint=checkpoint, policy=policy, **kw)

        def wait_ready(self):
            return self

        def restarts(self):
            return {}

        def close(self):
            pass

    monkeypatch.setattr(pd_mod, "PDCoordinator", Recorder)
    argv = ["serve", "--pd", "--devices", "2", "--system", "paper_epyc9355_rtx5090", "--expert-fn", "ref"]
    argv += ["--policy-option", "schedule=slp", "--max-num-seqs", "5", "--precision", "f32"]
    args = build_parser().parse_args(argv)
    build_state(args, build_run(args))
    assert seen["policy"].name == "fcfs"
    assert seen["policy"].options == {"schedule": "slp", "decode_cap": 5}
    assert seen["prefill_devices"] == seen["decode_devices"] == 1
    assert seen["engine"]["system"] == load_system("paper_epyc9355_rtx5090", 1)
    assert seen["engine"]["system"].num_accelerators == 1  # each worker plans for its own share
    assert seen["engine"]["expert_fn"] == "ref" and seen["engine"]["precision"] == "f32"
    assert seen["engine"]["max_batch"] == 5
