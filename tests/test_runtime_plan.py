"""Plans as data: JSON round trip, validation, what cpu / slp / auto plans contain."""

from __future__ import annotations

import dataclasses

import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.plan import costs
from hmoe_jax.plan.format import Op, Plan, PlanError
from hmoe_jax.plan.system import SystemSpec, load_system
from hmoe_jax.schedules.base import ScheduleError
from hmoe_jax.schedules.registry import get_schedule, schedule_names

TINY = named_model_config("deepseek_v3_tiny")
V3 = named_model_config("deepseek_v3")


@pytest.mark.parametrize("name", schedule_names())
def test_every_schedule_plan_round_trips_json(name):
    p = get_schedule(name).plan(TINY, SystemSpec(), 16)
    q = Plan.from_json(p.to_json())
    assert q == p and q.validate() is q
    assert all(op.resource for op in p.ops)


def test_validate_rejects_forward_deps_and_bad_ids():
    ok = Op(0, "embed", "acc:0")
    with pytest.raises(PlanError, match="depends on 1"):
        Plan("x", 1, (Op(0, "embed", "acc:0", deps=(1,)), Op(1, "final", "acc:0"))).validate()
    with pytest.raises(PlanError, match="has id 5"):
        Plan("x", 1, (ok, Op(5, "final", "acc:0"))).validate()
    with pytest.raises(PlanError, match="format"):
        Plan.from_dict({"format": "other", "schedule": "x", "num_tokens": 1, "ops": []})


def test_slp_loads_every_expert_once_per_layer_and_reuses_slots():
    p = get_schedule("slp", experts_per_slot=3).plan(TINY, SystemSpec(), 32)
    ring = p.meta["ring_slots"]
    loads = [op for op in p.ops if op.kind == "load"]
    for layer in range(TINY.num_hidden_layers):
        got = sorted(e for op in loads if op.layer == layer for e in range(*op.args["experts"]))
        want = list(range(TINY.n_routed_experts)) if TINY.is_moe_layer(layer) else []
        assert got == want
    total = sum(op.bytes for op in loads)
    assert total == (
        TINY.num_hidden_layers - TINY.first_k_dense_replace
    ) * TINY.n_routed_experts * costs.expert_bytes(TINY)
    unloads = [op for op in p.ops if op.kind == "unload"]
    for g, ld in enumerate(loads):
        assert ld.args["slot"] == g % ring
        if g >= ring:  # a slot is refilled only after its previous group was released
            assert unloads[g - ring].id in ld.deps


def test_slp_ring_is_sized_from_memory_not_rates():
    # memory for a full-layer ring (141 GiB): a layer of groups at any prompt, however the
    # overlap estimate labels it (transfer-bound at 8K, compute-bound at 128K)
    sys = SystemSpec(acc_mem_bytes=141 * 2**30)
    short = get_schedule("slp").plan(V3, sys, 8192)
    long = get_schedule("slp").plan(V3, sys, 131072)
    assert short.meta["bound"] == "transfer-bound" and short.meta["ring_slots"] == V3.n_routed_experts
    assert long.meta["bound"] == "compute-bound" and long.meta["ring_slots"] == V3.n_routed_experts
    assert get_schedule("slp", ring_slots=5).plan(V3, sys, 8192).meta["ring_slots"] == 5
    # on a 32 GiB card the ring is what memory leaves, the same at a 4x slower link
    small = get_schedule("slp").plan(V3, SystemSpec(), 8192)
    slow = get_schedule("slp").plan(V3, SystemSpec(h2d_gbps=14.0), 8192)
    assert 2 <= small.meta["ring_slots"] == slow.meta["ring_slots"] < V3.n_routed_experts
    # a DeepSeek-V3 layer's routed experts are ~11.3 GB in FP8 (PAPER.md)
    assert 11.0e9 < short.meta["est_layer_copy_s"] * 56e9 < 11.6e9
    with pytest.raises(ScheduleError, match="experts_per_slot"):
        get_schedule("slp", experts_per_slot=0).plan(V3, sys, 8)


def test_cpu_plan_fused_attn_route_has_one_hop_per_moe_layer():
    p = get_schedule("cpu").plan(TINY, SystemSpec(), 1, start_pos=7)
    moe_layers = TINY.num_hidden_layers - TINY.first_k_dense_replace
    kinds = p.kind_counts()
    assert kinds["attn_route"] == kinds["d2h"] == kinds["experts_cpu"] == moe_layers
    assert kinds["attn"] == TINY.first_k_dense_replace and "route" not in kinds
    assert "shared" not in kinds  # decode: the shared expert is inside attn_route
    assert all(op.args["with_shared"] for op in p.ops if op.kind == "attn_route")
    long = get_schedule("cpu").plan(TINY, SystemSpec(), 64)
    assert long.kind_counts()["shared"] == moe_layers  # prefill: separate, overlapping the host
    d2h = [op for op in p.ops if op.kind == "d2h"]
    assert all(op.bytes == costs.hidden_bytes(TINY, 1) + costs.route_bytes(TINY, 1) for op in d2h)


def test_cpu_plan_chunks_and_hops():
    p = get_schedule("cpu", chunk_tokens=5, fused=False).plan(TINY, SystemSpec(), 12)
    moe_layers = TINY.num_hidden_layers - TINY.first_k_dense_replace
    kinds = p.kind_counts()
    assert kinds["embed"] == 3 and kinds["attn"] == 3 * TINY.num_hidden_layers
    assert kinds["d2h"] == kinds["h2d"] == kinds["experts_cpu"] == 3 * moe_layers
    assert [op.args["tokens"] for op in p.ops if op.kind == "embed"] == [[0, 5], [5, 10], [10, 12]]
    assert {op.resource for op in p.ops if op.kind == "experts_cpu"} == {"cpu_experts"}
    assert kinds["final"] == 1  # last position only unless all_logits


def test_auto_policy_thresholds():
    auto = get_schedule("auto")
    sys = SystemSpec(auto_slp_min_tokens=4096)
    assert auto.choose(sys, 4095, 1) == "cpu"
    assert auto.choose(sys, 4096, 1) == "slp"
    assert auto.choose(sys, 1, 1, start_pos=9000) == "cpu"
    assert auto.plan(V3, sys, 100).schedule == "cpu"
    assert auto.plan(V3, sys, 8192).schedule == "slp"


def test_system_config_errors_name_the_key(tmp_path):
    with pytest.raises(ValueError, match="h2d_gbps"):
        SystemSpec(h2d_gbps="fast")
    with pytest.raises(ValueError, match="not found"):
        load_system(str(tmp_path / "nope.toml"))


def test_cost_model_matches_paper_sizes():
    assert abs(costs.expert_bytes(V3) - 44e6) < 1e6  # 3 x 7168 x 2048 FP8 + scales
    f32 = dataclasses.replace(V3, quant=None)
    assert costs.expert_bytes(f32) == 4 * 3 * 7168 * 2048


def test_shipped_system_configs_load_with_the_paper_thresholds():
    one, two = load_system("paper_epyc9355_rtx5090", 1), load_system("paper_epyc9355_rtx5090", 2)
    assert (one.num_accelerators, two.num_accelerators) == (1, 2)
    assert one.auto_slp_min_tokens == 4096 and one.h2d_gbps == 56.0
    auto = get_schedule("auto")
    assert auto.choose(two, 8192, devices=2) in ("dslp", "slp")
    assert auto.choose(one, 2048, devices=1) == "cpu"
