"""`hmoe simulate`'s what-ifs (--set, --sweep, --ring-slots, --gemm-dtype, --decode-mode):
bad keys are one-line errors listing the valid ones, each override moves the projection the
way a hand computation says, and every what-if is labelled in the record."""

from __future__ import annotations

import json

import pytest

from hmoe_jax.cli import main
from hmoe_jax.config import named_model_config
from hmoe_jax.plan import costs
from hmoe_jax.plan.format import Op, Plan
from hmoe_jax.plan.profile import load_profile
from hmoe_jax.sim.pricing import Rates, price_op
from hmoe_jax.sim.run import price_gemms_as

BENCH = ["simulate", "--model", "deepseek_v3_bench", "--system", "paper_epyc9355_rtx5090", "--devices", "1"]


def _run(capsys, *extra: str):
    rc = main([*BENCH, *extra, "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return json.loads(out.out.strip().splitlines()[-1])


def _err(capsys, *extra: str) -> str:
    assert main([*BENCH, *extra]) == 1
    return capsys.readouterr().err


def test_unknown_keys_are_errors_listing_the_valid_ones(capsys):
    err = _err(capsys, "--schedule", "cpu", "--prompt-len", "8", "--set", "link.h2d=9")
    assert "unknown profile key 'link.h2d'" in err and "h2d_gbps" in err and "d2h_gbps" in err
    err = _err(capsys, "--schedule", "cpu", "--prompt-len", "8", "--set", "lnk.h2d_gbps=9")
    assert "unknown profile section 'lnk'" in err and "overheads" in err
    assert "not a number" in _err(
        capsys, "--schedule", "cpu", "--prompt-len", "8", "--set", "link.h2d_gbps=x"
    )
    assert "SECTION.KEY=VALUE" in _err(
        capsys, "--schedule", "cpu", "--prompt-len", "8", "--set", "link.h2d_gbps"
    )
    assert "must be a number > 0" in _err(
        capsys, "--schedule", "cpu", "--prompt-len", "8", "--set", "link.h2d_gbps=-1"
    )
    assert "no slp ring" in _err(capsys, "--schedule", "cpu", "--prompt-len", "8", "--ring-slots", "4")
    assert "--decode-tokens" in _err(
        capsys, "--schedule", "cpu", "--prompt-len", "8", "--decode-mode", "separate"
    )


def test_doubling_the_link_halves_a_transfer_bound_slp_prefill(capsys):
    # slp on the bench twin at a 2 GB/s link: every routed expert of both MoE layers crosses
    # the link once, so TTFT is about their bytes / h2d (hand computation below)
    cfg = named_model_config("deepseek_v3_bench")
    moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    streamed = moe * cfg.n_routed_experts * costs.expert_bytes(cfg)
    base = ["--schedule", "slp", "--prompt-len", "1024"]
    slow = _run(capsys, *base, "--set", "link.h2d_gbps=2")
    fast = _run(capsys, *base, "--set", "link.h2d_gbps=4")
    assert slow["binding"]["prefill"] == "h2d0"
    assert slow["ttft_s"] == pytest.approx(streamed / 2e9, rel=0.03)
    assert fast["ttft_s"] == pytest.approx(streamed / 4e9, rel=0.03)
    s = slow["whatif"]["set"][0]
    assert (s["key"], s["value"], s["was"], s["src"]) == ("link.h2d_gbps", 2.0, 56.0, "what-if: --set")


def test_sweep_is_one_labelled_projection_per_value(capsys):
    recs = _run(capsys, "--schedule", "slp", "--prompt-len", "1024", "--sweep", "link.h2d_gbps=1,2,4")
    assert [r["whatif"]["set"][-1]["value"] for r in recs] == [1.0, 2.0, 4.0]
    ttft = [r["ttft_s"] for r in recs]
    assert ttft[0] > ttft[1] > ttft[2]
    assert ttft[0] / ttft[2] == pytest.approx(4.0, rel=0.05)  # transfer-bound throughout
    err = _err(
        capsys,
        "--schedule",
        "slp",
        "--prompt-len",
        "8",
        "--sweep",
        "link.h2d_gbps=1",
        "--set",
        "link.h2d_gbps=2",
    )
    assert "not both" in err


def test_ring_slots_override_is_the_plans_ring(capsys):
    central = _run(capsys, "--schedule", "slp", "--prompt-len", "1024")
    two = _run(capsys, "--schedule", "slp", "--prompt-len", "1024", "--ring-slots", "2")
    assert central["ring_slots"] != 2 and "whatif" not in central
    assert two["ring_slots"] == 2 and two["whatif"]["ring_slots"] == 2


def test_gemm_dtype_orders_a_compute_bound_prefill(capsys):
    # a fast link (--set) keeps the prefill compute-bound: the plan's FP8 GEMMs leave the
    # bench twin's 4K prefill link-bound on the paper box's PCIe
    base = ["--schedule", "slp", "--prompt-len", "4000", "--set", "link.h2d_gbps=512"]
    got = {d: _run(capsys, *base, "--gemm-dtype", d) for d in ("fp32", "bf16", "fp8")}
    central = _run(capsys, *base)
    assert central["binding"]["prefill"] == "acc0" and central["compute_dtype"] == "bf16"
    # the plan runs its FP8-weight GEMMs (fp8_flops) in fp8 and the rest in bf16: between
    # everything at bf16 and everything at fp8
    assert got["fp32"]["ttft_s"] > got["bf16"]["ttft_s"] > central["ttft_s"] > got["fp8"]["ttft_s"]
    assert got["fp8"]["whatif"]["gemm_dtype"]["dtype"] == "fp8"
    assert "fp8_flops" in got["fp8"]["whatif"]["gemm_dtype"]["note"]


def test_price_gemms_as_moves_fp8_flops_to_the_dtype():
    """An op with fp8_flops priced as the plan says (part at fp8), then with every GEMM at
    fp32: seconds = flops / (fp32 peak x efficiency), by hand."""
    prof = load_profile("paper_epyc9355_rtx5090").with_accelerators(1)
    rates = Rates(prof)
    op = Op(id=0, kind="shared", resource="acc:0", flops=10**12, args={"fp8_flops": 6 * 10**11})
    plan = Plan("t", 1, (op,), {"compute_dtype": "bf16"})
    eff = prof["accelerator.compute_efficiency"]
    (ph,) = price_op(rates, plan, op, (0,), None)
    assert ph.demand_s["acc0"] == pytest.approx((4e11 / 209e12 + 6e11 / 419e12) / eff)
    p32, moved = price_gemms_as(plan, "fp32")
    assert moved == 6 * 10**11 and p32.meta["compute_dtype"] == "bf16"
    (ph32,) = price_op(rates, p32, p32.ops[0], (0,), None)
    assert ph32.demand_s["acc0"] == pytest.approx(1e12 / 105e12 / eff)
    with pytest.raises(ValueError, match="gemm dtype"):
        price_gemms_as(plan, "int8")


def test_decode_modes_change_the_plan_and_are_labelled(capsys):
    base = ["--schedule", "cpu", "--prompt-len", "16", "--decode-tokens", "2"]
    fused = _run(capsys, *base)
    sep = _run(capsys, *base, "--decode-mode", "separate")
    ser = _run(capsys, *base, "--decode-mode", "separate-serial")
    assert "whatif" not in fused and fused["decode_mode"] == "fused"
    assert sep["whatif"]["decode_mode"] == "separate"
    assert sep["decode_step_s"] != fused["decode_step_s"]  # separate attn / route ops
    assert ser["decode_step_s"] >= sep["decode_step_s"]  # one op at a time cannot be faster
    assert fused["decode_kernel"]["key"] == "cpu.expert_bw_efficiency"
    assert fused["decode_kernel"]["value"] == 0.93 and "range" in fused["decode_kernel"]


def test_assumed_inputs_list_absent_keys_with_their_defaults(capsys):
    rec = _run(capsys, "--schedule", "cpu", "--prompt-len", "8")
    got = rec["assumed_inputs"]
    assert got["accelerator.attn_expanded_tflops"].startswith("assumed: absent; default: ")
    assert "GEMM rate" in got["accelerator.attn_expanded_tflops"]
    assert "free FP8 dequantisation" in got["accelerator.weight_convert_gbps"]
    assert "no copy-rate cap" in got["cpu.copy_gbps"]
    assert "every batch size" in got["cpu.expert_bw_efficiency_batched"]
    assert got["accelerator.compute_efficiency"].startswith("assumed: large GEMMs")
    # a set value is not assumed any more
    rec = _run(capsys, "--schedule", "cpu", "--prompt-len", "8", "--set", "cpu.copy_gbps=20")
    assert "cpu.copy_gbps" not in rec["assumed_inputs"]
