"""The `dslp` / `ep` schedules: plan structure (per-rank loads of only that rank's experts,
ring slots reused across layers, bytes that match the weights) and one engine run through
the staging ring whose per-rank copy log and trace show that each rank streamed only its
experts, every expert byte exactly once. Token/logit agreement with the reference over
1/2/4 devices is the engine's invariant test (tests/test_schedules_invariant.py), which
covers both registry entries."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from hmoe_jax.model.generate import greedy_rollout
from hmoe_jax.model.params import MoEParams
from hmoe_jax.plan import costs
from hmoe_jax.plan.costs import layer_rest_bytes
from hmoe_jax.plan.format import Plan
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.runtime.synthetic import random_params
from hmoe_jax.schedules.base import ScheduleError
from hmoe_jax.schedules.registry import get_schedule
from tests.helpers import model_config


def _cfg(fp8: bool):
    cfg = model_config()
    return cfg if fp8 else dataclasses.replace(cfg, quant=None)


@pytest.mark.parametrize("name", ["dslp", "ep"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_plan_streams_each_ranks_experts_through_reused_slots(name, n):
    cfg = _cfg(True)
    plan = get_schedule(name).plan(cfg, SystemSpec(), 13, devices=n)
    assert Plan.from_json(plan.to_json()).ops == plan.ops
    el = cfg.n_routed_experts // n
    loads = [o for o in plan.ops if o.kind == "dslp_load"]
    assert len(loads) == n * cfg.num_hidden_layers
    moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    for o in loads:
        r = o.args["rank"]
        assert o.resource == f"h2d:{r}"
        # rank 0 reuses the engine's resident non-expert weights: it streams only experts
        rest = 0 if r == 0 else layer_rest_bytes(cfg, o.layer)
        assert o.args["rest"] == ("resident" if r == 0 else "stream")
        if o.layer in moe_layers:
            assert o.args["experts"] == [r * el, (r + 1) * el]
            assert o.bytes == rest + el * costs.expert_bytes(cfg)
            m = moe_layers.index(o.layer)
            assert o.args["slot"] == (m % 2) * n + r
        assert 0 in o.deps, "every load waits for dslp_embed (it creates the run state)"
        if o.layer in moe_layers:
            m = moe_layers.index(o.layer)
            freed = [plan.ops[d] for d in o.deps if d != 0]
            assert all(f.kind == "dslp_unload" and f.args["rank"] == r for f in freed)
            # the slot is refilled only after the MoE two layers back released it; rank 0
            # (resident weights + one layer of experts) also waits for the previous MoE layer
            want = {moe_layers[m - 2]} if m >= 2 else set()
            if r == 0 and m >= 1:
                want.add(moe_layers[m - 1])
            assert {f.layer for f in freed} == want
            assert all(f.args["slot"] == o.args["slot"] for f in freed if f.layer == moe_layers[m - 2])
        else:
            assert o.args["experts"] is None and o.bytes == rest
    assert plan.meta["ring_slots"] == 2 * n
    assert plan.meta["moe_scheme"] == ("smallep" if name == "dslp" else "ep")
    moe = [o for o in plan.ops if o.kind == "dslp_moe"]
    assert [o.layer for o in moe] == moe_layers
    assert all((o.args["comm"]["total_bytes"] == 0) == (n == 1) for o in moe)


def test_layer_rest_bytes_matches_params():
    for fp8 in (False, True):
        cfg = _cfg(fp8)
        params = random_params(cfg, fp8=fp8)
        for i, lp in enumerate(params.layers):
            if isinstance(lp.ffn, MoEParams):
                lp = lp.replace(ffn=lp.ffn.replace(experts=None))
            assert layer_rest_bytes(cfg, i) == sum(
                int(np.asarray(x).nbytes) for x in jax.tree_util.tree_leaves(lp)
            )


def test_plan_rejects_what_it_cannot_run():
    cfg = _cfg(True)
    with pytest.raises(ScheduleError, match="position 0 only"):
        get_schedule("dslp").plan(cfg, SystemSpec(), 4, devices=2, start_pos=3)
    with pytest.raises(ScheduleError, match="n_routed_experts=16 is not divisible by devices=3"):
        get_schedule("dslp").plan(cfg, SystemSpec(), 4, devices=3)
    with pytest.raises(ScheduleError, match="staging='x'"):
        get_schedule("dslp", staging="x").plan(cfg, SystemSpec(), 4, devices=2)


@pytest.mark.parametrize("name", ["dslp", "ep"])
def test_engine_run_streams_each_ranks_experts_once(name):
    pytest.importorskip("_hmoe_ffi", reason="the staging ring needs the built extension (tools/build_ffi.sh)")
    from hmoe_jax.engine.engine import Engine
    from hmoe_jax.plan.trace import TraceRecorder

    cfg = _cfg(True)
    params = random_params(cfg, seed=3, fp8=True)
    prompt = [int(t) for t in np.random.default_rng(7).integers(2, cfg.vocab_size, 13)]
    n = 2
    eng = Engine(params, cfg, devices=n, expert_fn="ref", precision="f32")
    try:
        trace = TraceRecorder()
        cache = eng.new_cache(64)
        logits, run, _, plan = eng.prefill(np.asarray(prompt), cache, name, trace=trace)
        ref = greedy_rollout(params, cfg, prompt, 1)
        assert int(np.argmax(np.asarray(logits[-1]))) == ref[0]
    finally:
        eng.close()
    el = cfg.n_routed_experts // n
    log = run.dslp.streamer.log
    moe_layers = [i for i, lp in enumerate(params.layers) if isinstance(lp.ffn, MoEParams)]
    for i in moe_layers:
        host = params.layers[i].ffn.experts
        for r in range(n):
            (rec,) = [x for x in log if x.layer == i and x.rank == r and x.what == "experts"]
            assert rec.experts == (r * el, (r + 1) * el)
            assert rec.bytes == sum(
                int(np.asarray(x[r * el : (r + 1) * el]).nbytes) for x in jax.tree_util.tree_leaves(host)
            )
    # rank 0 (the engine's accelerator 0) reuses the resident non-expert weights, rank 1 streams them
    assert not [x for x in log if x.rank == 0 and x.what == "replicated"]
    assert {x.layer for x in log if x.rank == 1 and x.what == "replicated"} >= set(
        range(cfg.num_hidden_layers)
    )
    every_expert_byte = len(moe_layers) * cfg.n_routed_experts * costs.expert_bytes(cfg)
    assert sum(run.streamed_bytes.values()) == every_expert_byte
    tracks = {s["resource"] for s in trace.slices}
    assert {"h2d:0", "h2d:1", "acc:all", "unload:0", "unload:1"} <= tracks
    assert plan.meta["devices"] == n


def _overlapping_layers(trace) -> set[int]:
    """Layers i such that some rank's copy of layer i+1 intersects a compute slice of layer i."""
    sl = trace.slices
    loads = [s for s in sl if s["name"].startswith("dslp_load")]
    comp = [s for s in sl if s["resource"] == "acc:all" and s["args"]["layer"] >= 0]
    return {
        c["args"]["layer"]
        for c in comp
        for ld in loads
        if ld["args"]["layer"] == c["args"]["layer"] + 1
        and ld["start_ns"] < c["end_ns"]
        and c["start_ns"] < ld["end_ns"]
    }


@pytest.mark.parametrize("mode", ["pipelined", "serial"])
def test_trace_shows_each_ranks_next_layer_copy_overlapping_compute(mode):
    pytest.importorskip("_hmoe_ffi", reason="the staging ring needs the built extension (tools/build_ffi.sh)")
    from hmoe_jax.engine.engine import Engine
    from hmoe_jax.plan.trace import TraceRecorder

    cfg = _cfg(True)
    params = random_params(cfg, seed=3, fp8=True)
    # ~0.8 MB of experts per rank and layer at 0.1 GB/s: ~8 ms copies; compute capped so its
    # slices are long enough to see (emulation only, no performance claim).
    eng = Engine(params, cfg, devices=2, link_gbps=0.1, acc_tflops_cap=1e-4, expert_fn="ref", precision="f32")
    try:
        ids = np.arange(2, 18)
        eng.prefill(ids, eng.new_cache(64), "dslp", mode=mode)  # compile
        tr = TraceRecorder()
        eng.prefill(ids, eng.new_cache(64), "dslp", mode=mode, trace=tr)
    finally:
        eng.close()
    got = _overlapping_layers(tr)
    if mode == "pipelined":
        assert got, "no rank's copy of layer i+1 overlaps compute of layer i"
    else:
        assert not got, f"serial mode overlapped at layers {got}"
