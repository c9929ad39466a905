"""Model components against independent references: numpy re-derivations and HF's own
modules (rope parameters, rotary embedding, router, MoE block), FP8 handling, and the
one-line errors of forward/check_prompt."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hmoe_jax.config import RopeConfig, named_model_config
from hmoe_jax.model.generate import check_prompt
from hmoe_jax.model.layers import linear, rms_norm
from hmoe_jax.model.mla import mla_attend, mla_attend_expanded, mla_attention, mla_qkv
from hmoe_jax.model.model import forward, forward_nocache, init_cache
from hmoe_jax.model.moe import experts_ref, moe_block, route
from hmoe_jax.model.params import ExpertsParams, MLAParams, MoEParams
from hmoe_jax.model.rope import apply_rope, rope_cos_sin, rope_parameters
from hmoe_jax.quant.fp8 import dequantize_np, quantize_np
from tests.hf_ref import (
    build_hf_model,
    dequantized_state,
    hf_config,
    params_from_state,
    quantized_state,
    tiny_config,
)

RNG = np.random.default_rng(0)
# Jitted once each: op-by-op dispatch would compile every primitive separately.
MLA_JIT = jax.jit(mla_attention, static_argnums=1)
ROUTE_JIT = jax.jit(route, static_argnums=1)
MOE_JIT = jax.jit(moe_block, static_argnums=1)

ROPES = {
    "default": RopeConfig(theta=10000.0),
    "yarn_ds": RopeConfig(theta=10000.0, rope_type="yarn", factor=40.0, original_max_position_embeddings=4096,
                          beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    "yarn_kimi": RopeConfig(theta=50000.0, rope_type="yarn", factor=32.0, original_max_position_embeddings=4096,
                            beta_fast=1.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
    "yarn_af": RopeConfig(theta=10000.0, rope_type="yarn", factor=8.0, original_max_position_embeddings=64,
                          beta_fast=16.0, beta_slow=2.0, mscale=0.8, mscale_all_dim=0.0),
}  # fmt: skip


def test_rms_norm_matches_numpy():
    x = RNG.standard_normal((3, 5, 64)).astype(np.float32) * 3
    w = RNG.standard_normal(64).astype(np.float32)
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(np.asarray(rms_norm(jnp.asarray(x), w, 1e-5)), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rope", sorted(ROPES))
def test_rope_parameters_match_hf(rope):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        apply_rotary_pos_emb_interleave,
    )

    cfg = tiny_config("deepseek_v3_tiny", rope=ROPES[rope], qk_rope_head_dim=32)
    hc = hf_config(cfg)
    if cfg.rope.rope_type == "yarn":
        hf_inv, hf_af = ROPE_INIT_FUNCTIONS["yarn"](hc)
    else:
        hf_inv, hf_af = DeepseekV3RotaryEmbedding.compute_default_rope_parameters(hc)
    inv, af = rope_parameters(cfg)
    # f32 pow may differ from torch's by 1 ulp (see rope.py).
    np.testing.assert_allclose(inv, hf_inv.numpy(), rtol=1.2e-7, atol=0)
    assert af == pytest.approx(hf_af, rel=1e-12)

    # cos/sin (attention factor applied), positions past 4096. An f32 angle pos * inv_freq
    # carries ~pos * 6e-8 rad of rounding in HF and here alike: the tolerance grows with pos.
    pos = np.array([[0, 1, 7, 100, 4095, 9000]])
    hf_cos, hf_sin = DeepseekV3RotaryEmbedding(hc)(torch.zeros(1), torch.as_tensor(pos))
    cos, sin = rope_cos_sin(cfg, jnp.asarray(pos))
    tol = (2e-6 + 1.2e-7 * pos[0])[None, :, None] * max(af, 1.0)
    assert (np.abs(np.asarray(cos) - hf_cos.numpy()[..., :16]) <= tol).all()
    assert (np.abs(np.asarray(sin) - hf_sin.numpy()[..., :16]) <= tol).all()
    # The interleaved rotation itself, on HF's cos/sin (HF's are cat(half, half)).
    q = RNG.standard_normal((1, 3, 6, 32)).astype(np.float32)  # HF layout [B, H, T, dr]
    k = RNG.standard_normal((1, 1, 6, 32)).astype(np.float32)
    hq, hk = apply_rotary_pos_emb_interleave(torch.as_tensor(q), torch.as_tensor(k), hf_cos, hf_sin)
    c16, s16 = jnp.asarray(hf_cos.numpy()[..., :16]), jnp.asarray(hf_sin.numpy()[..., :16])
    ours_q = apply_rope(jnp.asarray(q.transpose(0, 2, 1, 3)), c16, s16)  # ours [B, T, H, dr]
    ours_k = apply_rope(jnp.asarray(k[:, 0]), c16, s16)  # [B, T, dr]
    np.testing.assert_allclose(np.asarray(ours_q), hq.numpy().transpose(0, 2, 1, 3), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(ours_k), hk.numpy()[:, 0], rtol=1e-6, atol=1e-6)


def test_rope_rotation_is_relative():
    """q.k after rope depends on the position difference only (a property, not a copy of HF)."""
    cfg = tiny_config("deepseek_v3_tiny", rope=ROPES["yarn_ds"])
    q = jnp.asarray(RNG.standard_normal((1, 1, 16)).astype(np.float32))
    k = jnp.asarray(RNG.standard_normal((1, 1, 16)).astype(np.float32))

    def dot(pq, pk):
        cq, sq = rope_cos_sin(cfg, jnp.array([[pq]]))
        ck, sk = rope_cos_sin(cfg, jnp.array([[pk]]))
        return float(jnp.sum(apply_rope(q, cq, sq) * apply_rope(k, ck, sk)))

    assert dot(10, 3) == pytest.approx(dot(107, 100), rel=1e-4)
    assert dot(10, 3) != pytest.approx(dot(10, 4), rel=1e-3)


def route_np(logits_w, bias, x, n_group, topk_group, k, norm, scale):
    """Independent re-derivation with argsort (no top_k, no masking by -inf)."""
    scores = 1.0 / (1.0 + np.exp(-(x.astype(np.float64) @ logits_w.T.astype(np.float64))))
    biased = scores + bias
    e = scores.shape[1]
    ids, ws = [], []
    for t in range(x.shape[0]):
        groups = biased[t].reshape(n_group, e // n_group)
        gscore = np.sort(groups, axis=1)[:, -2:].sum(1) if n_group > 1 else np.zeros(1)
        keep = np.argsort(-gscore, kind="stable")[:topk_group]
        allowed = np.concatenate([np.arange(g * (e // n_group), (g + 1) * (e // n_group)) for g in keep])
        chosen = allowed[np.argsort(-biased[t, allowed], kind="stable")[:k]]
        w = scores[t, chosen]
        if norm:
            w = w / (w.sum() + 1e-20)
        ids.append(chosen)
        ws.append(w * scale)
    return np.array(ids), np.array(ws)


def _sorted_by_id(ids, ws):
    order = np.argsort(ids, axis=1)
    return np.take_along_axis(ids, order, 1), np.take_along_axis(ws, order, 1)


ROUTES = {  # (E, n_group, topk_group, k, norm, scale)
    "ds_like": (16, 4, 2, 4, True, 2.5),
    "many_groups": (32, 8, 3, 6, False, 1.7),
    "kimi_like": (24, 1, 1, 4, True, 2.827),
    "one_group_kept": (12, 6, 1, 2, True, 1.0),
}


@pytest.mark.parametrize("case", sorted(ROUTES))
def test_route_matches_numpy_and_hf(case):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    e, g, tg, k, norm, scale = ROUTES[case]
    cfg = tiny_config("deepseek_v3_tiny", n_routed_experts=e, n_group=g, topk_group=tg, num_experts_per_tok=k,
                      norm_topk_prob=norm, routed_scaling_factor=scale)  # fmt: skip
    d = cfg.hidden_size
    x = RNG.standard_normal((64, d)).astype(np.float32)
    w = (RNG.standard_normal((e, d)) / np.sqrt(d)).astype(np.float32)
    bias = (0.1 * RNG.standard_normal(e)).astype(np.float32)
    moe = MoEParams(router=w, router_bias=bias, experts=None, shared=None)
    ids, ws = (np.asarray(a) for a in ROUTE_JIT(moe, cfg, jnp.asarray(x)))
    assert ids.dtype == np.int32 and ids.shape == (64, k) and ws.shape == (64, k)
    ids_s, ws_s = _sorted_by_id(ids, ws)
    ref_ids, ref_ws = _sorted_by_id(*route_np(w, bias, x, g, tg, k, norm, scale))
    np.testing.assert_array_equal(ids_s, ref_ids)
    np.testing.assert_allclose(ws_s, ref_ws, rtol=1e-5)

    router = DeepseekV3TopkRouter(hf_config(cfg))
    with torch.no_grad():
        router.weight.copy_(torch.as_tensor(w))
        router.e_score_correction_bias.copy_(torch.as_tensor(bias))
        _, hf_w, hf_ids = router(torch.as_tensor(x))
    hf_ids_s, hf_ws_s = _sorted_by_id(hf_ids.numpy(), hf_w.numpy())
    np.testing.assert_array_equal(ids_s, hf_ids_s)
    np.testing.assert_allclose(ws_s, hf_ws_s, rtol=1e-5)

    # The bias must matter in these cases (else the test could not catch it being ignored).
    moe0 = dataclasses.replace(moe, router_bias=np.zeros_like(bias))
    ids0 = _sorted_by_id(np.asarray(ROUTE_JIT(moe0, cfg, jnp.asarray(x))[0]), ws)[0]
    assert (ids0 != ids_s).any()


def _experts(e, i, d, rng):
    def m(*s):
        return (rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float32)

    return ExpertsParams(gate=m(e, i, d), up=m(e, i, d), down=m(e, d, i))


def test_experts_ref_matches_loop():
    t, e, i, d, k = 9, 6, 16, 32, 3
    ex = _experts(e, i, d, RNG)
    x = RNG.standard_normal((t, d)).astype(np.float32)
    ids = np.stack([RNG.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    ws = RNG.random((t, k)).astype(np.float32)
    ref = np.zeros((t, d))
    for a in range(t):
        for j in range(k):
            n = ids[a, j]
            hid = ex.gate[n] @ x[a]
            hid = hid / (1 + np.exp(-hid)) * (ex.up[n] @ x[a])
            ref[a] += ws[a, j] * (ex.down[n] @ hid)
    out = jax.jit(experts_ref)(jnp.asarray(x), jnp.asarray(ids), jnp.asarray(ws), ex)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def ds_model():
    cfg = tiny_config("deepseek_v3_tiny", num_hidden_layers=2, first_k_dense_replace=1)
    model, state = build_hf_model(cfg, seed=7)
    return cfg, model, state


def test_moe_block_matches_hf_module(ds_model):
    cfg, model, state = ds_model
    params = params_from_state(cfg, state)
    layer = cfg.first_k_dense_replace  # the first MoE layer
    x = RNG.standard_normal((1, 13, cfg.hidden_size)).astype(np.float32)
    with torch.no_grad():
        ref = model.model.layers[layer].mlp(torch.as_tensor(x)).numpy()[0]
    out = np.asarray(MOE_JIT(params.layers[layer].ffn, cfg, jnp.asarray(x[0])))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("x_scale", [1.0, 1e-3])
def test_mla_with_cache_matches_hf_attention(ds_model, x_scale):
    """One attention module, prefill 6 tokens then decode 1, vs HF's DeepseekV3Attention with
    its DynamicCache: outputs, and our cache == HF's cached (latent, k_rope). x_scale 1e-3
    makes the LoRA norms' eps (1e-6, not rms_norm_eps) visible."""
    from transformers.cache_utils import DynamicCache

    cfg, model, state = ds_model
    cfg = dataclasses.replace(cfg, rms_norm_eps=1e-5)  # only the LoRA norms run here
    params = params_from_state(cfg, state)
    attn = model.model.layers[0].self_attn
    x = (x_scale * RNG.standard_normal((1, 7, cfg.hidden_size))).astype(np.float32)
    xt = torch.as_tensor(x)
    cache = DynamicCache(config=model.config)
    causal = torch.triu(torch.full((6, 6), float("-inf")), 1)[None, None]
    with torch.no_grad():
        pe = model.model.rotary_emb(xt, torch.arange(7)[None])
        pre = (pe[0][:, :6], pe[1][:, :6])
        ref_a = attn(xt[:, :6], position_embeddings=pre, attention_mask=causal, past_key_values=cache)[
            0
        ].numpy()
        dec = (pe[0][:, 6:], pe[1][:, 6:])
        ref_b = attn(
            xt[:, 6:], position_embeddings=dec, attention_mask=torch.zeros(1, 1, 1, 7), past_key_values=cache
        )[0].numpy()
    lat, rop = jnp.zeros((1, 8, cfg.kv_lora_rank)), jnp.zeros((1, 8, cfg.qk_rope_head_dim))
    out_a, lat, rop = MLA_JIT(params.layers[0].attn, cfg, jnp.asarray(x[:, :6]), lat, rop, 0)
    out_b, lat, rop = MLA_JIT(params.layers[0].attn, cfg, jnp.asarray(x[:, 6:]), lat, rop, 6)
    for ours, ref in ((out_a, ref_a), (out_b, ref_b)):
        np.testing.assert_allclose(np.asarray(ours), ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    hf_lat, hf_rop = cache.layers[0].keys.numpy()[:, 0], cache.layers[0].values.numpy()[:, 0]  # [1, 7, .]
    np.testing.assert_allclose(np.asarray(lat)[:, :7], hf_lat, rtol=0, atol=1e-5 * np.abs(hf_lat).max())
    np.testing.assert_allclose(np.asarray(rop)[:, :7], hf_rop, rtol=0, atol=1e-5 * np.abs(hf_rop).max())


@pytest.mark.parametrize("start_pos", [0, 5])
def test_mla_expanded_equals_absorbed(ds_model, start_pos):
    """The two attention forms on the same cache: prefill (start_pos 0) and a chunk after
    5 cached tokens."""
    cfg, _, state = ds_model
    p = params_from_state(cfg, state).layers[0].attn
    x = jnp.asarray(RNG.standard_normal((2, 4, cfg.hidden_size)).astype(np.float32))
    lat = jnp.asarray(RNG.standard_normal((2, 16, cfg.kv_lora_rank)).astype(np.float32))
    rop = jnp.asarray(RNG.standard_normal((2, 16, cfg.qk_rope_head_dim)).astype(np.float32))

    @jax.jit
    def both(p, x, lat, rop):
        q_nope, q_rope, new_lat, new_rop = mla_qkv(p, cfg, x, start_pos)
        lat = jax.lax.dynamic_update_slice(lat, new_lat, (0, start_pos, 0))
        rop = jax.lax.dynamic_update_slice(rop, new_rop, (0, start_pos, 0))
        args = (p, cfg, q_nope, q_rope, lat, rop, start_pos)
        return mla_attend(*args), mla_attend_expanded(*args)

    a, e = (np.asarray(o) for o in both(p, x, lat, rop))
    np.testing.assert_allclose(e, a, rtol=0, atol=1e-5 * np.abs(a).max())


def test_mla_real_deepseek_dims_fp8_matches_hf():
    """DeepSeek-V3's real MLA dims and YaRN (D 7168, q LoRA 1536, kv LoRA 512, nope 128, rope
    64, v 128) with 8 of its 128 heads, FP8 block weights (kv_a [576, 7168]: 4.5 row blocks):
    ours on Fp8Tensor leaves vs HF's module holding the dequantized weights."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    cfg = dataclasses.replace(
        named_model_config("deepseek_v3"), num_attention_heads=8, num_key_value_heads=8, quant=None
    )
    hc = hf_config(cfg)
    attn = DeepseekV3Attention(hc, layer_idx=0).eval()
    g = torch.Generator().manual_seed(11)
    w = {}
    with torch.no_grad():
        for name, t in attn.named_parameters():
            if t.ndim == 1:
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
                w[name] = t.numpy().copy()
            else:
                q = quantize_np((torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5).numpy())
                t.copy_(torch.as_tensor(dequantize_np(q)))
                w[name] = q
    p = MLAParams(kv_a=w["kv_a_proj_with_mqa.weight"], kv_a_norm=w["kv_a_layernorm.weight"], kv_b=w["kv_b_proj.weight"],
                  o=w["o_proj.weight"], q_a=w["q_a_proj.weight"], q_a_norm=w["q_a_layernorm.weight"],
                  q_b=w["q_b_proj.weight"])  # fmt: skip
    t = 12
    x = RNG.standard_normal((1, t, cfg.hidden_size)).astype(np.float32)
    xt = torch.as_tensor(x)
    with torch.no_grad():
        pe = DeepseekV3RotaryEmbedding(hc)(xt, torch.arange(t)[None])
        causal = torch.triu(torch.full((t, t), float("-inf")), 1)[None, None]
        ref = attn(xt, position_embeddings=pe, attention_mask=causal)[0].numpy()
    lat, rop = jnp.zeros((1, 16, cfg.kv_lora_rank)), jnp.zeros((1, 16, cfg.qk_rope_head_dim))
    out = np.asarray(MLA_JIT(p, cfg, jnp.asarray(x), lat, rop, 0)[0])
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_fp8_linear_dequantizes_blocks():
    # [200, 300]: partial edge blocks on both axes, like kv_a_proj_with_mqa [576, 7168].
    w = RNG.standard_normal((200, 300)).astype(np.float32)
    q = quantize_np(w)
    x = RNG.standard_normal((4, 300)).astype(np.float32)
    ref = x @ dequantize_np(q).T
    np.testing.assert_allclose(np.asarray(linear(jnp.asarray(x), q)), ref, rtol=1e-5, atol=1e-5)
    assert np.abs(ref - x @ w.T).max() > 1e-3  # FP8 rounding is visible: q is really used


def test_fp8_params_equal_dequantized_dense(ds_model):
    """Logits with Fp8Tensor leaves == logits with the same weights dequantized to f32."""
    cfg, _, state = ds_model
    qstate = quantized_state(cfg, state)
    p_fp8 = params_from_state(cfg, qstate)
    p_dense = params_from_state(cfg, dequantized_state(qstate))
    ids = jnp.asarray(RNG.integers(0, cfg.vocab_size, (1, 11)), jnp.int32)
    a = np.asarray(forward_nocache(p_fp8, cfg, ids))
    b = np.asarray(forward_nocache(p_dense, cfg, ids))
    f32 = np.asarray(forward_nocache(params_from_state(cfg, state), cfg, ids))
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * np.abs(b).max())
    assert np.abs(a - f32).max() > 1e-4 * np.abs(f32).max()  # and FP8 did change the weights


def test_bad_inputs_name_the_problem(ds_model):
    cfg, _, state = ds_model
    params = params_from_state(cfg, state)
    with pytest.raises(ValueError, match=r"token id 512 out of range \[0, 512\)"):
        forward(params, cfg, np.array([[1, 512]]), init_cache(cfg, 1, 8), 0)
    with pytest.raises(ValueError, match="start_pos 7 \\+ T 2 exceeds the cache length 8"):
        forward(params, cfg, np.array([[1, 2]]), init_cache(cfg, 1, 8), 7)
    with pytest.raises(ValueError, match="tokens batch 1 != cache batch 2"):
        forward(params, cfg, np.array([[1, 2]]), init_cache(cfg, 2, 8), 0)
    with pytest.raises(ValueError, match="exceeds the context max_position_embeddings=4096"):
        check_prompt(cfg, [3] * 4090, 10)
    with pytest.raises(ValueError, match="token id -1 out of range"):
        check_prompt(cfg, [3, -1], 4)
