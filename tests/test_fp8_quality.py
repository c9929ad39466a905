"""e07's FP8 quality bar for the GPU path: the bf16 policy with FP8 GEMMs (every FP8 weight
through the kernels' `_ref` twins: e4m3 activations per token per 128 channels, the same
arithmetic as the Pallas kernels up to f32 summation order, tests/test_kernels_fp8_gemm.py)
running SLP prefills of the shipped FP8 model keeps held-out perplexity within 0.5% of the
bf16 master's (f32 compute, experts_ref: e07's `bf16` row), on e07 --quick's windows."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from hmoe_jax.io.default_model import assets_dir, trained_checkpoint
from tests.helpers import gpu_policy

GAP_TARGET = 0.005


def _nll(logits: np.ndarray, targets: np.ndarray) -> float:
    x = np.asarray(logits, np.float64)
    m = x.max(-1, keepdims=True)
    lp = x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))
    return -float(np.take_along_axis(lp, targets[:, None], -1).sum())


@pytest.mark.slow  # 8 SLP prefills of 256 tokens + 8 reference forwards, ~1-2 min on the dev VM
@pytest.mark.skipif(
    trained_checkpoint() is None or not (assets_dir() / "deepseek_v3_stdlib_bf16").is_dir(),
    reason="no shipped trained checkpoint + bf16 master in this checkout",
)
def test_gpu_policy_fp8_gemms_keep_the_perplexity_gap_under_half_a_percent(monkeypatch):
    import json

    from hmoe_jax.engine import engine as E
    from hmoe_jax.io.loader import load_checkpoint
    from hmoe_jax.model.model import forward_nocache
    from hmoe_jax.train import data

    fp8_dir, bf16_dir = assets_dir() / "deepseek_v3_stdlib", assets_dir() / "deepseek_v3_stdlib_bf16"
    rec = json.loads((fp8_dir / "train_record.json").read_text())["recipe"]
    windows = data.heldout_windows(fp8_dir, 8, rec["seq_len"], rec["heldout_per_mille"])  # e07 --quick
    cfg8, p8 = load_checkpoint(fp8_dir, progress=False)
    cfg16, p16 = load_checkpoint(bf16_dir, progress=False)
    # the GPU policy with XLA:CPU's f32 activation dots (no bf16 x bf16 -> f32 dot on CPU)
    prec = dataclasses.replace(gpu_policy("ref"), dot_dtype=jnp.float32)
    monkeypatch.setattr(E, "precision_for", lambda name, placement: prec)
    eng = E.Engine(p8, cfg8, expert_fn="ref")
    nll = {"bf16": 0.0, "gpu_fp8": 0.0}
    try:
        for w in windows:
            tokens, targets = w[:-1], w[1:]
            ref = forward_nocache(p16, cfg16, jnp.asarray(tokens)[None])[0]
            nll["bf16"] += _nll(np.asarray(ref), targets)
            logits, _, _, plan = eng.prefill(tokens, eng.new_cache(len(tokens)), "slp", all_logits=True)
            assert plan.schedule == "slp"
            nll["gpu_fp8"] += _nll(np.asarray(logits, np.float32), targets)
    finally:
        eng.close()
    n = windows.shape[0] * (windows.shape[1] - 1)
    ppl = {k: float(np.exp(v / n)) for k, v in nll.items()}
    gap = ppl["gpu_fp8"] / ppl["bf16"] - 1.0
    print(
        f"held-out ppl over {n} tokens: bf16 {ppl['bf16']:.4f}, GPU policy FP8 GEMMs {ppl['gpu_fp8']:.4f}, gap {gap:+.4%}"
    )
    assert abs(gap) < GAP_TARGET, ppl
