"""Pallas FP8 GEMMs (kernels/fp8_gemm.py) in interpret mode on CPU against their `_ref`s at
DeepSeek-V3 expert shapes, and their CUDA lowering (Triton call, f8e4m3fn operands).

Tolerances, derived rather than tuned:
- Tight (kernel vs the `_ref` on the SAME quantised activations): both compute exact e4m3 x e4m3
  products (3+3 significand bits fit f32 exactly) and scale them in f32; they differ only in the
  f32 summation order and the scale-multiply placement, |d| <= K * 2^-24 * sum|x_deq||w_deq|,
  then each side rounds to bf16 once (unit roundoff 2^-8): + 2^-8 * (|y| + |y_ref|).
- Loose (kernel vs the unquantised f32 activations times the same FP8 weight): e4m3 has 3 stored
  significand bits, so rounding a normal value gives relative error <= 2^-4; below e4m3's
  smallest normal (2^-6 after scaling by s = amax/448) the spacing is 2^-9, absolute error
  <= 2^-10 * s. Per output: |d| <= sum_k (2^-4 |x_k| + 2^-10 s_k) |w_k| + the tight terms.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hmoe_jax.kernels import fp8_gemm as F
from hmoe_jax.quant.fp8 import FP8_DTYPE, Fp8Tensor, dequantize_np, quantize_np

GATE_NK = (2048, 7168)  # DeepSeek-V3 routed expert gate/up: N = moe_intermediate_size, K = hidden
DOWN_NK = (7168, 2048)  # down: N = hidden, K = moe_intermediate_size


def _weight(rng: np.random.Generator, shape: tuple[int, ...]) -> Fp8Tensor:
    t = quantize_np(rng.standard_normal(shape).astype(np.float32) * 0.02)
    return Fp8Tensor(w=jnp.asarray(t.w), scale_inv=jnp.asarray(t.scale_inv))


def _acts(rng: np.random.Generator, m: int, k: int) -> np.ndarray:
    # heavy-tailed per-channel magnitudes (as hidden states have), plus one all-zero block
    x = rng.standard_normal((m, k)).astype(np.float32) * np.exp(rng.standard_normal(k)).astype(np.float32)
    x[0, :128] = 0.0
    return x


def _deq_acts(x_q: np.ndarray, x_scale: np.ndarray) -> np.ndarray:
    return np.asarray(x_q).astype(np.float32) * np.repeat(np.asarray(x_scale), 128, axis=1)


def _f32(a) -> np.ndarray:
    return np.asarray(jnp.asarray(a).astype(jnp.float32))


def _check_tight(y, y_ref, x_deq: np.ndarray, w_deq: np.ndarray) -> None:
    k = x_deq.shape[1]
    y, y_ref = _f32(y), _f32(y_ref)
    bound = k * 2.0**-24 * (np.abs(x_deq) @ np.abs(w_deq).T) + 2.0**-8 * (np.abs(y) + np.abs(y_ref))
    assert np.all(np.abs(y - y_ref) <= bound), float(np.max(np.abs(y - y_ref) - bound))


def test_quantize_act_matches_numpy_ref_and_bound():
    rng = np.random.default_rng(1)
    x = _acts(rng, 16, 7168)
    q, s = F.quantize_act_fp8(jnp.asarray(x))
    q_ref, s_ref = F.quantize_act_fp8_ref(x)
    assert q.dtype == FP8_DTYPE and s.dtype == jnp.float32 and s.shape == (16, 56)
    # XLA folds amax / 448 into amax * (1/448): the scales agree to 1 f32 ulp, not bit for bit
    np.testing.assert_allclose(np.asarray(s), s_ref, rtol=2.0**-23, atol=0)
    # codes: bit-identical to numpy's nearest-even cast of x / s (s the kernel's own scale)
    s_k = np.repeat(np.asarray(s), 128, axis=1)
    q_np = np.clip(x / s_k, -448.0, 448.0).astype(FP8_DTYPE)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), q_np.view(np.uint8))
    # and within one e4m3 step of the all-numpy twin's codes
    steps = np.abs(np.asarray(q).astype(np.float32) - q_ref.astype(np.float32))
    assert np.all(steps <= 2.0**-3 * np.abs(q_ref.astype(np.float32)) + 2.0**-9)
    # DeepSeek's act_quant: scale = amax / 448, so each block's largest |x| maps to +-448
    amax = np.abs(x.reshape(16, 56, 128)).max(-1)
    np.testing.assert_allclose(s_ref[amax > 0], amax[amax > 0] / 448.0, rtol=1e-7)
    assert s_ref[0, 0] == 1.0 and not np.any(np.asarray(q)[0, :128].astype(np.float32))  # zero block
    err = np.abs(_deq_acts(q_ref, s_ref) - x)
    bound = 2.0**-4 * np.abs(x) + 2.0**-10 * np.repeat(s_ref, 128, axis=1)
    assert np.all(err <= bound)
    # the bound is not vacuous: e4m3 rounding does reach a sizeable fraction of it
    assert np.max(err / np.maximum(bound, 1e-30)) > 0.5


def test_quantize_act_rejects_ragged_k():
    with pytest.raises(ValueError, match="multiple of 128"):
        F.quantize_act_fp8(jnp.zeros((2, 100), jnp.float32))


@pytest.mark.parametrize(
    ("m", "nk", "block_m"),
    [(1, GATE_NK, 16), (8, GATE_NK, 16), (8, DOWN_NK, 16), (512, GATE_NK, 128), (512, DOWN_NK, 128)],
)
def test_fp8_gemm_matches_ref(m, nk, block_m):
    rng = np.random.default_rng(m + nk[0])
    n, k = nk
    w = _weight(rng, (n, k))
    x = _acts(rng, m, k)
    x_q, x_s = F.quantize_act_fp8(jnp.asarray(x))
    y = F.fp8_gemm(x_q, x_s, w, block_m=block_m, interpret=True)
    assert y.shape == (m, n) and y.dtype == jnp.bfloat16
    y_ref = F.fp8_gemm_ref(x_q, x_s, w)
    w_deq = dequantize_np(Fp8Tensor(w=np.asarray(w.w), scale_inv=np.asarray(w.scale_inv)))
    x_deq = _deq_acts(x_q, x_s)
    _check_tight(y, y_ref, x_deq, w_deq)
    # loose: against the unquantised activations, bound from e4m3 rounding (module docstring)
    y_exact = x @ w_deq.T
    s_full = np.repeat(np.asarray(x_s), 128, axis=1)
    bound = (2.0**-4 * np.abs(x) + 2.0**-10 * s_full) @ np.abs(w_deq).T
    bound += k * 2.0**-24 * (np.abs(x_deq) @ np.abs(w_deq).T) + 2.0**-8 * np.abs(_f32(y))
    assert np.all(np.abs(_f32(y) - y_exact) <= bound)
    # and typical error is what per-element 2^-4 rounding predicts, not merely under the worst case
    rel_rms = np.linalg.norm(_f32(y) - y_exact) / np.linalg.norm(y_exact)
    assert rel_rms < 2.0**-4


@pytest.mark.slow
def test_fp8_gemm_prefill_4096():
    rng = np.random.default_rng(4096)
    n, k = GATE_NK
    w = _weight(rng, (n, k))
    x_q, x_s = F.quantize_act_fp8(jnp.asarray(_acts(rng, 4096, k)))
    y = F.fp8_gemm(x_q, x_s, w, block_m=256, interpret=True)
    w_deq = dequantize_np(Fp8Tensor(w=np.asarray(w.w), scale_inv=np.asarray(w.scale_inv)))
    _check_tight(y, F.fp8_gemm_ref(x_q, x_s, w), _deq_acts(x_q, x_s), w_deq)


def test_fp8_gemm_catches_a_wrong_scale():
    """The tight check can fail: a weight scale block off by 2x is far outside it."""
    rng = np.random.default_rng(3)
    w = _weight(rng, (256, 1024))
    x_q, x_s = F.quantize_act_fp8(jnp.asarray(_acts(rng, 8, 1024)))
    bad = Fp8Tensor(w=w.w, scale_inv=w.scale_inv.at[1, 3].multiply(2.0))
    y = F.fp8_gemm(x_q, x_s, bad, block_m=16, interpret=True)
    w_deq = dequantize_np(Fp8Tensor(w=np.asarray(w.w), scale_inv=np.asarray(w.scale_inv)))
    with pytest.raises(AssertionError):
        _check_tight(y, F.fp8_gemm_ref(x_q, x_s, w), _deq_acts(x_q, x_s), w_deq)


def test_fp8_gemm_decode_is_the_16_row_kernel():
    rng = np.random.default_rng(5)
    w = _weight(rng, DOWN_NK)
    x_q, x_s = F.quantize_act_fp8(jnp.asarray(_acts(rng, 3, DOWN_NK[1])))
    y = F.fp8_gemm_decode(x_q, x_s, w, interpret=True)
    np.testing.assert_array_equal(_f32(y), _f32(F.fp8_gemm(x_q, x_s, w, block_m=16, interpret=True)))
    with pytest.raises(ValueError, match="M <= 16"):
        F.fp8_gemm_decode(jnp.zeros((17, 2048), FP8_DTYPE), jnp.ones((17, 16)), w, interpret=True)


def test_fp8_gemm_errors_name_the_operand():
    w = _weight(np.random.default_rng(0), (128, 256))
    x_q, x_s = F.quantize_act_fp8(jnp.ones((2, 256)))
    with pytest.raises(TypeError, match="x_q dtype"):
        F.fp8_gemm(x_q.astype(jnp.bfloat16), x_s, w, interpret=True)
    with pytest.raises(ValueError, match="x_scale"):
        F.fp8_gemm(x_q, x_s[:, :1], w, interpret=True)
    with pytest.raises(ValueError, match="x_q.s K=512"):
        F.fp8_gemm(*F.quantize_act_fp8(jnp.ones((2, 512))), w, interpret=True)
    with pytest.raises(ValueError, match="block_m"):
        F.fp8_gemm(x_q, x_s, w, block_m=24, interpret=True)
    with pytest.raises(TypeError, match="Fp8Tensor"):
        F.fp8_gemm(x_q, x_s, w.w, interpret=True)


def _grouped_case(sizes: list[int], n: int, k: int, block_m: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    w = _weight(rng, (len(sizes), n, k))
    x_q, x_s = F.quantize_act_fp8(jnp.asarray(_acts(rng, sum(sizes), k)))
    y = F.fp8_gemm_grouped(x_q, x_s, w, jnp.asarray(sizes, jnp.int32), block_m=block_m, interpret=True)
    y_ref = F.fp8_gemm_grouped_ref(x_q, x_s, w, sizes)
    w_np = Fp8Tensor(w=np.asarray(w.w), scale_inv=np.asarray(w.scale_inv))
    x_deq = _deq_acts(x_q, x_s)
    start = 0
    for e, size in enumerate(sizes):
        rows = slice(start, start + size)
        w_deq = dequantize_np(Fp8Tensor(w=w_np.w[e], scale_inv=w_np.scale_inv[e]))
        _check_tight(_f32(y)[rows], _f32(y_ref)[rows], x_deq[rows], w_deq)
        start += size


def test_fp8_gemm_grouped_uneven_with_empty_group():
    # real K (hidden 7168) and one real-width column slab; groups smaller and larger than a
    # tile, one empty, one exactly a tile
    _grouped_case([21, 0, 16, 3, 40], n=256, k=7168, block_m=16, seed=7)


@pytest.mark.slow
def test_fp8_gemm_grouped_real_gate_shape():
    _grouped_case([300, 0, 17, 195], n=GATE_NK[0], k=GATE_NK[1], block_m=64, seed=8)


def test_fp8_gemm_grouped_traced_sizes_and_errors():
    rng = np.random.default_rng(9)
    w = _weight(rng, (3, 128, 256))
    x_q, x_s = F.quantize_act_fp8(jnp.asarray(_acts(rng, 10, 256)))
    f = jax.jit(lambda s: F.fp8_gemm_grouped(x_q, x_s, w, s, block_m=16, interpret=True))
    for sizes in ([10, 0, 0], [0, 0, 10], [4, 5, 1]):
        y = f(jnp.asarray(sizes, jnp.int32))
        y_ref = F.fp8_gemm_grouped_ref(x_q, x_s, w, sizes)
        np.testing.assert_allclose(_f32(y), _f32(y_ref), rtol=2.0**-7, atol=1e-6)
    # traced sizes that fall short of M: the uncovered rows are zeros, the rest as the ref
    y = _f32(f(jnp.asarray([4, 0, 3], jnp.int32)))
    assert not np.any(y[7:])
    y_ref = _f32(F.fp8_gemm_grouped_ref(x_q[:7], x_s[:7], w, [4, 0, 3]))
    np.testing.assert_allclose(y[:7], y_ref, rtol=2.0**-7, atol=1e-6)
    with pytest.raises(ValueError, match="sum to M=10"):
        F.fp8_gemm_grouped(x_q, x_s, w, np.array([4, 4, 1]), interpret=True)
    with pytest.raises(ValueError, match="group_sizes must be \\[3\\]"):
        F.fp8_gemm_grouped(x_q, x_s, w, np.array([10]), interpret=True)


def _custom_calls(text: str) -> set[str]:
    return set(re.findall(r"stablehlo\.custom_call @([\w$.]+)", text))


TRITON_CALL = "__gpu$xla.gpu.triton"


def _export_cuda(f, *avals) -> str:
    with F.cuda_lowering_target():
        exp = jax.export.export(
            jax.jit(f),
            platforms=("cuda",),
            disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON_CALL)],
        )(*avals)
    return exp.mlir_module()


@pytest.mark.parametrize("m", [1, 512])
def test_exports_for_cuda_as_one_triton_call_on_fp8_operands(m):
    """Lowered for CUDA (no GPU needed): the GEMM is one Pallas Triton call whose operands are
    the e4m3 activations and weight, and no wider copy of the weight appears anywhere."""
    n, k = GATE_NK
    sds = jax.ShapeDtypeStruct

    def f(x, wq, ws):
        x_q, x_s = F.quantize_act_fp8(x)
        w = Fp8Tensor(w=wq, scale_inv=ws)
        return F.fp8_gemm_decode(x_q, x_s, w) if m <= 16 else F.fp8_gemm(x_q, x_s, w)

    text = _export_cuda(
        f, sds((m, k), jnp.bfloat16), sds((n, k), FP8_DTYPE), sds((n // 128, k // 128), jnp.float32)
    )
    assert _custom_calls(text) == {TRITON_CALL}
    call = next(line for line in text.splitlines() if TRITON_CALL in line and "custom_call" in line)
    operands = call[call.rindex(": (") :]
    assert f"x{k}xf8E4M3FN>" in operands.split(",")[0]  # activations e4m3
    assert f"tensor<{n}x{k}xf8E4M3FN>" in operands  # the weight goes in as its FP8 bytes
    assert f"{n}x{k}xbf16" not in text and f"{n}x{k}xf32" not in text  # never widened
    assert f"-> tensor<{16 if m <= 16 else m}x{n}xbf16>" in call  # decode: one 16-row tile


def test_grouped_exports_for_cuda_without_ragged_dot():
    e, (n, k), m = 8, GATE_NK, 512
    sds = jax.ShapeDtypeStruct

    def g(x, wq, ws, sizes):
        x_q, x_s = F.quantize_act_fp8(x)
        return F.fp8_gemm_grouped(x_q, x_s, Fp8Tensor(w=wq, scale_inv=ws), sizes)

    text = _export_cuda(
        g,
        sds((m, k), jnp.bfloat16),
        sds((e, n, k), FP8_DTYPE),
        sds((e, n // 128, k // 128), jnp.float32),
        sds((e,), jnp.int32),
    )
    assert _custom_calls(text) == {TRITON_CALL}
    assert "chlo.ragged_dot" not in text and "stablehlo.dot" not in text  # the only GEMM: the kernel
    assert f"tensor<{e}x{n}x{k}xf8E4M3FN>" in text
    assert f"{n}x{k}xbf16" not in text and f"{n}x{k}xf32" not in text


def test_e4m3_unit_roundoff_is_two_to_minus_four():
    """The tolerance's premise, checked on the format itself: 1 + 2^-3 is the next e4m3 value
    after 1, so the nearest-even rounding error of a normal value is at most 2^-4 relative."""
    e4m3 = ml_dtypes.float8_e4m3fn
    assert float(np.array(1.0 + 2.0**-3, np.float32).astype(e4m3)) == 1.0 + 2.0**-3
    assert float(np.array(1.0 + 2.0**-4 * 0.99, np.float32).astype(e4m3)) == 1.0
    assert float(ml_dtypes.finfo(e4m3).smallest_normal) == 2.0**-6


# --- the precision policy's accelerator option ---------------------------------------------


def test_cpu_policy_is_unchanged_by_the_accelerator_option():
    """accel_fp8_matmul is ignored on CPU: the same policy object, the same bytes out."""
    from hmoe_jax.kernels import gemm
    from hmoe_jax.model import layers
    from hmoe_jax.model.precision import BF16, F32, policy

    for hooks in ({}, {"fp8_matmul": gemm.fp8_matmul_ref}):
        plain = policy("bf16", cpu=True, **hooks)
        opt = policy("bf16", cpu=True, accel_fp8_matmul=F.fp8_linear, **hooks)
        assert opt == plain and opt.fp8_matmul is plain.fp8_matmul
        rng = np.random.default_rng(11)
        w = _weight(rng, (256, 512))
        x = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
        a, b = layers.policy_linear(x, w, plain), layers.policy_linear(x, w, opt)
        assert a.dtype == b.dtype and np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert (
        policy("bf16", cpu=False) is BF16 and policy("f32", cpu=False, accel_fp8_matmul=F.fp8_linear) is F32
    )


def test_accelerator_policy_routes_fp8_weights_through_the_kernel():
    import functools

    from hmoe_jax.model import layers
    from hmoe_jax.model.precision import BF16, policy

    prec = policy("bf16", cpu=False, accel_fp8_matmul=functools.partial(F.fp8_linear, interpret=True))
    rng = np.random.default_rng(12)
    w = _weight(rng, (128, 512))
    for lead in ((1,), (2, 20)):  # decode tile and the general tile, with batch dims
        x = jnp.asarray(_acts(rng, int(np.prod(lead)), 512).reshape(*lead, 512), jnp.bfloat16)
        y = layers.policy_linear(x, w, prec)
        assert y.shape == (*lead, 128) and y.dtype == jnp.float32
        y_ref = F.fp8_linear_ref(x, w)
        x_q, x_s = F.quantize_act_fp8(x.reshape(-1, 512))
        w_deq = dequantize_np(Fp8Tensor(w=np.asarray(w.w), scale_inv=np.asarray(w.scale_inv)))
        _check_tight(_f32(y).reshape(-1, 128), _f32(y_ref).reshape(-1, 128), _deq_acts(x_q, x_s), w_deq)
        # the kernel path, not the bf16 dequantisation (e4m3 activations round differently)
        assert not np.array_equal(_f32(y), _f32(layers.policy_linear(x, w, BF16)))
    # a weight the 128-tiling does not cover (kv_a_proj_with_mqa's N = 576) takes the bf16 path
    w576 = _weight(rng, (576, 512))
    x = jnp.asarray(rng.standard_normal((4, 512)), jnp.bfloat16)
    np.testing.assert_array_equal(
        _f32(layers.policy_linear(x, w576, prec)), _f32(layers.policy_linear(x, w576, BF16))
    )
