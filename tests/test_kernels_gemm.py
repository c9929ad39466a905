"""FP8 / INT4 GEMM FFI kernels against their `_ref` twins, on every ISA path this CPU has
(the lower paths are forced with max_isa, so the AVX2 and portable code runs here too).

Tolerance: the kernels and the refs round x to bf16 identically and every decoded weight
and every product x_bf16 * w is exact in f32, so they differ only in the order of the f32
sums. The standard bound for a sum of n terms is |error| <= gamma_n * sum |terms| with
gamma_n ~ n * 2^-24; we check |y - ref| <= 2 * K * 2^-24 * (|x_bf16| @ |W|^T) (+ the two
f32 roundings of the scale products, covered by the factor 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hmoe_jax.kernels import gemm
from hmoe_jax.quant.fp8 import FP8_DTYPE, Fp8Tensor, dequantize_np
from hmoe_jax.quant.int4 import dequantize_int4_np, quantize_int4_np
from tests.kernel_helpers import ISA_IDS, ISAS, err_bound, fp8_weight, raw_call  # skips if not built

M_VALUES = [1, 2, 3, 8, 64, 130]


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: ISA_IDS[i])
def test_fp8_decode_all_codes_vs_ml_dtypes(isa):
    """Every e4m3fn code through the kernel's in-register decode (M = 1 and the M > 4 path),
    compared bit-exactly with ml_dtypes. NaN codes (0x7F, 0xFF) must give NaN outputs."""
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)  # 254 finite
    n, k = codes.size, 128
    expect = codes.view(FP8_DTYPE).astype(np.float32)
    # M = 1: row i holds its code at column (7 i) % k, zeros elsewhere; x = ones
    w = np.zeros((n, k), np.uint8)
    w[np.arange(n), (7 * np.arange(n)) % k] = codes
    scale = np.full((2, 1), 2.0, np.float32)  # a power of two keeps the product exact
    t = Fp8Tensor(w=jnp.asarray(w.view(FP8_DTYPE)), scale_inv=jnp.asarray(scale))
    y = np.asarray(gemm.fp8_matmul(jnp.ones((1, k), jnp.float32), t, max_isa=isa))[0]
    np.testing.assert_array_equal(y, 2.0 * expect)
    # M = k: x = identity, W[i, j] = every finite code at every column position
    w2 = codes[(np.arange(n)[:, None] + 3 * np.arange(k)[None, :]) % n]
    t2 = Fp8Tensor(w=jnp.asarray(w2.view(FP8_DTYPE)), scale_inv=jnp.asarray(scale))
    y2 = np.asarray(gemm.fp8_matmul(jnp.eye(k, dtype=jnp.float32), t2, max_isa=isa))
    np.testing.assert_array_equal(y2, 2.0 * w2.view(FP8_DTYPE).astype(np.float32).T)
    # NaN codes: a NaN weight makes its output NaN (NaN * 0 is NaN, as in dequantize-then-dot)
    w3 = np.zeros((4, k), np.uint8)
    w3[0, 5], w3[1, 100], w3[2, 5] = 0x7F, 0xFF, 0x38  # 0x38 = 1.0
    t3 = Fp8Tensor(w=jnp.asarray(w3.view(FP8_DTYPE)), scale_inv=jnp.ones((1, 1), jnp.float32))
    y3 = np.asarray(gemm.fp8_matmul(jnp.ones((1, k), jnp.float32), t3, max_isa=isa))[0]
    assert np.isnan(y3[0]) and np.isnan(y3[1])
    np.testing.assert_array_equal(y3[2:], [1.0, 0.0])


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: ISA_IDS[i])
@pytest.mark.parametrize("m", [1, 5, 20])
@pytest.mark.parametrize("k", [144, 200], ids=["whole-16-tail", "partial-tail"])
def test_fp8_nan_code_anywhere_gives_nan_row(isa, m, k):
    """A NaN code at any position of a row (either half of a 32-code step, a block's last 16
    codes, a partial tail chunk) makes that output NaN for every activation row, as
    dequantize-then-dot does; the other outputs are untouched (checked against the ref)."""
    rng = np.random.default_rng(k + m)
    t = fp8_weight(rng, 12, k)
    w = np.asarray(t.w).view(np.uint8).copy()
    cols = [3, 17, 40, 130, k - 3]  # 130 / k-3: the second block and its tail
    for row, col in enumerate(cols):
        w[2 * row, col] = 0x7F if row % 2 else 0xFF
    t = Fp8Tensor(w=jnp.asarray(w.view(FP8_DTYPE)), scale_inv=t.scale_inv)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = np.asarray(gemm.fp8_matmul(jnp.asarray(x), t, max_isa=isa))
    nan_rows = [2 * r for r in range(len(cols))]
    assert np.isnan(y[:, nan_rows]).all()
    ok = [j for j in range(12) if j not in nan_rows]
    ref = np.asarray(gemm.fp8_matmul_ref(x, t))[:, ok]
    assert np.all(np.abs(y[:, ok] - ref) <= err_bound(x, dequantize_np(t)[ok]))


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: ISA_IDS[i])
@pytest.mark.parametrize("k", [200, 448], ids=["partial-chunk", "chunks"])
def test_activation_rounding_is_bit_exact(isa, k):
    """x -> bf16 (round to nearest even, on the packing path of each ISA, SIMD on AVX-512)
    against ml_dtypes, through W = identity (code 1.0, scale 1): y[j] = bf16(x[j]) exactly,
    every column position of the packed layout. Values include exact ties (both
    parities), near-ties and a carry into the exponent. bf16 subnormals are left out:
    vdpbf16ps treats them as zero (its ISA definition), the scalar paths do not."""
    rng = np.random.default_rng(k)
    base = rng.standard_normal(k).astype(np.float32) * np.float32(2.0) ** rng.integers(-20, 20, k)
    u = base.view(np.uint32) & np.uint32(0xFFFF0000)
    special = np.concatenate(
        [
            u | np.uint32(0x8000),  # exact ties: round to even
            u | np.uint32(0x7FFF),  # just below a tie
            u | np.uint32(0x8001),  # just above
            np.array([0x3F7FFFFF, 0xBF7FFF80, 0x7F7F8000], np.uint32),  # carry, tie-up, huge
        ]
    ).view(np.float32)
    x = np.resize(special, (3, k))
    x[1] = np.roll(x[1], 1)
    x[2] = np.roll(x[2], 7)
    w = np.zeros((k, k), np.uint8)
    w[np.arange(k), np.arange(k)] = 0x38  # e4m3 1.0
    t = Fp8Tensor(w=jnp.asarray(w.view(FP8_DTYPE)), scale_inv=jnp.ones((-(-k // 128),) * 2, jnp.float32))
    y = np.asarray(gemm.fp8_matmul(jnp.asarray(x), t, max_isa=isa))
    np.testing.assert_array_equal(y, x.astype(ml_dtypes.bfloat16).astype(np.float32))
    # NaN in x: every output of that row is NaN (NaN * 0), the other rows untouched
    x[1, k // 3] = np.nan
    y = np.asarray(gemm.fp8_matmul(jnp.asarray(x), t, max_isa=isa))
    assert np.isnan(y[1]).all() and not np.isnan(y[[0, 2]]).any()


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: ISA_IDS[i])
@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize("n,k", [(300, 448), (257, 200)], ids=["partial-blocks", "odd-n-partial-chunk"])
def test_fp8_matmul_matches_ref(isa, m, n, k):
    check_fp8_matmul(isa, m, n, k, np.random.default_rng(1000 * m + n))


def check_fp8_matmul(isa, m, n, k, rng):
    t = fp8_weight(rng, n, k)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = np.asarray(gemm.fp8_matmul(jnp.asarray(x), t, max_isa=isa))
    ref = np.asarray(gemm.fp8_matmul_ref(x, t))
    assert y.shape == (m, n)
    assert np.all(np.abs(y - ref) <= err_bound(x, dequantize_np(t)))


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: ISA_IDS[i])
@pytest.mark.parametrize("m", [4, 5, 11, 13, 16, 200, 300])
def test_fp8_matmul_row_chunks_matches_ref(isa, m):
    """A long k makes the AVX2 path's row tiles (4 < M < 16) split the weight rows into
    several L2-sized chunks (256 KiB / k = 16 rows here: 16 + 16 + 11, the last with an odd
    row) with blocks of 4 activation rows and a partial block; M = 4 is the largest decode
    block. From M = 16 its GEMM runs: 128 k blocks, 7 panels of 6 rows + 1, and at M = 300
    two passes of x^T (256 + 44 rows, padded to 48). The AVX-512 blocked GEMM (M >= 12):
    column blocks of 2,048 (up to 96 rows a block) down to 1,024 (192 rows), so every output
    is summed over 8-16 blocks; 10 panels of 4 weight rows + a 2-row and a 1-row tail; row
    tiles of 3 with a remainder of 4 as 2 + 2 (M = 13, 16) or of 2 (M = 200: 192 + 8 rows;
    M = 300: 192 + 108)."""
    check_fp8_matmul(isa, m, 43, 16384, np.random.default_rng(7 + m))


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: ISA_IDS[i])
def test_fp8_bf16_input_and_leading_dims(isa):
    rng = np.random.default_rng(7)
    t = fp8_weight(rng, 136, 256)
    x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.bfloat16)
    y = np.asarray(gemm.fp8_matmul(x, t, max_isa=isa))
    ref = np.asarray(gemm.fp8_matmul_ref(x, t))
    assert y.shape == (2, 3, 136)
    xf = np.asarray(x.astype(jnp.float32)).reshape(6, 256)
    assert np.all(np.abs(y.reshape(6, 136) - ref.reshape(6, 136)) <= err_bound(xf, dequantize_np(t)))


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: ISA_IDS[i])
@pytest.mark.parametrize("m", M_VALUES)
@pytest.mark.parametrize(
    "n,k,group",
    [(257, 384, 64), (130, 256, 128), (65, 448, 64), (40, 384, 192)],
    ids=["g64-odd-n", "g128", "g64-tail-chunk", "g192-straddles-blocks"],
)
def test_int4_matmul_matches_ref(isa, m, n, k, group):
    rng = np.random.default_rng(2000 * m + n)
    w = quantize_int4_np(rng.standard_normal((n, k)).astype(np.float32), group=group)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = np.asarray(gemm.int4_matmul(jnp.asarray(x), w, max_isa=isa))
    ref = np.asarray(gemm.int4_matmul_ref(x, w))
    assert y.shape == (m, n)
    # the AVX-512 path sums x * (136 + q) and subtracts 136 * sum(x) (gemm_avx512.cc): its
    # f32 sums hold terms up to 136 * |x| * scale, so the gamma_n bound gets that term too
    s_full = np.repeat(np.asarray(w.scale, np.float32), group, axis=-1)  # [N, K]
    offset_bound = err_bound(x, 136.0 * s_full)
    assert np.all(np.abs(y - ref) <= err_bound(x, dequantize_int4_np(w)) + offset_bound)


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: ISA_IDS[i])
@pytest.mark.parametrize("m", [4, 5, 11, 16, 300])
def test_int4_matmul_row_chunks_matches_ref(isa, m):
    """INT4 through the AVX2 path's row chunks (4 < M < 16: 256 KiB / 8 KiB rows = 32 rows
    here, 32 + 11) and its GEMM (M = 16; M = 300 in two x^T passes), group 128."""
    rng = np.random.default_rng(11 + m)
    n, k, group = 43, 16384, 128
    w = quantize_int4_np(rng.standard_normal((n, k)).astype(np.float32), group=group)
    x = rng.standard_normal((m, k)).astype(np.float32)
    y = np.asarray(gemm.int4_matmul(jnp.asarray(x), w, max_isa=isa))
    ref = np.asarray(gemm.int4_matmul_ref(x, w))
    assert y.shape == (m, n)
    s_full = np.repeat(np.asarray(w.scale, np.float32), group, axis=-1)  # see the test above
    assert np.all(np.abs(y - ref) <= err_bound(x, dequantize_int4_np(w)) + err_bound(x, 136.0 * s_full))


@pytest.mark.parametrize("isa", ISAS, ids=lambda i: ISA_IDS[i])
@pytest.mark.parametrize("k", [128, 192], ids=["block", "block-and-tail-chunk"])
def test_int4_all_nibbles_every_position(isa, k):
    """All 16 int4 values at every position of a 128-block (all four nibbles of a 16-bit
    word, the AVX-512 kernel's unit) and of a trailing 64-chunk, exactly."""
    from hmoe_jax.quant.int4 import Int4Tensor, pack_nibbles

    q = ((np.arange(16)[:, None] + np.arange(k)[None, :]) % 16) - 8  # [16, k] in [-8, 7]
    t = Int4Tensor(q=jnp.asarray(pack_nibbles(q)), scale=jnp.ones((16, k // 64), jnp.bfloat16), group=64)
    y = np.asarray(gemm.int4_matmul(jnp.eye(k, dtype=jnp.float32), t, max_isa=isa))
    np.testing.assert_array_equal(y, q.T.astype(np.float32))


def test_jit_vmap_and_zero_copy_weights():
    rng = np.random.default_rng(3)
    t = fp8_weight(rng, 256, 256)
    w_np = gemm.aligned_empty(t.w.shape, FP8_DTYPE)
    w_np[...] = np.asarray(t.w)
    w_dev = gemm.device_put_zero_copy(w_np)
    assert w_dev.unsafe_buffer_pointer() == w_np.ctypes.data  # aliased, not copied
    td = Fp8Tensor(w=w_dev, scale_inv=jnp.asarray(t.scale_inv))
    x = jnp.asarray(rng.standard_normal((5, 2, 256)), jnp.float32)
    f = jax.jit(lambda x, w: gemm.fp8_matmul(x, w))
    y = np.asarray(jax.vmap(f, in_axes=(0, None))(x, td))
    ref = np.asarray(gemm.fp8_matmul_ref(x, t))
    assert y.shape == (5, 2, 256)
    xf = np.asarray(x).reshape(10, 256)
    assert np.all(np.abs(y.reshape(10, 256) - ref.reshape(10, 256)) <= err_bound(xf, dequantize_np(t)))


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree(threads):
    rng = np.random.default_rng(4)
    t = fp8_weight(rng, 1000, 512)
    x = jnp.asarray(rng.standard_normal((2, 512)), jnp.float32)
    y1 = np.asarray(gemm.fp8_matmul(x, t, num_threads=1))
    yt = np.asarray(gemm.fp8_matmul(x, t, num_threads=threads))
    np.testing.assert_array_equal(y1, yt)  # same rows -> same code path, same order


def test_read_bytes_sums_every_word():
    rng = np.random.default_rng(5)
    buf = gemm.aligned_empty((3 * (1 << 22) + 136,), np.uint8)  # several tasks + a tail
    buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
    words = buf[: buf.size // 8 * 8].view(np.uint64)
    tail = buf[buf.size // 8 * 8 :].astype(np.uint64)
    want = (int(words.sum(dtype=np.uint64)) + int(tail.sum())) % (1 << 64)
    for isa in ISAS:
        lo, hi = (int(v) for v in np.asarray(gemm.read_bytes(gemm.device_put_zero_copy(buf), max_isa=isa)))
        assert lo | (hi << 32) == want


# ---- errors name the operand ----


def test_python_errors():
    rng = np.random.default_rng(6)
    t = fp8_weight(rng, 128, 256)
    with pytest.raises(TypeError, match="x dtype must be float32 or bfloat16, got int32"):
        gemm.fp8_matmul(jnp.ones((1, 256), jnp.int32), t)
    with pytest.raises(ValueError, match=r"x shape \(1, 255\) must end in K=256"):
        gemm.fp8_matmul(jnp.ones((1, 255)), t)
    bad = Fp8Tensor(w=t.w, scale_inv=jnp.ones((1, 3), jnp.float32))
    with pytest.raises(ValueError, match=r"scale_inv shape \(1, 3\) .* expected \(1, 2\)"):
        gemm.fp8_matmul(jnp.ones((1, 256)), bad)
    with pytest.raises(TypeError, match="w.w dtype must be float8_e4m3fn, got float32"):
        gemm.fp8_matmul(jnp.ones((1, 256)), Fp8Tensor(w=jnp.ones((128, 256)), scale_inv=t.scale_inv))
    w4 = quantize_int4_np(rng.standard_normal((8, 128)).astype(np.float32))
    with pytest.raises(ValueError, match=r"w.scale shape \(8, 1\) .* expected \(8, 2\)"):
        gemm.int4_matmul(jnp.ones((1, 128)), type(w4)(q=w4.q, scale=w4.scale[:, :1], group=64))
    with pytest.raises(TypeError, match="w.scale dtype must be bfloat16, got float32"):
        gemm.int4_matmul(jnp.ones((1, 128)), type(w4)(q=w4.q, scale=np.ones((8, 2), np.float32), group=64))


def test_ffi_errors_name_the_operand():
    """The C++ adapters validate too (callers that bypass the Python wrapper)."""
    w = jnp.zeros((128, 256), FP8_DTYPE)
    s = jnp.ones((1, 2), jnp.float32)
    x = jnp.ones((1, 256), jnp.float32)
    attrs = dict(max_isa=-1, num_threads=0, block_n=128, block_k=128)
    with pytest.raises(Exception, match="hmoe_fp8_gemm: scale grid \\[1, 3\\] does not match w"):
        raw_call("hmoe_fp8_gemm", (1, 128), x, w, jnp.ones((1, 3), jnp.float32), **attrs)
    with pytest.raises(Exception, match="hmoe_fp8_gemm: x dtype must be float32 or bfloat16, got float16"):
        raw_call("hmoe_fp8_gemm", (1, 128), x.astype(jnp.float16), w, s, **attrs)
    with pytest.raises(Exception, match="hmoe_fp8_gemm: w dtype must be float8_e4m3fn"):
        raw_call("hmoe_fp8_gemm", (1, 128), x, jnp.zeros((128, 256), jnp.int8), s, **attrs)
    with pytest.raises(Exception, match="hmoe_fp8_gemm: x shape \\[1, 128\\] must end in K=256"):
        raw_call("hmoe_fp8_gemm", (1, 128), jnp.ones((1, 128)), w, s, **attrs)
    with pytest.raises(Exception, match="block_k must be a positive multiple of 64"):
        raw_call("hmoe_fp8_gemm", (1, 128), x, w, jnp.ones((1, 8), jnp.float32), **{**attrs, "block_k": 32})
    q = jnp.zeros((8, 64), jnp.uint8)
    with pytest.raises(Exception, match="hmoe_int4_gemm: scale shape \\[8, 3\\] does not match q"):
        raw_call(
            "hmoe_int4_gemm",
            (1, 8),
            jnp.ones((1, 128)),
            q,
            jnp.ones((8, 3), jnp.bfloat16),
            max_isa=-1,
            num_threads=0,
        )
    with pytest.raises(
        Exception, match="hmoe_int4_gemm: int4 weight: group must be a positive multiple of 64, got 32"
    ):
        raw_call(
            "hmoe_int4_gemm",
            (1, 8),
            jnp.ones((1, 128)),
            q,
            jnp.ones((8, 4), jnp.bfloat16),
            max_isa=-1,
            num_threads=0,
        )
