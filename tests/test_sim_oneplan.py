"""One plan, one spec: the engine of every e03 / e04 validation row plans, through its own
Engine.plan, exactly the plan the simulator times for that row (same SystemSpec from the same
local profile, same pool options), op for op, on the rows' bench-twin shapes.

The engine is not built (its weights are gigabytes at these shapes): Engine.plan reads only
the engine's config, system and device count, so it is called on an object holding the
validation engine's (make_engine's) values. The simulator's side is the experiments' own
functions (sim_here's build path: simulate_decode_step / simulate_request's plans).
"""

from __future__ import annotations

import types

import pytest

from experiments.common import simval
from hmoe_jax.engine.engine import Engine
from hmoe_jax.io.bench_twin import bench_twin_config
from hmoe_jax.plan.buckets import cache_len
from hmoe_jax.sim.run import decode_step_plan, request_plans


def _engine(cfg, max_len: int, link_gbps: float | None = None, devices: int = 1):
    """What Engine.plan reads of make_engine(cfg, params, max_len, ..., link_gbps)."""
    return types.SimpleNamespace(
        cfg=cfg, system=simval.validation_system(link_gbps), devices=devices, max_len=cache_len(max_len)
    )


@pytest.mark.parametrize("quick", [True, False])
def test_e03_decode_rows_engine_plan_is_the_simulated_plan(quick):
    cfg = bench_twin_config(quick=quick)
    eng = _engine_with_plan(_engine(cfg, 128))
    steps = 4 if quick else 8
    context = 16 + 2 + steps  # measure_decode's context for prompt_len 16
    for batch in (1, 2, 4):
        ours = simval.engine_decode_plan(eng, batch, context)
        # the simulator's side, re-based on a read probe as sim_here does
        prof = simval.local_profile(21.5)
        sim = decode_step_plan(cfg, prof, context, batch=batch, max_len=128)["plan"]
        assert ours == sim, f"decode B={batch}: the engine's plan differs from the simulated one"


def _engine_with_plan(eng):
    """eng with Engine.plan bound, as simval's helpers call eng.plan(...)."""
    eng.plan = lambda *a, **k: Engine.plan(eng, *a, **k)
    return eng


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("link", [None, 1.0])
def test_e04_prefill_rows_engine_plan_is_the_simulated_plan(quick, link):
    from experiments.e04_slp_prefill import HERE_MAX_LEN

    cfg = bench_twin_config(quick=quick)
    eng = _engine_with_plan(_engine(cfg, HERE_MAX_LEN, link))
    for schedule in ("cpu", "slp"):
        for n in (32, 64, 128, 256):
            ours = eng.plan(schedule, n, 0, all_logits=False, **simval.engine_prefill_options(eng))
            prof = simval.local_profile(19.0, link_gbps=link)
            sim = request_plans(cfg, prof, schedule, n, max_len=HERE_MAX_LEN)[0]["plan"]
            assert ours == sim, (
                f"{schedule} T={n} link={link}: the engine's plan differs from the simulated one"
            )
            if schedule == "slp":
                assert ours.meta["ring_slots"] == sim.meta["ring_slots"]


def test_default_spec_would_have_differed():
    """The check can fail: the old make_engine's SystemSpec() (the paper box's defaults)
    plans a different slp ring than local.toml's, as issue 27 found (2 vs 32 slots)."""
    from hmoe_jax.plan.system import SystemSpec

    cfg = bench_twin_config(quick=True)
    eng = _engine_with_plan(_engine(cfg, 256))
    eng.system = SystemSpec()
    ours = eng.plan("slp", 64, 0, all_logits=False, **simval.engine_prefill_options(eng))
    sim = request_plans(cfg, simval.local_profile(19.0), "slp", 64, max_len=256)[0]["plan"]
    assert ours != sim
