"""One plan, one spec: the engine of every e03 / e04 / e05 validation row plans, through its own
Engine.plan, exactly the plan the simulator times for that row, op for op, on the rows'
bench-twin shapes. The engine side is what experiments/common/simval.py does (its engine's
SystemSpec is SystemSpec.from_profile of local.toml, with the emulated link's cap; its plan
options are sim.run.plan_options of its cache length); the simulator side is the rows'
own calls (simulate_decode_step / simulate_request on local.toml re-based on a read probe).

The engine is not built (its weights are gigabytes at these shapes): Engine.plan reads only
the engine's config, system and device count, so it is called on an object holding them.
"""

from __future__ import annotations

import dataclasses
import types

import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.engine.engine import Engine
from hmoe_jax.io.bench_twin import bench_twin_config
from hmoe_jax.model.precision import BF16_CPU
from hmoe_jax.plan.buckets import cache_len
from hmoe_jax.plan.profile import load_profile
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.sim.run import decode_step_plan, plan_options, request_plans

E03_MAX_LEN, E04_MAX_LEN = 128, 256  # the engines' max_len in e03 and e04 (HERE_MAX_LEN)


def _local(link_gbps: float | None = None, read_gbps: float | None = None):
    prof = load_profile("local")
    if read_gbps is not None:  # the side-by-side probe re-basing of the simulated side
        prof = prof.with_read_gbps(read_gbps, f"measured: probe {read_gbps} GB/s")
    return prof.with_link(link_gbps) if link_gbps is not None else prof


def _engine(cfg, max_len: int, system: SystemSpec):
    """What Engine.plan reads of the validation engine (simval.make_engine)."""
    # the validation engines run the bf16 policy on CPU stand-ins (simval.make_engine)
    eng = types.SimpleNamespace(cfg=cfg, system=system, devices=1, max_len=cache_len(max_len), prec=BF16_CPU)
    eng.plan = lambda *a, **k: Engine.plan(eng, *a, **k)
    return eng


@pytest.mark.parametrize("quick", [True, False])
def test_e03_decode_rows_engine_plan_is_the_simulated_plan(quick):
    cfg = bench_twin_config(quick=quick)
    eng = _engine(cfg, E03_MAX_LEN, SystemSpec.from_profile(_local()))
    context = 16 + 2 + (4 if quick else 8)  # measure_decode's context for prompt_len 16
    for batch in (1, 2, 4):
        ours = eng.plan("cpu", 1, context, **plan_options(batch, eng.max_len, decode=True))
        sim = decode_step_plan(cfg, _local(read_gbps=21.5), context, batch=batch, max_len=E03_MAX_LEN)["plan"]
        assert ours == sim, f"decode B={batch}: the engine's plan differs from the simulated one"


@pytest.mark.parametrize("quick", [True, False])
@pytest.mark.parametrize("link", [None, 1.0])
def test_e04_prefill_rows_engine_plan_is_the_simulated_plan(quick, link):
    cfg = bench_twin_config(quick=quick)
    eng = _engine(cfg, E04_MAX_LEN, SystemSpec.from_profile(_local(link)))
    for schedule in ("cpu", "slp"):
        for n in (32, 64, 128, 256):
            ours = eng.plan(schedule, n, 0, all_logits=False, **plan_options(1, eng.max_len))
            sim = request_plans(cfg, _local(link, read_gbps=19.0), schedule, n, max_len=E04_MAX_LEN)[0][
                "plan"
            ]
            assert ours == sim, (
                f"{schedule} T={n} link={link}: the engine's plan differs from the simulated one"
            )


@pytest.mark.parametrize("schedule", ["dslp", "ep"])
def test_e05_dslp_rows_engine_plan_is_the_simulated_plan(schedule):
    # e05's measured shape: experiments.common.models.larger_moe_config(4) (tests do not
    # import experiments), a 256-token prompt into a 512-token cache on two stand-ins
    cfg = dataclasses.replace(
        named_model_config("deepseek_v3_tiny"),
        n_routed_experts=64,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=512,
        hidden_size=512,
        num_hidden_layers=4,
        first_k_dense_replace=1,
    )
    eng = _engine(cfg, 512, SystemSpec.from_profile(_local().with_accelerators(2)))
    eng.devices = 2
    ours = eng.plan(schedule, 256, 0, all_logits=False, **plan_options(1, eng.max_len))
    sim = request_plans(cfg, _local().with_accelerators(2), schedule, 256, max_len=512)[0]["plan"]
    assert ours == sim


def test_the_check_can_fail():
    """What the validation engines ran before: a prefill planned without the row's pool
    options (its attention priced for a cache of the prompt's length, not the engine's
    rows) and a decode plan built once at position 0 (the engine's cached decode plan)
    differ from what the simulator times."""
    cfg = bench_twin_config(quick=True)
    eng = _engine(cfg, E04_MAX_LEN, SystemSpec.from_profile(_local()))
    bare = eng.plan("cpu", 64, 0, all_logits=False)
    assert bare != request_plans(cfg, _local(read_gbps=19.0), "cpu", 64, max_len=E04_MAX_LEN)[0]["plan"]
    eng = _engine(cfg, E03_MAX_LEN, SystemSpec.from_profile(_local()))
    at0 = eng.plan("cpu", 1, 0, batch=1)
    assert at0 != decode_step_plan(cfg, _local(), 22, batch=1, max_len=E03_MAX_LEN)["plan"]
