"""The bf16 policy's FP8 GEMMs as a GPU runs them (kernels/fp8_gemm.py hooks, model/precision.py),
checked on CPU: the GPU policy is built with cpu=False and the kernels in Pallas interpret mode.

Tolerances are derived from e4m3 activation rounding (tests/test_kernels_fp8_gemm.py's
premises: a normal value rounds with relative error <= 2^-4, below e4m3's smallest normal
after scaling by s = amax / 448 with absolute error <= 2^-10 s; each kernel output rounds to
bf16 once, 2^-8 relative; f32 accumulation adds <= K 2^-24 sum |x||w|):
- hook vs its `_ref` twin on the same quantised activations: the tight bound.
- the SLP expert piece vs an f32 numpy SwiGLU: the bound carried through gate/up (e4m3
  inputs), silu (Lipschitz constant 1.0998 < 1.1), the product, its bf16 rounding, the
  down GEMM's e4m3 input rounding and its own error, summed with the routing weights.
- a whole SLP prefill: first-order error propagation is linear in the unit roundoff at each
  GEMM input, so the policy's logits error vs the f32 reference is at most (2^-4 + 2^-8) /
  2^-8 = 17 times that of the bf16 policy without FP8 GEMMs (the same bf16 roundings, without
  the e4m3 ones)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.kernels import fp8_gemm as F
from hmoe_jax.model.params import MoEParams
from hmoe_jax.model.precision import BF16, policy
from hmoe_jax.quant.fp8 import Fp8Tensor, dequantize_np, quantize_np
from hmoe_jax.runtime import pieces
from hmoe_jax.runtime.synthetic import random_params

U8, SUB8, UB = 2.0**-4, 2.0**-10, 2.0**-8  # e4m3 normal / subnormal rounding, bf16 rounding


def gpu_policy(form: str = "interpret"):
    """The bf16 policy engine.precision_for builds on a GPU, with the kernels in Pallas
    interpret mode ("interpret") or their jittable `_ref` twins ("ref": the same activation
    quantisation, f32 dots of the dequantised operands; fast on CPU)."""
    if form == "ref":
        return policy(
            "bf16",
            cpu=False,
            accel_fp8_matmul=F.fp8_linear_ref,
            accel_fp8_grouped_matmul=F.fp8_grouped_linear_ref,
            accel_fp8_head_matmul=F.fp8_head_linear_ref,
        )
    p = functools.partial
    return policy(
        "bf16",
        cpu=False,
        accel_fp8_matmul=p(F.fp8_linear, interpret=True),
        accel_fp8_grouped_matmul=p(F.fp8_grouped_linear, interpret=True),
        accel_fp8_head_matmul=p(F.fp8_head_linear, interpret=True),
    )


def _weight(rng, shape):
    t = quantize_np(rng.standard_normal(shape).astype(np.float32) * 0.05)
    return Fp8Tensor(w=jnp.asarray(t.w), scale_inv=jnp.asarray(t.scale_inv))


def _deq(w: Fp8Tensor) -> np.ndarray:
    return dequantize_np(Fp8Tensor(w=np.asarray(w.w), scale_inv=np.asarray(w.scale_inv)))


def _f32(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def _act_err(x_abs: np.ndarray) -> np.ndarray:
    """Bound on |e4m3 block quantisation error| of values with magnitudes <= x_abs [M, K]."""
    m, k = x_abs.shape
    s = x_abs.reshape(m, k // 128, 128).max(-1) / 448.0
    return U8 * x_abs + SUB8 * np.repeat(s, 128, axis=1)


def _gemm_err(x_abs, dx, w_deq, y_abs):
    """Bound on one FP8 GEMM's output error: input error dx through |W|, f32 accumulation,
    one bf16 rounding of the output."""
    k = x_abs.shape[1]
    aw = np.abs(w_deq).T
    e = dx @ aw + k * 2.0**-24 * (x_abs @ aw)
    return e + UB * (y_abs + e)


def test_grouped_and_head_hooks_match_their_refs():
    rng = np.random.default_rng(3)
    w = _weight(rng, (3, 128, 256))
    x = jnp.asarray(rng.standard_normal((40, 256)) * np.exp(rng.standard_normal(256)), jnp.bfloat16)
    sizes = jnp.asarray([10, 0, 25], jnp.int32)  # 35 of 40 rows: the last 5 belong to no group
    y = jax.jit(lambda s: F.fp8_grouped_linear(x, w, s, interpret=True))(sizes)
    y_ref = jax.jit(lambda s: F.fp8_grouped_linear_ref(x, w, s))(sizes)
    assert y.dtype == jnp.float32 and y.shape == (40, 128)
    x_q, x_s = F.quantize_act_fp8(x)
    xd = _f32(x_q) * np.repeat(np.asarray(x_s), 128, axis=1)
    wd = _deq(w)
    owner = np.repeat([0, 1, 2], [10, 0, 25])
    for r, e in enumerate(owner):
        tight = 256 * 2.0**-24 * (np.abs(xd[r]) @ np.abs(wd[e]).T) + UB * (
            np.abs(_f32(y[r])) + np.abs(_f32(y_ref[r]))
        )
        assert np.all(np.abs(_f32(y[r]) - _f32(y_ref[r])) <= tight), r
    np.testing.assert_array_equal(_f32(y[35:]), 0.0)
    np.testing.assert_array_equal(_f32(y_ref[35:]), 0.0)
    # the heads of the absorbed MLA's W_uk / W_uv: H groups of M rows each
    wh = _weight(rng, (4, 128, 256))
    for lead in ((2, 3),):
        xh = jnp.asarray(rng.standard_normal((*lead, 4, 256)), jnp.bfloat16)
        yh = F.fp8_head_linear(xh, wh, interpret=True)
        assert yh.shape == (*lead, 4, 128) and yh.dtype == jnp.float32
        yh_ref = F.fp8_head_linear_ref(xh, wh)
        per_head = np.einsum("...hk,hnk->...hn", _f32(xh), _deq(wh))  # f32, unquantised
        bound = np.einsum("...hk,hnk->...hn", np.abs(_f32(xh)), np.abs(_deq(wh))) * (U8 + SUB8) * 1.01
        bound += UB * np.abs(per_head) * 1.1
        for out in (yh, yh_ref):
            assert np.all(np.abs(_f32(out) - per_head) <= bound)
    with pytest.raises(ValueError, match=r"fp8_head_linear: x must be \[\.\.\., 4, 256\]"):
        F.fp8_head_linear(jnp.zeros((2, 3, 256)), wh, interpret=True)


def _moe_case(seed: int = 5):
    cfg = named_model_config("deepseek_v3_tiny")
    params = random_params(cfg, seed=seed)
    moe = next(lp.ffn for lp in params.layers if isinstance(lp.ffn, MoEParams))
    return cfg, moe


def test_slp_expert_piece_runs_the_grouped_fp8_kernel_within_its_derived_bound():
    """experts_group under the GPU policy (grouped FP8 hook, interpret mode) against an f32
    numpy SwiGLU per (token, expert) with the same FP8 weights, within the bound the module
    docstring derives; and the hook is what ran (a different result from the bf16 path)."""
    cfg, moe = _moe_case()
    rng = np.random.default_rng(7)
    t, d, k = 24, cfg.hidden_size, cfg.num_experts_per_tok
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
    ids = np.stack([rng.choice(cfg.n_routed_experts, k, replace=False) for _ in range(t)]).astype(np.int32)
    wts = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    token, wsorted, offsets = pieces.sort_by_expert(jnp.asarray(ids), jnp.asarray(wts), cfg.n_routed_experts)
    offsets = np.asarray(offsets)
    lo, hi = 4, 8
    group = jax.tree.map(lambda a: a[lo:hi], moe.experts)
    sizes = jnp.asarray(offsets[lo + 1 : hi + 1] - offsets[lo:hi], jnp.int32)
    rows = pieces.row_bucket(int(sizes.sum()))
    prec = gpu_policy()

    def run(p):
        acc = jnp.zeros((t, d), jnp.float32)
        off = jnp.asarray(offsets[lo], jnp.int32)
        return _f32(pieces.experts_group(x, acc, token, wsorted, off, sizes, group, rows, p))

    y = run(prec)
    # numpy: each (token, expert) pair of the group in f32, with its error bound
    want, bound = np.zeros((t, d)), np.zeros((t, d))
    xf = _f32(x)
    for e in range(lo, hi):
        wg, wu, wdn = (
            _deq(jax.tree.map(lambda a, e=e: a[e], w))
            for w in (moe.experts.gate, moe.experts.up, moe.experts.down)
        )
        for tok, j in zip(*np.nonzero(ids == e)):
            xr = xf[tok : tok + 1]
            g, u = xr @ wg.T, xr @ wu.T
            sig = 1 / (1 + np.exp(-g))
            h = g * sig * u
            yr = h @ wdn.T
            dx = _act_err(np.abs(xr))
            eg = _gemm_err(np.abs(xr), dx, wg, np.abs(g))
            eu = _gemm_err(np.abs(xr), dx, wu, np.abs(u))
            eh = 1.1 * eg * (np.abs(u) + eu) + np.abs(g * sig) * eu
            eh += UB * (np.abs(h) + eh)  # rounded to the bf16 activation dtype
            h_abs = np.abs(h) + eh
            ey = _gemm_err(h_abs, eh + _act_err(h_abs), wdn, np.abs(yr))
            want[tok] += wts[tok, j] * yr[0]
            bound[tok] += wts[tok, j] * ey[0]
    assert np.any(want != 0)
    assert np.all(np.abs(y - want) <= bound * 1.001 + 1e-30), float(np.max(np.abs(y - want) - bound))
    # the grouped kernel ran: the bf16 policy without the hook rounds activations differently
    assert not np.array_equal(y, run(BF16))
    # the jittable `_ref` twin (what the quality check runs) meets the same bound
    y_ref = run(policy("bf16", cpu=False, accel_fp8_grouped_matmul=F.fp8_grouped_linear_ref))
    assert np.all(np.abs(y_ref - want) <= bound * 1.001 + 1e-30)


def _slp_logits(monkeypatch, prec, ids):
    """An SLP prefill of the tiny FP8 model on a stand-in with `prec` as the engine's policy."""
    from hmoe_jax.engine import engine as E
    from hmoe_jax.plan.system import SystemSpec

    cfg = named_model_config("deepseek_v3_tiny")
    params = random_params(cfg, seed=5)
    monkeypatch.setattr(E, "precision_for", lambda name, placement: prec)
    eng = E.Engine(params, cfg, system=SystemSpec(slp_experts_per_slot=4), expert_fn="ref")
    try:
        logits, _, _, plan = eng.prefill(ids, eng.new_cache(len(ids)), "slp", all_logits=True)
        assert plan.schedule == "slp"
        return _f32(logits), params, cfg
    finally:
        eng.close()


@pytest.mark.slow  # two engines' SLP prefills, ~30 s each form on the dev VM
@pytest.mark.parametrize("form", ["ref", "interpret"])
def test_slp_prefill_under_the_gpu_policy_tracks_the_f32_reference(monkeypatch, form):
    """A whole SLP prefill (attention projections, dense FFN, shared and routed experts through
    the FP8 hooks: the `_ref` twins, or the kernels in interpret mode, ~30 s) against the f32
    reference forward: the error is within 17x the bf16 policy's without FP8 GEMMs (module
    docstring), and the FP8 path ran."""
    from hmoe_jax.model.model import forward_nocache

    ids = np.arange(3, 35, dtype=np.int32)
    # XLA:CPU has no bf16 x bf16 -> f32 dot: activation x activation dots (scores, P.V) in f32
    # here, as the CPU bf16 policy runs them; the weight GEMMs are the GPU's
    y, params, cfg = _slp_logits(
        monkeypatch, dataclasses.replace(gpu_policy(form), dot_dtype=jnp.float32), ids
    )
    y_bf16, _, _ = _slp_logits(monkeypatch, policy("bf16", cpu=True), ids)
    ref = _f32(forward_nocache(params, cfg, jnp.asarray(ids)[None])[0])
    err, err_bf16 = np.max(np.abs(y - ref)), np.max(np.abs(y_bf16 - ref))
    print(f"max |logits - f32|: fp8 GEMMs {err:.3g}, bf16 policy {err_bf16:.3g}")
    assert 0 < err_bf16 and err <= 17 * err_bf16, (err, err_bf16)
    assert not np.array_equal(y, y_bf16)


def test_precision_for_builds_the_fp8_gemm_policy_on_a_gpu_placement():
    """engine.precision_for on a (faked) GPU placement: the bf16 policy's hooks are the Pallas
    FP8 GEMMs, compiled (interpret=False); f32 stays F32; a CPU stand-in never gets them."""
    import types

    from hmoe_jax.engine.engine import precision_for
    from hmoe_jax.model.precision import F32

    gpu = types.SimpleNamespace(acc=types.SimpleNamespace(platform="gpu"), stand_in=False)
    prec = precision_for("bf16", gpu)
    assert (prec.fp8_matmul, prec.fp8_grouped_matmul, prec.fp8_head_matmul) == (
        F.fp8_linear,
        F.fp8_grouped_linear,
        F.fp8_head_linear,
    )
    assert prec.act_dtype == prec.dot_dtype == jnp.bfloat16 and prec.bf16_matmul is None
    assert precision_for("f32", gpu) is F32
    cpu = types.SimpleNamespace(acc=types.SimpleNamespace(platform="cpu"), stand_in=True)
    stand_in = precision_for("bf16", cpu)
    assert stand_in.fp8_grouped_matmul is None and stand_in.fp8_matmul is not F.fp8_linear
