"""The model's accelerator side lowers for CUDA on a machine without a GPU (and under each
jax of the tested range: CI's py312 leg runs this under jax 0.11.x): jax.export with
platforms=("cuda",) of the tiny model's whole forward (attention, routing, experts, logits)
under the bf16 policy's dtypes, and of the SLP grouped-expert piece (ragged_dot). Lowering
never checks that a custom call has a CUDA handler, so the test lists the custom calls
that appear: none of them may be a CPU-only target (our FFI kernels, LAPACK, ducc FFT)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from hmoe_jax.config import named_model_config
from hmoe_jax.model.model import forward_nocache
from hmoe_jax.model.params import MoEParams
from hmoe_jax.model.precision import policy
from hmoe_jax.runtime import pieces
from hmoe_jax.runtime.synthetic import random_params

CPU_ONLY = re.compile(r"hmoe|lapack|ducc|cpu", re.IGNORECASE)


def _custom_calls(text: str) -> set[str]:
    return set(re.findall(r"custom_call\s*@([\w.$-]+)", text)) | set(
        re.findall(r'call_target_name\s*=\s*"([^"]+)"', text)
    )


def _spec(tree):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype), tree)


def _export(fn, *args):
    exp = jax.export.export(fn, platforms=("cuda",))(*args)
    assert exp.platforms == ("cuda",)
    text = exp.mlir_module()
    bad = {c for c in _custom_calls(text) if CPU_ONLY.search(c)}
    assert not bad, f"CPU-only custom calls in a CUDA export: {bad}"
    return text


def test_the_forward_lowers_for_cuda():
    cfg = named_model_config("deepseek_v3_tiny")
    params = random_params(cfg, seed=5)
    text = _export(
        jax.jit(lambda p, t: forward_nocache(p, cfg, t)),
        _spec(params),
        jax.ShapeDtypeStruct((1, 16), jnp.int32),
    )
    assert "stablehlo.dot_general" in text  # a forward, not an empty module


def test_the_grouped_expert_piece_lowers_for_cuda_in_bf16():
    cfg = named_model_config("deepseek_v3_tiny")
    params = random_params(cfg, seed=5, fp8=False)
    moe = next(lp.ffn for lp in params.layers if isinstance(lp.ffn, MoEParams))
    g = 2
    group = jax.tree.map(lambda a: a[:g], moe.experts)
    t, d, rows = 16, cfg.hidden_size, pieces.row_bucket(16)
    prec = policy("bf16", cpu=False)  # the GPU policy: bf16 operands, f32 accumulation
    args = (
        jax.ShapeDtypeStruct((t, d), prec.act_dtype),
        jax.ShapeDtypeStruct((t, d), jnp.float32),
        jax.ShapeDtypeStruct((t,), jnp.int32),
        jax.ShapeDtypeStruct((t,), jnp.float32),
        jax.ShapeDtypeStruct((), jnp.int32),
        jax.ShapeDtypeStruct((g,), jnp.int32),
        _spec(group),
    )
    fn = jax.jit(
        lambda x, acc, tok, w, off, sizes, grp: pieces.experts_group.__wrapped__(
            x, acc, tok, w, off, sizes, grp, rows=rows, prec=prec
        )
    )
    text = _export(fn, *args)
    # the weights are dequantised to bf16 and the GEMMs read bf16 operands on a GPU
    assert "ragged_dot" in text or "dot_general" in text
    assert re.search(r"dot_general.*bf16", text), "no bf16 GEMM in the bf16 policy's expert piece"
