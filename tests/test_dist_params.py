"""The distributed tests' random weights (hmoe_jax.runtime.synthetic.random_params on the
tiny configs of tests/helpers.model_config, no torch needed): the FP8 variant really holds
FP8 experts and fp8=False really does not."""

from __future__ import annotations

import dataclasses

from hmoe_jax.quant.fp8 import FP8_DTYPE, Fp8Tensor
from hmoe_jax.runtime.synthetic import random_params
from tests.helpers import model_config


def test_fp8_params_hold_fp8_experts():
    cfg = model_config()
    p = random_params(cfg, fp8=True)
    moe = p.layers[cfg.first_k_dense_replace].ffn
    assert isinstance(moe.experts.gate, Fp8Tensor)
    assert moe.experts.gate.w.dtype == FP8_DTYPE
    assert moe.experts.gate.w.shape == (cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    assert isinstance(random_params(cfg).layers[-1].ffn.experts.gate, Fp8Tensor)  # follows cfg.quant
    assert not isinstance(random_params(cfg, fp8=False).layers[-1].ffn.experts.gate, Fp8Tensor)
    f32 = dataclasses.replace(cfg, quant=None)
    assert not isinstance(random_params(f32).layers[-1].ffn.experts.gate, Fp8Tensor)
    assert isinstance(random_params(f32, fp8=True).layers[-1].ffn.experts.gate, Fp8Tensor)
