"""The bench twin's random FP8 weights (hmoe_jax/io/bench_twin.py), made here on the tiny
config (same code path, any config): every code finite, and every quantized projection
variance preserving (unit-variance inputs give unit-variance outputs), which is what keeps
the twin's activations O(1) through its layers."""

from __future__ import annotations

import jax
import numpy as np

from hmoe_jax.config import named_model_config
from hmoe_jax.io.bench_twin import fp8_twin_params
from hmoe_jax.quant.fp8 import Fp8Tensor


def test_codes_finite_and_projections_variance_preserving():
    cfg = named_model_config("deepseek_v3_tiny")
    params = fp8_twin_params(cfg, seed=3)
    leaves = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(x, Fp8Tensor))
    fp8 = [t for t in leaves if isinstance(t, Fp8Tensor)]
    assert fp8, "the tiny config is FP8: some weights must be block-FP8"
    rng = np.random.default_rng(0)
    for t in fp8:
        w = np.asarray(t.w).astype(np.float32)
        assert np.isfinite(w).all()
        # dequantize by hand: one scale per 128 x 128 block of the last two dims
        s = np.repeat(np.repeat(np.asarray(t.scale_inv), 128, axis=-2), 128, axis=-1)
        deq = (w * s[..., : w.shape[-2], : w.shape[-1]]).reshape(-1, w.shape[-2], w.shape[-1])
        x = rng.standard_normal((w.shape[-1], 256)).astype(np.float32)
        y = deq[0] @ x
        assert 0.8 < float(y.std()) < 1.2, (w.shape, float(y.std()))
