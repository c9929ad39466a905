"""BF16 GEMM (`bf16_matmul`, lm_head) and per-head FP8 GEMV (`fp8_head_matmul`, MLA's
absorbed W_uk / W_uv) FFI kernels against their `_ref` twins, on every ISA path this CPU
has (lower paths forced with max_isa).

Tolerance, as in test_kernels_gemm.py: kernels and refs round x to bf16 identically; a
bf16 weight (and a decoded e4m3 one) times a bf16 activation is exact in f32, so the paths
differ only in the order of the f32 sums: |y - ref| <= 2 * K * 2^-24 * (|x_bf16| @ |W|^T)
(gamma_K, the factor 2 covering FP8's per-block scale products). Test weights are normal
numbers: vdpbf16ps (AVX-512) treats bf16 subnormals as zero, the other paths do not.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hmoe_jax.kernels import gemm
from hmoe_jax.quant.fp8 import FP8_DTYPE, Fp8Tensor, dequantize_np
from tests.kernel_helpers import ISA_IDS, ISAS, err_bound, fp8_weight, raw_call  # skips if not built

M_VALUES = [1, 3, 8, 37]  # decode rows (AVX-512 tiles of 4 x 1-2 and 2 x 3-4) and prefill
BF16 = ml_dtypes.bfloat16


def _bf16_weight(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    # row magnitudes that differ by orders, so a row read for the wrong output fails
    mag = np.exp(rng.uniform(-4, 4, size=(n, 1)))
    return (rng.standard_normal((n, k)) * mag).astype(BF16)


# ---- bf16_matmul ----


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: ISA_IDS[i])
@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize(
    "n,k",
    [(300, 448), (257, 200), (13, 7168), (6, 96), (5, 33)],
    ids=["chunks", "odd-n-partial-vector", "lm-head-k", "half-step", "short-odd-k"],
)
def test_bf16_matmul_matches_ref(isa, m, n, k):
    rng = np.random.default_rng(100 * m + n)
    w = _bf16_weight(rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = np.asarray(gemm.bf16_matmul(jnp.asarray(x), jnp.asarray(w), max_isa=isa))
    ref = np.asarray(gemm.bf16_matmul_ref(x, jnp.asarray(w)))
    assert y.shape == (m, n)
    assert np.all(np.abs(y - ref) <= err_bound(x, w.astype(np.float32)))


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: ISA_IDS[i])
@pytest.mark.parametrize("k", [200, 448], ids=["partial-vector", "steps"])
def test_bf16_layout_and_rounding_exact(isa, k):
    """x = identity: y = W^T exactly (every weight at every position of a row, incl. the
    masked tail); W = identity: y = bf16(x) exactly (activation rounding, RNE ties); a NaN
    weight makes its output NaN."""
    rng = np.random.default_rng(k)
    n = 9  # 2 x 4-row tiles + one single row on AVX-512
    w = _bf16_weight(rng, n, k)
    y = np.asarray(gemm.bf16_matmul(jnp.eye(k, dtype=jnp.float32), jnp.asarray(w), max_isa=isa))
    np.testing.assert_array_equal(y, w.astype(np.float32).T)
    u = rng.standard_normal(k).astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
    x = np.stack([u | np.uint32(0x8000), u | np.uint32(0x7FFF), u | np.uint32(0x8001)]).view(np.float32)
    eye = np.eye(k, dtype=np.float32).astype(BF16)
    y = np.asarray(gemm.bf16_matmul(jnp.asarray(x), jnp.asarray(eye), max_isa=isa))
    np.testing.assert_array_equal(y, x.astype(BF16).astype(np.float32))
    w[2, k - 1] = np.nan
    y = np.asarray(gemm.bf16_matmul(jnp.ones((1, k), jnp.float32), jnp.asarray(w), max_isa=isa))[0]
    assert np.isnan(y[2]) and not np.isnan(np.delete(y, 2)).any()


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: ISA_IDS[i])
def test_bf16_matmul_bf16_input_and_leading_dims(isa):
    rng = np.random.default_rng(7)
    w = _bf16_weight(rng, 70, 256)
    x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.bfloat16)
    y = np.asarray(gemm.bf16_matmul(x, jnp.asarray(w), max_isa=isa))
    ref = np.asarray(gemm.bf16_matmul_ref(x, jnp.asarray(w)))
    assert y.shape == (2, 3, 70)
    xf = np.asarray(x.astype(jnp.float32)).reshape(6, 256)
    assert np.all(np.abs(y.reshape(6, 70) - ref.reshape(6, 70)) <= err_bound(xf, w.astype(np.float32)))


def test_bf16_matmul_jit_vmap_zero_copy():
    rng = np.random.default_rng(3)
    w_np = gemm.aligned_empty((130, 512), BF16)
    w_np[...] = _bf16_weight(rng, 130, 512)
    w_dev = gemm.device_put_zero_copy(w_np)
    assert w_dev.unsafe_buffer_pointer() == w_np.ctypes.data  # aliased, not copied
    x = jnp.asarray(rng.standard_normal((5, 2, 512)), jnp.float32)
    f = jax.jit(lambda x, w: gemm.bf16_matmul(x, w))
    y = np.asarray(jax.vmap(f, in_axes=(0, None))(x, w_dev))
    ref = np.asarray(gemm.bf16_matmul_ref(x, w_dev))
    assert y.shape == (5, 2, 130)
    xf = np.asarray(x).reshape(10, 512)
    bound = err_bound(xf, w_np.astype(np.float32))
    assert np.all(np.abs(y.reshape(10, 130) - ref.reshape(10, 130)) <= bound)


@pytest.mark.parametrize("threads", [2, 3])
def test_bf16_thread_counts_agree(threads):
    rng = np.random.default_rng(4)
    w = jnp.asarray(_bf16_weight(rng, 1001, 512))
    x = jnp.asarray(rng.standard_normal((7, 512)), jnp.float32)  # activation chunks 4 + 3
    y1 = np.asarray(gemm.bf16_matmul(x, w, num_threads=1))
    # task boundaries are multiples of 4 rows, so every row keeps its tile shape and order
    np.testing.assert_array_equal(y1, np.asarray(gemm.bf16_matmul(x, w, num_threads=threads)))


def test_bf16_python_errors():
    w = jnp.ones((8, 256), jnp.bfloat16)
    with pytest.raises(TypeError, match="bf16_matmul: w dtype must be bfloat16, got float32"):
        gemm.bf16_matmul(jnp.ones((1, 256)), jnp.ones((8, 256), jnp.float32))
    with pytest.raises(
        ValueError, match=r"bf16_matmul: w must be a non-empty \[N, K\], got shape \(2, 8, 256\)"
    ):
        gemm.bf16_matmul(jnp.ones((1, 256)), jnp.ones((2, 8, 256), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"bf16_matmul: x shape \(1, 255\) must end in K=256"):
        gemm.bf16_matmul(jnp.ones((1, 255)), w)
    with pytest.raises(TypeError, match="bf16_matmul: x dtype must be float32 or bfloat16, got int32"):
        gemm.bf16_matmul(jnp.ones((1, 256), jnp.int32), w)


def test_bf16_ffi_errors_name_the_operand():
    """The C++ adapter validates too (callers that bypass the Python wrapper)."""
    w = jnp.ones((8, 256), jnp.bfloat16)
    x = jnp.ones((1, 256), jnp.float32)
    attrs = dict(max_isa=-1, num_threads=0)
    with pytest.raises(Exception, match="hmoe_bf16_gemm: w dtype must be bfloat16 .*, got float32"):
        raw_call("hmoe_bf16_gemm", (1, 8), x, jnp.ones((8, 256), jnp.float32), **attrs)
    with pytest.raises(Exception, match="hmoe_bf16_gemm: w must have rank >= 2"):
        raw_call("hmoe_bf16_gemm", (1, 8), x, jnp.ones((256,), jnp.bfloat16), **attrs)
    with pytest.raises(Exception, match=r"hmoe_bf16_gemm: w leading dims must be 1 .* \[2, 8, 256\]"):
        raw_call("hmoe_bf16_gemm", (1, 8), x, jnp.ones((2, 8, 256), jnp.bfloat16), **attrs)
    with pytest.raises(Exception, match=r"hmoe_bf16_gemm: x shape \[1, 128\] must end in K=256"):
        raw_call("hmoe_bf16_gemm", (1, 8), jnp.ones((1, 128)), w, **attrs)
    with pytest.raises(Exception, match="hmoe_bf16_gemm: x dtype must be float32 or bfloat16, got float16"):
        raw_call("hmoe_bf16_gemm", (1, 8), x.astype(jnp.float16), w, **attrs)
    with pytest.raises(Exception, match="hmoe_bf16_gemm: result must be float32 with M\\*N elements"):
        raw_call("hmoe_bf16_gemm", (1, 9), x, w, **attrs)


# ---- fp8_head_matmul ----


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: ISA_IDS[i])
@pytest.mark.parametrize("b", M_VALUES)
@pytest.mark.parametrize(
    "h,n,k",
    [(3, 300, 200), (4, 130, 448), (2, 512, 128), (3, 128, 512)],
    ids=["partial-blocks", "odd-n", "mla-q-lat", "mla-o"],
)
def test_fp8_head_matmul_matches_ref(isa, b, h, n, k):
    rng = np.random.default_rng(1000 * b + n)
    t = fp8_weight(rng, h, n, k)
    x = rng.standard_normal((b, h, k)).astype(np.float32)
    y = np.asarray(gemm.fp8_head_matmul(jnp.asarray(x), t, max_isa=isa))
    ref = np.asarray(gemm.fp8_head_matmul_ref(x, t))
    assert y.shape == (b, h, n)
    wf = dequantize_np(t)  # [H, N, K]
    for j in range(h):
        assert np.all(np.abs(y[:, j] - ref[:, j]) <= err_bound(x[:, j], wf[j])), f"head {j}"


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: ISA_IDS[i])
def test_fp8_head_matmul_bf16_input_and_leading_dims(isa):
    rng = np.random.default_rng(8)
    t = fp8_weight(rng, 3, 136, 256)
    x = jnp.asarray(rng.standard_normal((2, 2, 3, 256)), jnp.bfloat16)
    y = np.asarray(gemm.fp8_head_matmul(x, t, max_isa=isa))
    ref = np.asarray(gemm.fp8_head_matmul_ref(x, t))
    assert y.shape == (2, 2, 3, 136)
    xf = np.asarray(x.astype(jnp.float32)).reshape(4, 3, 256)
    wf = dequantize_np(t)
    for j in range(3):
        err = np.abs(y.reshape(4, 3, 136)[:, j] - ref.reshape(4, 3, 136)[:, j])
        assert np.all(err <= err_bound(xf[:, j], wf[j]))


def test_fp8_head_matmul_jit_vmap():
    rng = np.random.default_rng(9)
    t = fp8_weight(rng, 4, 128, 256)
    w_np = gemm.aligned_empty(t.w.shape, FP8_DTYPE)
    w_np[...] = np.asarray(t.w)
    td = Fp8Tensor(w=gemm.device_put_zero_copy(w_np), scale_inv=jnp.asarray(t.scale_inv))
    x = jnp.asarray(rng.standard_normal((5, 2, 4, 256)), jnp.float32)
    f = jax.jit(lambda x, w: gemm.fp8_head_matmul(x, w))
    y = np.asarray(jax.vmap(f, in_axes=(0, None))(x, td))
    ref = np.asarray(gemm.fp8_head_matmul_ref(x, t))
    assert y.shape == (5, 2, 4, 128)
    xf, wf = np.asarray(x).reshape(10, 4, 256), dequantize_np(t)
    for j in range(4):
        err = np.abs(y.reshape(10, 4, 128)[:, j] - ref.reshape(10, 4, 128)[:, j])
        assert np.all(err <= err_bound(xf[:, j], wf[j]))


@pytest.mark.parametrize("threads", [2, 3])
def test_fp8_head_thread_counts_agree(threads):
    """Tasks split the H*N stacked rows and may cross heads; with N % 4 == 0 every row
    stays in the same kernel tile shape, so the results are bit-identical."""
    rng = np.random.default_rng(10)
    t = fp8_weight(rng, 8, 300, 256)
    x = jnp.asarray(rng.standard_normal((2, 8, 256)), jnp.float32)
    y1 = np.asarray(gemm.fp8_head_matmul(x, t, num_threads=1))
    np.testing.assert_array_equal(y1, np.asarray(gemm.fp8_head_matmul(x, t, num_threads=threads)))


def test_fp8_head_python_errors():
    rng = np.random.default_rng(11)
    t = fp8_weight(rng, 2, 128, 256)
    x = jnp.ones((1, 2, 256))
    with pytest.raises(ValueError, match=r"fp8_head_matmul: w.w must be \[H, N, K\], got shape \(128, 256\)"):
        gemm.fp8_head_matmul(x, Fp8Tensor(w=t.w[0], scale_inv=t.scale_inv[0]))
    with pytest.raises(
        ValueError, match=r"fp8_head_matmul: x shape \(1, 3, 256\) must end in \[H, K\]=\[2, 256\]"
    ):
        gemm.fp8_head_matmul(jnp.ones((1, 3, 256)), t)
    with pytest.raises(ValueError, match=r"fp8_head_matmul: x shape \(1, 2, 128\) must end in K=256"):
        gemm.fp8_head_matmul(jnp.ones((1, 2, 128)), t)
    with pytest.raises(
        ValueError, match=r"fp8_head_matmul: w.scale_inv shape \(2, 1, 1\) .* expected \(2, 1, 2\)"
    ):
        gemm.fp8_head_matmul(x, Fp8Tensor(w=t.w, scale_inv=t.scale_inv[:, :, :1]))
    with pytest.raises(TypeError, match="fp8_head_matmul: x dtype must be float32 or bfloat16, got int32"):
        gemm.fp8_head_matmul(jnp.ones((1, 2, 256), jnp.int32), t)
    with pytest.raises(TypeError, match="fp8_head_matmul: w must be an Fp8Tensor, got ArrayImpl"):
        gemm.fp8_head_matmul(x, jnp.ones((2, 128, 256), jnp.bfloat16))


def test_fp8_head_ffi_errors_name_the_operand():
    w = jnp.zeros((2, 128, 256), FP8_DTYPE)
    s = jnp.ones((2, 1, 2), jnp.float32)
    x = jnp.ones((1, 2, 256), jnp.float32)
    attrs = dict(max_isa=-1, num_threads=0, block_n=128, block_k=128)
    out = (1, 2, 128)
    with pytest.raises(
        Exception, match=r"hmoe_fp8_bmv: scale grid \[2, 1, 3\] does not match w .* \[2, 1, 2\]"
    ):
        raw_call("hmoe_fp8_bmv", out, x, w, jnp.ones((2, 1, 3), jnp.float32), **attrs)
    with pytest.raises(Exception, match=r"hmoe_fp8_bmv: scale grid \[3, 1, 2\] does not match w"):
        raw_call("hmoe_fp8_bmv", out, x, w, jnp.ones((3, 1, 2), jnp.float32), **attrs)
    with pytest.raises(Exception, match="hmoe_fp8_bmv: scale dtype must be float32, got bfloat16"):
        raw_call("hmoe_fp8_bmv", out, x, w, s.astype(jnp.bfloat16), **attrs)
    with pytest.raises(Exception, match="hmoe_fp8_bmv: w dtype must be float8_e4m3fn .*, got int8"):
        raw_call("hmoe_fp8_bmv", out, x, jnp.zeros((2, 128, 256), jnp.int8), s, **attrs)
    with pytest.raises(Exception, match=r"hmoe_fp8_bmv: w must have rank >= 3 \(\[H, ., .\]\)"):
        raw_call("hmoe_fp8_bmv", out, x, w[0], s, **attrs)
    with pytest.raises(
        Exception, match=r"hmoe_fp8_bmv: x shape \[1, 3, 256\] must end in \[H, K\]=\[2, 256\]"
    ):
        raw_call("hmoe_fp8_bmv", out, jnp.ones((1, 3, 256)), w, s, **attrs)
    with pytest.raises(Exception, match="hmoe_fp8_bmv: x dtype must be float32 or bfloat16, got float16"):
        raw_call("hmoe_fp8_bmv", out, x.astype(jnp.float16), w, s, **attrs)
    with pytest.raises(
        Exception, match="hmoe_fp8_bmv: fp8 weight: block_k must be a positive multiple of 64"
    ):
        raw_call("hmoe_fp8_bmv", out, x, w, jnp.ones((2, 1, 8), jnp.float32), **{**attrs, "block_k": 32})
    with pytest.raises(Exception, match=r"hmoe_fp8_bmv: result must be float32 with B\*H\*N elements"):
        raw_call("hmoe_fp8_bmv", (1, 2, 127), x, w, s, **attrs)
