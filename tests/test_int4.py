"""INT4 format (hmoe_jax.quant.int4): nibble order, quantizer, dequantizers, orbax cache."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from hmoe_jax.quant import int4
from hmoe_jax.quant.fp8 import dequantize_np, quantize_np


def test_nibble_order_exhaustive():
    """Every value in [-8, 7] at every position of a 64-chunk, against the documented
    layout written out by hand: byte j of a chunk = q[j] low nibble | q[32 + j] high nibble."""
    q = ((np.arange(16)[:, None] + np.arange(128)[None, :]) % 16 - 8).astype(np.int8)  # [16, 128]
    p = int4.pack_nibbles(q)
    assert p.shape == (16, 64) and p.dtype == np.uint8
    for c in range(2):
        for j in range(32):
            lo = int(q[0, 64 * c + j]) & 0xF
            hi = int(q[0, 64 * c + 32 + j]) & 0xF
            assert p[0, 32 * c + j] == lo | (hi << 4)
    np.testing.assert_array_equal(int4.unpack_nibbles(p), q)


def test_quantize_error_and_range():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 130, 256)).astype(np.float32)  # leading expert axis
    t = int4.quantize_int4_np(w, group=64)
    assert t.q.shape == (3, 130, 128) and t.scale.shape == (3, 130, 4)
    assert t.scale.dtype == np.dtype(ml_dtypes.bfloat16) and t.shape == (3, 130, 256)
    q = int4.unpack_nibbles(t.q)
    assert q.min() >= -7 and q.max() <= 7
    deq = int4.dequantize_int4_np(t)
    s = np.repeat(np.asarray(t.scale, np.float32), 64, axis=-1)
    # round to nearest on the stored (bf16) scale: error <= scale / 2, except where |w|
    # exceeds 7 * bf16(scale) by the scale's rounding (bf16: relative 2^-9) and is clipped
    assert np.all(np.abs(deq - w) <= s * (0.5 + 7 * 2.0**-8))
    # the max of each group is hit almost exactly: it is the grid's end point
    amax_idx = np.abs(w.reshape(3, 130, 4, 64)).argmax(-1)
    got = np.take_along_axis(np.abs(deq).reshape(3, 130, 4, 64), amax_idx[..., None], -1)[..., 0]
    want = np.abs(w).reshape(3, 130, 4, 64).max(-1)
    np.testing.assert_allclose(got, want, rtol=2.0**-7)


def test_jnp_dequantize_matches_numpy():
    rng = np.random.default_rng(1)
    t = int4.quantize_int4_np(rng.standard_normal((64, 384)).astype(np.float32), group=128)
    np.testing.assert_array_equal(np.asarray(int4.dequantize_int4(t)), int4.dequantize_int4_np(t))


def test_quantize_from_bf16_and_fp8_sources():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((256, 256)).astype(np.float32)
    from_bf16 = int4.quantize_int4_np(w.astype(ml_dtypes.bfloat16))
    ref = int4.quantize_int4_np(w.astype(ml_dtypes.bfloat16).astype(np.float32))
    np.testing.assert_array_equal(from_bf16.q, ref.q)
    fp8 = quantize_np(w)
    from_fp8 = int4.quantize_int4_np(fp8)
    np.testing.assert_array_equal(from_fp8.q, int4.quantize_int4_np(dequantize_np(fp8)).q)


def test_bytes_per_weight_vs_fp8():
    assert int4.int4_bytes_per_weight(64) / 1.0 <= 0.55  # FP8: 1 byte (+ 4 / 16384 scale)
    t = int4.quantize_int4_np(np.ones((128, 7168), np.float32))
    assert (t.q.nbytes + t.scale.nbytes) / (128 * 7168) == pytest.approx(int4.int4_bytes_per_weight(64))


def test_bad_group_and_shape():
    with pytest.raises(ValueError, match="group must be a positive multiple of 64, got 32"):
        int4.quantize_int4_np(np.ones((2, 128), np.float32), group=32)
    with pytest.raises(ValueError, match="K=192 must be a multiple of group=128"):
        int4.quantize_int4_np(np.ones((2, 192), np.float32), group=128)


def test_orbax_cache_converts_once(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    w = quantize_np(rng.standard_normal((128, 256)).astype(np.float32))
    first = int4.cached_quantize_int4(w, tmp_path, "layer0.gate")
    calls = []
    monkeypatch.setattr(int4, "quantize_int4_np", lambda *a, **k: calls.append(1))
    again = int4.cached_quantize_int4(w, tmp_path, "layer0.gate")
    assert calls == []  # restored, not converted again
    np.testing.assert_array_equal(np.asarray(again.q), np.asarray(first.q))
    np.testing.assert_array_equal(np.asarray(again.scale, np.float32), np.asarray(first.scale, np.float32))
    other = quantize_np(rng.standard_normal((128, 256)).astype(np.float32))
    with pytest.raises(ValueError, match="made from a different source tensor"):
        int4.cached_quantize_int4(other, tmp_path, "layer0.gate")
