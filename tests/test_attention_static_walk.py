"""The accelerator's walk of expanded prefill attention (model.attention._expanded_static:
kv_b once per key block, constant trip counts) against the dense reference `mla.mla_attend`
(one [H, T, S] softmax) and against the CPU walk; its export for CUDA (no loop bound that
depends on data); its FLOPs (plan.costs.attn_flops) against XLA's cost analysis.

bf16 tolerance, derived: bf16 keeps 8 significant bits (unit roundoff u = 2^-9 for round to
nearest; an ulp 2^-8). On the way to the output a value is rounded at most ~6 times (the
activations, the cached latent, K/V after kv_b, q, the probabilities before P.V, the
attention output before o_proj), each a relative error <= u, and the dots accumulate in
f32, so |err| <= ~6 * 2^-8 of the output scale = 2.3e-2 of max|ref| (an ulp per rounding:
generous against cancellations in o_proj's sum). f32: summation order only, 2e-5.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.measure import compile_probe as C
from hmoe_jax.model import attention as A
from hmoe_jax.model.layers import rms_norm
from hmoe_jax.model.mla import mla_attend, mla_qkv
from hmoe_jax.model.precision import F32, policy
from hmoe_jax.plan import costs, memory
from hmoe_jax.runtime.synthetic import random_params

TINY = dataclasses.replace(named_model_config("deepseek_v3_tiny"), quant=None)
# DeepSeek-V3's attention head dims (latent 512 + rope 64, qk 192 = 128 + 64, v 128) with
# 2 heads and a small hidden size, so the real-dim blocks run in seconds.
REAL_DIMS = dataclasses.replace(
    TINY,
    hidden_size=256,
    num_attention_heads=2,
    num_key_value_heads=2,
    q_lora_rank=192,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
)
V3 = named_model_config("deepseek_v3")
BF16 = policy("bf16", cpu=True)
BF16_REL = 6 * 2.0**-8
STATIC = ("cfg", "prec", "form", "q_block", "k_block", "walk")


def _ref(cfg, layer, x_all, t_end, s_len):
    """Dense reference over one sequence: outputs of positions 0..t_end-1 [t_end, D]."""
    x = rms_norm(x_all[None, :t_end], layer.attn_norm, cfg.rms_norm_eps)
    q_nope, q_rope, lat, rope = mla_qkv(layer.attn, cfg, x, 0)
    lat_c = jnp.zeros((1, s_len, cfg.kv_lora_rank)).at[:, :t_end].set(lat)
    rope_c = jnp.zeros((1, s_len, cfg.qk_rope_head_dim)).at[:, :t_end].set(rope)
    return np.asarray(mla_attend(layer.attn, cfg, q_nope, q_rope, lat_c, rope_c, 0)[0])


def _run(cfg, layer, x_all, split, s_len, prec, walk, bq, bk):
    """Two chunks (0..split-1, split..T-1) through prefill_attention in row 1 of 3."""
    x = rms_norm(x_all, layer.attn_norm, cfg.rms_norm_eps)
    lat = jnp.full((3, s_len, cfg.kv_lora_rank), 7.0, prec.cache_dtype)  # other rows: junk
    rope = jnp.full((3, s_len, cfg.qk_rope_head_dim), 7.0, prec.cache_dtype)
    f = jax.jit(A.prefill_attention, static_argnames=STATIC)
    kw = dict(prec=prec, form="expanded", q_block=bq, k_block=bk, walk=walk)
    o1, lat, rope = f(layer.attn, cfg, x[:split], lat, rope, 1, 0, **kw)
    o2, _, _ = f(layer.attn, cfg, x[split:], lat, rope, 1, split, **kw)
    return np.asarray(jnp.concatenate([o1, o2]), np.float32)


def _close(got, ref, rel, what):
    err = float(np.abs(got - ref).max())
    assert err <= rel * float(np.abs(ref).max()), (
        f"{what}: max err {err:.3g} vs max|ref| {np.abs(ref).max():.3g}"
    )


@pytest.mark.parametrize(
    "cfg,t,split,s_len,bq,bk",
    [
        pytest.param(TINY, 45, 29, 64, 8, 16, id="tiny"),
        pytest.param(REAL_DIMS, 200, 72, 256, 32, 64, id="real-head-dims", marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize("prec,rel", [(F32, 2e-5), (BF16, BF16_REL)], ids=["f32", "bf16"])
def test_static_walk_matches_dense_reference(cfg, t, split, s_len, bq, bk, prec, rel):
    """Chunks that straddle query and key blocks, a second chunk at start > 0 (so the static
    bound visits blocks past the causal limit that must mask to nothing), junk in other
    rows and past the written slots."""
    layer = random_params(cfg, seed=5).layers[0]
    x_all = jax.random.normal(jax.random.key(0), (t, cfg.hidden_size))
    ref = _ref(cfg, layer, x_all, t, s_len)
    static = _run(cfg, layer, x_all, split, s_len, prec, "static", bq, bk)
    _close(static, ref, rel, f"static walk {prec.name}")
    traced = _run(cfg, layer, x_all, split, s_len, prec, "traced", bq, bk)
    # the same dots on the same rounded operands; the extra blocks add exact zeros
    np.testing.assert_allclose(static, traced, rtol=0, atol=1e-6 * float(np.abs(ref).max()))


def test_static_key_blocks_cover_every_start():
    """For every start a chunk of T tokens can have in a row of S slots, query block i's
    static bound reaches its last position's key block, never past the row; the walk and
    the cost model use the one function (plan.costs)."""
    for t, s_len, bq, bk in [(45, 64, 8, 16), (300, 512, 128, 64), (4096, 4608, 1024, 512)]:
        assert A.static_key_blocks is costs.static_key_blocks
        bounds = costs.static_key_blocks(t, s_len, bq, bk)
        assert max(bounds) <= s_len // bk
        for start in range(0, s_len - t + 1, max(1, (s_len - t) // 7)):
            for i, n in enumerate(bounds):
                last = min(start + (i + 1) * bq, start + t) - 1
                assert last // bk + 1 <= n, (t, s_len, start, i)


def _while_bounds(text: str) -> list[bool]:
    """For each stablehlo.while in an export's text: does its condition compare the counter
    with a constant (a trip count known when compiled), not with a loop-carried value
    (%iterArg*: a bound computed from data, e.g. from `start`)?"""
    consts = set(re.findall(r"(%\w+) = stablehlo\.constant", text))
    out = []
    for m in re.finditer(r"stablehlo\.while.*?cond \{(.*?)\} do \{", text, re.S):
        cmp = re.search(r"stablehlo\.compare\s+LT,\s*%\w+,\s*(%\w+)", m.group(1))
        out.append(bool(cmp) and not cmp.group(1).startswith("%iterArg") and cmp.group(1) in consts)
    return out


def _export_text(cfg, t, s_len, walk):
    prec = policy("bf16", cpu=False)
    sds = jax.ShapeDtypeStruct

    def f(p, x, lat, rope, row, start):
        return A.prefill_attention(p, cfg, x, lat, rope, row, start, prec=prec, form="expanded", walk=walk)

    args = (
        C.abstract_mla(cfg, prec),
        sds((t, cfg.hidden_size), prec.act_dtype),
        sds((1, s_len, cfg.kv_lora_rank), prec.cache_dtype),
        sds((1, s_len, cfg.qk_rope_head_dim), prec.cache_dtype),
        sds((), jnp.int32),
        sds((), jnp.int32),
    )
    return jax.export.export(jax.jit(f), platforms=("cuda",))(*args).mlir_module()


@pytest.mark.parametrize("cfg,t", [(TINY, 256), (V3, 4096)], ids=["tiny", "deepseek-v3-4k"])
def test_cuda_export_has_no_data_dependent_loop_bound(cfg, t):
    """walk="auto" exported for CUDA holds the static walk only: every while loop compares
    its counter with a constant. The CPU walk fails the same check (its key-block count is
    computed from `start`), so the check can fail."""
    bounds = _while_bounds(_export_text(cfg, t, t + 512, "auto"))
    assert bounds and all(bounds), bounds
    assert not all(_while_bounds(_export_text(cfg, t, t + 512, "traced")))


@pytest.mark.parametrize(
    "t,gain", [(4096, 1.08), pytest.param(32768, 1.25, marks=pytest.mark.slow)], ids=["4k", "32k"]
)
def test_static_walk_flops_match_xla(t, gain):
    """One real DeepSeek-V3 layer's prefill attention (bf16 policy, FP8 weights, row = T),
    the static walk compiled with its loops unrolled (XLA's cost analysis counts a loop body
    once; 32K: ~155 s to compile here): attn_flops(walk="static") within 10% (XLA also
    counts elementwise ops: RoPE, exp, masks, FP8 dequantisation; measured 1.007 at 4K,
    1.015 at 32K). The CPU walk's price is above it by the kv_b work the static walk no
    longer repeats (model: 1.086x at 4K, 1.296x at 32K)."""
    p = C.probe_prefill_attention_math(V3, t, max_len=t, walk="static", unroll=True)
    model = costs.attn_flops(V3, t, cache_len=t)
    assert 1.0 <= p.flops / model < 1.1, (p.flops, model)
    assert costs.attn_flops(V3, t, cache_len=t, walk="traced") > gain * model


@pytest.mark.slow
def test_static_walk_temporaries_at_32k():
    """memory_analysis() of one real DeepSeek-V3 layer's prefill attention at 32768 tokens
    (bf16, row of 33280 slots; ~45 s to compile here). The static walk adds the row's K_nope / V
    buffers (bf16, 2.03 GiB) to the CPU walk's temporaries; on XLA:CPU, which has no bf16
    dot and hoists the f32 upcast of those loop-invariant buffers out of the key loops, their
    f32 copies (4.06 GiB) too, and the [T, D] output it fills block by block next to the
    padded input (measured 2026-12-06: 8.93 vs 2.16 GiB, a difference of 3.33x the buffer).
    So at most 3x the buffer plus two [T, D] bf16 arrays over the CPU walk here; on a GPU
    (bf16 dots) the buffer itself, as plan.memory.attention_temp(walk="static") budgets it."""
    t, s_len = 32768, 32768 + 512
    kv = s_len * V3.num_attention_heads * (V3.qk_nope_head_dim + V3.v_head_dim) * 2
    static = C.probe_prefill_attention_math(V3, t, max_len=s_len, walk="static").temp_bytes
    traced = C.probe_prefill_attention_math(V3, t, max_len=s_len, walk="traced").temp_bytes
    assert kv < static - traced <= 3 * kv + 2 * t * V3.hidden_size * 2, (static, traced, kv)
    est = {w: memory.attention_temp(V3, t, cache_slots=s_len, walk=w) for w in ("static", "traced")}
    # the plan adds the buffer and drops the traced walk's one expanded key block (f32 + bf16)
    block = 512 * V3.num_attention_heads * (V3.qk_nope_head_dim + V3.v_head_dim) * (4 + 2)
    assert est["static"] - est["traced"] == kv - block
