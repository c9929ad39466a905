"""Schedule options are strict, like policy options: an option a schedule does not read is
an error naming it and listing the known ones, whichever way it arrives (get_schedule,
Engine.plan, Engine.generate); `auto` takes the options of the schedules it picks between
and hands each chosen schedule the ones it reads."""

from __future__ import annotations

import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.engine.engine import Engine
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.runtime.synthetic import random_params
from hmoe_jax.schedules.base import ScheduleError
from hmoe_jax.schedules.registry import get_schedule, schedule_names

TINY = named_model_config("deepseek_v3_tiny")
# auto picks slp from 8 tokens, so a 12-token prompt reaches slp and a 4-token one cpu
SYSTEM = SystemSpec(auto_slp_min_tokens=8, auto_dslp_min_tokens=8, slp_experts_per_slot=4)


@pytest.mark.parametrize("name", schedule_names())
def test_a_misspelled_option_names_itself_and_the_known_ones(name):
    with pytest.raises(ScheduleError) as e:
        get_schedule(name, ring_slot=4)
    msg = str(e.value)
    assert f"schedule {name!r}" in msg and "'ring_slot'" in msg
    assert "known: [" in msg and "'all_logits'" in msg  # the list of valid ones follows
    if name in ("slp", "auto"):
        assert "'ring_slots'" in msg  # the spelling it meant is among them


def test_every_option_the_docs_name_is_accepted():
    # the names each schedule's docstring (and docs/engine.md) tells a user to pass
    for name, words in {
        "cpu": ["chunk_tokens", "fused", "fuse_shared_tokens", "kv_rows", "max_len", "precision", "attn"],
        "slp": ["ring_slots", "experts_per_slot", "double_buffer", "all_logits", "kv_rows", "max_len"],
        "dslp": ["staging", "ep_capacity", "acc_experts", "all_logits", "kv_rows", "max_len", "piece_temps"],
    }.items():
        for w in words:
            get_schedule(name, **{w: None})  # accepted, no error


def test_auto_hands_each_choice_the_options_it_reads():
    sys = SYSTEM
    auto = get_schedule("auto", ring_slots=2, chunk_tokens=3)
    long_plan = auto.plan(TINY, sys, 12)  # slp: ring_slots reaches it
    assert long_plan.schedule == "slp" and long_plan.meta["ring_slots"] == 2
    assert long_plan.meta["ring_slots"] != get_schedule("slp").plan(TINY, sys, 12).meta["ring_slots"]
    short_plan = auto.plan(TINY, sys, 6)  # cpu: chunk_tokens reaches it, ring_slots is not an error
    assert short_plan.schedule == "cpu" and short_plan.meta["chunk_tokens"] == 3
    assert short_plan.kind_counts()["embed"] == 2  # two chunks of 3 tokens
    with pytest.raises(ScheduleError, match="'ring_slot'"):
        get_schedule("auto", ring_slot=2)


def test_engine_generate_refuses_an_unknown_schedule_option():
    cfg = TINY
    eng = Engine(
        random_params(cfg, seed=1), cfg, system=SYSTEM, expert_fn="ref", precision="f32", max_batch=1
    )
    prompt = [int(t) for t in np.random.default_rng(0).integers(2, cfg.vocab_size, 12)]
    try:
        with pytest.raises(ScheduleError, match=r"schedule 'slp': unknown option\(s\) \['ring_slot'\]"):
            eng.generate(prompt, 2, schedule="slp", ring_slot=4)
        with pytest.raises(ScheduleError, match="'ring_slot'"):
            eng.generate(prompt, 2, schedule="auto", ring_slot=4)
        with pytest.raises(ScheduleError, match="'chunk_token'"):
            eng.plan("cpu", 4, chunk_token=2)
        assert eng.pool.in_use == 0, "the refused request's pool row was freed"
        # the spelled-right option runs and is honoured
        res = eng.generate(prompt, 2, schedule="slp", ring_slots=2)
        assert res.schedule == "slp" and res.plan_meta["ring_slots"] == 2
    finally:
        eng.close()
