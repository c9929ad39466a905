"""Blocked (flash-style) prefill attention and batched decode attention of the engine
(hmoe_jax.model.attention) against the dense reference `mla.mla_attend` (one [H, T, S]
softmax), over a pool of cache rows: several query and key blocks, the causal diagonal
inside a block, a chunk continuing at start > 0, rows at different positions in one
decode step, both forms (expanded, absorbed), f32 and the bf16 policy.

Tolerances: f32 differs from the reference by summation order only (online softmax,
per-block partial sums, expanded vs absorbed association): 2e-5 relative to max|ref|.
bf16: activations and cache rounded to bf16 (8 mantissa bits) at each op boundary, so a
few bf16 ulps of the output scale: 3e-2 relative to max|ref|.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.model import attention as A
from hmoe_jax.model.layers import rms_norm
from hmoe_jax.model.mla import mla_attend, mla_qkv
from hmoe_jax.model.precision import F32, policy
from hmoe_jax.runtime import pieces
from hmoe_jax.runtime.synthetic import random_params

CFG = dataclasses.replace(named_model_config("deepseek_v3_tiny"), quant=None)
BF16 = policy("bf16", cpu=True)


@pytest.fixture(scope="module")
def layer():
    return random_params(CFG, seed=5).layers[0]


def _ref(layer, x_all, t_end, s_len):
    """Dense reference over one sequence: outputs of positions 0..t_end-1 [t_end, D] and the
    cache [S, R], [S, dr] they leave."""
    x = rms_norm(x_all[None, :t_end], layer.attn_norm, CFG.rms_norm_eps)
    q_nope, q_rope, lat, rope = mla_qkv(layer.attn, CFG, x, 0)
    lat_c = jnp.zeros((1, s_len, CFG.kv_lora_rank)).at[:, :t_end].set(lat)
    rope_c = jnp.zeros((1, s_len, CFG.qk_rope_head_dim)).at[:, :t_end].set(rope)
    return np.asarray(mla_attend(layer.attn, CFG, q_nope, q_rope, lat_c, rope_c, 0)[0]), lat_c[0], rope_c[0]


def _close(got, ref, rel, what):
    err = float(np.abs(np.asarray(got, np.float32) - ref).max())
    assert err <= rel * float(np.abs(ref).max()), (
        f"{what}: max err {err:.3g} vs max|ref| {np.abs(ref).max():.3g}"
    )


@pytest.mark.parametrize("form", ["expanded", "absorbed"])
@pytest.mark.parametrize("prec,rel", [(F32, 2e-5), (BF16, 3e-2)], ids=["f32", "bf16"])
def test_blocked_prefill_matches_dense_reference(layer, form, prec, rel):
    t, s_len, rows, row = 45, 64, 3, 1
    x_all = jax.random.normal(jax.random.key(0), (t, CFG.hidden_size))
    ref, ref_lat, _ = _ref(layer, x_all, t, s_len)
    x = rms_norm(x_all, layer.attn_norm, CFG.rms_norm_eps)
    lat = jnp.full((rows, s_len, CFG.kv_lora_rank), 7.0, prec.cache_dtype)  # other rows: junk
    rope = jnp.full((rows, s_len, CFG.qk_rope_head_dim), 7.0, prec.cache_dtype)
    # First chunk of 29 tokens, then 16 more at start=29: q blocks of 8, k blocks of 16,
    # so blocks straddle the diagonal and the chunk boundary.
    f = jax.jit(A.prefill_attention, static_argnames=("cfg", "prec", "form", "q_block", "k_block"))
    kw = dict(prec=prec, form=form, q_block=8, k_block=16)
    o1, lat, rope = f(layer.attn, CFG, x[:29], lat, rope, row, 0, **kw)
    o2, lat, rope = f(layer.attn, CFG, x[29:], lat, rope, row, 29, **kw)
    _close(jnp.concatenate([o1, o2]), ref, rel, f"prefill {form} {prec.name}")
    _close(lat[row, :t], np.asarray(ref_lat[:t]), rel, "latent written")
    assert (np.asarray(lat[0], np.float32) == 7.0).all() and (np.asarray(lat[2], np.float32) == 7.0).all()


@pytest.mark.parametrize("path", ["fused", "engine"])
@pytest.mark.parametrize("prec,rel", [(F32, 2e-5), (BF16, 3e-2)], ids=["f32", "bf16"])
def test_batched_decode_rows_at_different_positions(layer, prec, rel, path):
    """fused: decode_attention (write, then attend); engine: decode_attention_unwritten (the
    pool only read, the new keys patched in) and the pool written by pieces.write_kv, as
    runtime/ops runs a decode step: same outputs, and the pool holds the new keys at
    (row, position) with every other slot as the prefill left it."""
    s_len, lens = 64, [5, 17, 40]  # three sequences: prompts of these lengths, one new token each
    rows = np.array([2, 0, 3], np.int32)
    xs = [jax.random.normal(jax.random.key(i + 1), (n + 1, CFG.hidden_size)) for i, n in enumerate(lens)]
    lat = jnp.zeros((4, s_len, CFG.kv_lora_rank), prec.cache_dtype)
    rope = jnp.zeros((4, s_len, CFG.qk_rope_head_dim), prec.cache_dtype)
    pf = jax.jit(A.prefill_attention, static_argnames=("cfg", "prec", "form", "q_block", "k_block"))
    for row, n, x_all in zip(rows, lens, xs):
        x = rms_norm(x_all[:n], layer.attn_norm, CFG.rms_norm_eps)
        _, lat, rope = pf(layer.attn, CFG, x, lat, rope, row, 0, prec=prec, q_block=16, k_block=16)
    x_new = jnp.stack([rms_norm(x_all[n], layer.attn_norm, CFG.rms_norm_eps) for n, x_all in zip(lens, xs)])
    pos = np.array(lens, np.int32)
    before = np.asarray(lat, np.float32).copy(), np.asarray(rope, np.float32).copy()
    if path == "fused":
        dec = jax.jit(A.decode_attention, static_argnames=("cfg", "kv_len", "prec"))
        out, lat, rope = dec(layer.attn, CFG, x_new, lat, rope, rows, pos, 48, prec=prec)
    else:
        dec = jax.jit(A.decode_attention_unwritten, static_argnames=("cfg", "kv_len", "prec"))
        out, new_lat, new_rope = dec(layer.attn, CFG, x_new, lat, rope, rows, pos, 48, prec=prec)
        lat, rope = pieces.write_kv(
            lat, rope, rows, pos, new_lat.astype(jnp.float32), new_rope.astype(jnp.float32)
        )
    after = np.asarray(lat, np.float32), np.asarray(rope, np.float32)
    for b, (n, x_all) in enumerate(zip(lens, xs)):
        ref, ref_lat, ref_rope = _ref(layer, x_all, n + 1, s_len)
        _close(out[b], ref[n], rel, f"decode row {rows[b]} at position {n}")
        _close(after[0][rows[b], n], np.asarray(ref_lat[n]), rel, f"latent written at row {rows[b]}, {n}")
        _close(after[1][rows[b], n], np.asarray(ref_rope[n]), rel, f"rope key written at row {rows[b]}, {n}")
    for got, was in zip(after, before):
        untouched = np.ones(got.shape[:2], bool)
        untouched[rows, pos] = False
        assert (got[untouched] == was[untouched]).all(), "a slot other than the new tokens' changed"


def test_forms_and_key_blocks():
    assert A.resolve_form("auto", 1) == "absorbed" and A.resolve_form("auto", 4096) == "expanded"
    assert A.key_block(512, 64) == 64 and A.key_block(512, 32768) == 512
    with pytest.raises(ValueError, match="attention form 'x'"):
        A.resolve_form("x", 3)
