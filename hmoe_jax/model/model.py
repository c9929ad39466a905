"""The DeepSeek-V3 decoder in functional JAX: embed -> layers (MLA + dense FFN or MoE) ->
final norm -> lm_head, over the compressed latent KV cache.

`forward` serves prefill (T > 1, start_pos 0), chunked prefill (T > 1, start_pos > 0) and
decode (T == 1). It is jitted with `cfg` and `expert_fn` static and the cache donated, so
a decode step updates the cache in place. Layers are unrolled in Python: dense and MoE
layers have different pytree structures, and the engine drives layers one by one anyway.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.layers import linear, rms_norm, swiglu
from hmoe_jax.model.mla import mla_attend, mla_attention, mla_qkv
from hmoe_jax.model.moe import ExpertFn, experts_ref, moe_block
from hmoe_jax.model.params import LayerParams, ModelParams, MoEParams


@struct.dataclass
class KVCache:
    """Compressed MLA cache: cfg.cache_dim = kv_lora_rank + qk_rope_head_dim values per token per layer."""

    latent: jax.Array  # [L, B, S_max, kv_lora_rank]  kv_a_layernorm(kv_a x)[:kv_lora_rank]
    k_rope: jax.Array  # [L, B, S_max, qk_rope_head_dim]  roped shared key

    @property
    def max_len(self) -> int:
        return int(self.latent.shape[2])

    @property
    def batch(self) -> int:
        return int(self.latent.shape[1])


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    n = cfg.num_hidden_layers
    return KVCache(
        latent=jnp.zeros((n, batch, max_len, cfg.kv_lora_rank), dtype),
        k_rope=jnp.zeros((n, batch, max_len, cfg.qk_rope_head_dim), dtype),
    )


def embed(params: ModelParams, tokens: jax.Array) -> jax.Array:
    """tokens [B, T] int32 -> h [B, T, D] f32."""
    return jnp.take(jnp.asarray(params.embed), tokens, axis=0).astype(jnp.float32)


def attention_block(
    layer: LayerParams,
    cfg: ModelConfig,
    h: jax.Array,
    cache_latent_l: jax.Array,
    cache_rope_l: jax.Array,
    start_pos: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """h [B, T, D] -> (h + MLA(input_norm(h)) [B, T, D], latent_l [B, S, R], rope_l [B, S, dr])."""
    x = rms_norm(h, layer.attn_norm, cfg.rms_norm_eps)
    out, latent_l, rope_l = mla_attention(layer.attn, cfg, x, cache_latent_l, cache_rope_l, start_pos)
    return h + out, latent_l, rope_l


def ffn_block(
    layer: LayerParams, cfg: ModelConfig, h: jax.Array, expert_fn: ExpertFn = experts_ref
) -> jax.Array:
    """h [B, T, D] -> h + FFN(post_attention_norm(h)) [B, T, D]; FFN is dense or MoE."""
    x = rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps)
    if isinstance(layer.ffn, MoEParams):
        b, t, d = x.shape
        out = moe_block(layer.ffn, cfg, x.reshape(b * t, d), expert_fn).reshape(b, t, d)
    else:
        out = swiglu(layer.ffn, x)
    return h + out


def final_logits(params: ModelParams, cfg: ModelConfig, h: jax.Array) -> jax.Array:
    """h [B, T, D] -> logits [B, T, V] f32."""
    return linear(rms_norm(h, params.norm, cfg.rms_norm_eps), params.lm_head)


def _forward(
    params: ModelParams,
    cfg: ModelConfig,
    tokens: jax.Array,
    cache: KVCache,
    start_pos: jax.Array,
    expert_fn: ExpertFn,
) -> tuple[jax.Array, KVCache]:
    h = embed(params, tokens)
    latent, k_rope = cache.latent, cache.k_rope
    for i, layer in enumerate(params.layers):
        # attention_block's math, but the new entries go straight into the stacked cache:
        # slicing layer i out and setting it back made XLA copy the whole cache per layer.
        x = rms_norm(h, layer.attn_norm, cfg.rms_norm_eps)
        q_nope, q_rope, lat_new, rope_new = mla_qkv(layer.attn, cfg, x, start_pos)
        latent = jax.lax.dynamic_update_slice(
            latent, lat_new[None].astype(latent.dtype), (i, 0, start_pos, 0)
        )
        k_rope = jax.lax.dynamic_update_slice(
            k_rope, rope_new[None].astype(k_rope.dtype), (i, 0, start_pos, 0)
        )
        h = h + mla_attend(layer.attn, cfg, q_nope, q_rope, latent[i], k_rope[i], start_pos)
        h = ffn_block(layer, cfg, h, expert_fn)
    return final_logits(params, cfg, h), KVCache(latent=latent, k_rope=k_rope)


forward_jit = jax.jit(_forward, static_argnames=("cfg", "expert_fn"), donate_argnames=("cache",))


def _host_value(x: object) -> np.ndarray | None:
    """The value of a host input (Python/numpy); None for jax arrays, whose values are not
    read back (that would synchronise every decode step)."""
    if isinstance(x, jax.Array | jax.core.Tracer):
        return None
    return np.asarray(x)


def check_forward_args(cfg: ModelConfig, tokens: object, cache: KVCache, start_pos: object) -> None:
    """One-line errors for inputs that jit would otherwise clamp silently (ids out of range,
    a cache too short). Shapes are always checked; values only when they are host data."""
    shape = np.shape(tokens)
    if len(shape) != 2:
        raise ValueError(f"forward: tokens must be [B, T], got shape {shape}")
    if cache.latent.shape[0] != cfg.num_hidden_layers or cache.latent.shape[-1] != cfg.kv_lora_rank:
        raise ValueError(
            f"forward: cache.latent {tuple(cache.latent.shape)} does not fit the config "
            f"(expected [{cfg.num_hidden_layers}, B, S_max, {cfg.kv_lora_rank}])"
        )
    if cache.batch != shape[0]:
        raise ValueError(f"forward: tokens batch {shape[0]} != cache batch {cache.batch}")
    tok = _host_value(tokens)
    if tok is not None and tok.size and (tok.min() < 0 or tok.max() >= cfg.vocab_size):
        bad = int(tok.max() if tok.max() >= cfg.vocab_size else tok.min())
        raise ValueError(f"forward: token id {bad} out of range [0, {cfg.vocab_size})")
    sp = _host_value(start_pos)
    if sp is not None and not 0 <= int(sp) <= cache.max_len - shape[1]:
        raise ValueError(
            f"forward: start_pos {int(sp)} + T {shape[1]} exceeds the cache length {cache.max_len}"
        )


def forward(
    params: ModelParams,
    cfg: ModelConfig,
    tokens: jax.Array,
    cache: KVCache,
    start_pos: int | jax.Array,
    expert_fn: ExpertFn = experts_ref,
) -> tuple[jax.Array, KVCache]:
    """tokens [B, T] int32 at positions start_pos.. -> (logits [B, T, V] f32, updated cache).
    The cache argument is donated (do not reuse it after the call)."""
    check_forward_args(cfg, tokens, cache, start_pos)
    return forward_jit(
        params, cfg, jnp.asarray(tokens, jnp.int32), cache, jnp.asarray(start_pos, jnp.int32), expert_fn
    )


@functools.partial(jax.jit, static_argnames=("cfg", "expert_fn"))
def forward_nocache(
    params: ModelParams, cfg: ModelConfig, tokens: jax.Array, expert_fn: ExpertFn = experts_ref
) -> jax.Array:
    """Teacher-forced logits [B, T, V] of a whole sequence (a fresh cache of length T)."""
    b, t = tokens.shape
    cache = init_cache(cfg, b, t)
    return _forward(params, cfg, tokens, cache, jnp.int32(0), expert_fn)[0]
