"""Plans price what the bf16 policy runs on a GPU: FP8 weights through the FP8 GEMMs
(args.fp8_flops at the fp8 rate, sim/pricing.py), everything else at compute_dtype. The FP8
FLOPs of each op are recomputed here from the model's dimensions (hand formulas, not the
cost functions), and the f32 policy and unquantised models carry none."""

from __future__ import annotations

import dataclasses

import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.kernels import fp8_gemm
from hmoe_jax.plan import costs
from hmoe_jax.plan.buckets import cache_len
from hmoe_jax.plan.profile import load_profile
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.schedules.registry import get_schedule
from hmoe_jax.schedules.slp import layer_times_s
from hmoe_jax.sim.pricing import Rates, price_op

V3 = named_model_config("deepseek_v3")
PAPER = "paper_epyc9355_rtx5090"


def test_the_cost_models_tile_is_the_kernels():
    assert costs.FP8_GEMM_TILE == fp8_gemm.QBLOCK


def _hand_attn_fp8(cfg, t: int) -> int:
    """Expanded static walk from position 0, q_block 1024: q_a, q_b, o_proj on the padded
    query rows; kv_b once per key of the row; kv_a (N = 576) is not a kernel tile."""
    d, h, ql = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank
    qk, dn, dv, r = cfg.qk_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    rows = -(-t // 1024) * 1024 if t > 1024 else t
    assert cfg.cache_dim % 128 != 0
    return 2 * rows * (d * ql + ql * h * qk + h * dv * d) + 2 * cache_len(t) * r * h * (dn + dv)


@pytest.mark.parametrize("t", [4096, 20480])
def test_slp_ops_carry_their_fp8_weight_gemm_flops(t):
    plan = get_schedule("slp").plan(V3, SystemSpec.from_profile(load_profile(PAPER)), t)
    assert plan.meta["compute_dtype"] == "bf16" and plan.meta["fp8_gemms"] is True
    seen = set()
    for op in plan.ops:
        f8 = op.args.get("fp8_flops")
        seen.add(op.kind)
        if op.kind in ("experts_acc", "shared", "dense_ffn"):
            assert f8 == op.flops > 0, op  # every weight of a SwiGLU is an FP8 kernel tile
        elif op.kind == "attn":
            assert f8 == _hand_attn_fp8(V3, t), op
            assert f8 < op.flops  # scores and P.V (bf16) and kv_a stay at compute_dtype
        else:  # route (f32 router), final (bf16 lm_head), embed, combine, copies
            assert f8 is None, op
    assert {"attn", "dense_ffn", "shared", "experts_acc", "route", "final"} <= seen


def _big(system: SystemSpec) -> SystemSpec:
    """The paper's box with a card large enough for f32 weights (memory is not tested here)."""
    return dataclasses.replace(system, acc_mem_bytes=1 << 40)


def test_f32_policy_and_unquantised_models_run_no_fp8_gemm():
    system = _big(SystemSpec.from_profile(load_profile(PAPER)))
    f32 = get_schedule("slp", precision="f32").plan(V3, system, 4096)
    assert f32.meta["compute_dtype"] == "fp32" and not f32.meta["fp8_gemms"]
    assert all("fp8_flops" not in op.args for op in f32.ops)
    plain = dataclasses.replace(V3, quant=None)
    for sched in ("slp", "cpu"):
        p = get_schedule(sched).plan(plain, system, 4096 if sched == "slp" else 1)
        assert all("fp8_flops" not in op.args for op in p.ops)


def test_decode_plan_prices_its_accelerator_gemms_the_same_way():
    """The cpu schedule's decode (batch 4): attn_route fuses the shared expert, its FP8 part
    is the projections, the absorbed W_uk / W_uv per row and the shared expert."""
    plan = get_schedule("cpu", batch=4).plan(V3, SystemSpec(), 1, start_pos=100)
    d, h, ql = V3.hidden_size, V3.num_attention_heads, V3.q_lora_rank
    qk, dn, dv, r = V3.qk_head_dim, V3.qk_nope_head_dim, V3.v_head_dim, V3.kv_lora_rank
    per_row = 2 * (d * ql + ql * h * qk + h * dv * d) + 2 * h * (dn * r + r * dv)
    shared = 2 * 3 * d * V3.moe_intermediate_size * V3.n_shared_experts
    ar = [op for op in plan.ops if op.kind == "attn_route"]
    assert ar and all(op.args["fp8_flops"] == 4 * (per_row + shared) for op in ar)
    dense = [op for op in plan.ops if op.kind == "dense_ffn"]
    assert dense and all(op.args["fp8_flops"] == op.flops for op in dense)


def test_overlap_estimate_is_the_priced_layer():
    """slp.layer_times_s's compute_s is what the simulator prices for one MoE layer's
    accelerator ops (attention, router, shared, every experts_acc), overheads aside."""
    profile = load_profile(PAPER)
    system = _big(SystemSpec.from_profile(profile))
    rates = Rates(profile)
    for precision in ("bf16", "f32"):
        plan = get_schedule("slp", precision=precision).plan(V3, system, 8192)
        layer = next(i for i in range(V3.num_hidden_layers) if V3.is_moe_layer(i))
        acc_s = 0.0
        for op in plan.ops:
            if op.layer == layer and op.resource == "acc:0":
                acc_s += sum(ph.demand_s.get("acc0", 0.0) for ph in price_op(rates, plan, op, (0,), V3))
        _, compute_s = layer_times_s(V3, system, 8192, precision)
        assert compute_s == pytest.approx(acc_s, rel=1e-9), precision
