"""DeepSeek-V3 MoE: sigmoid routing with group-limited top-k, routed + shared experts.

Routing (HF DeepseekV3TopkRouter, DeepSeek `Gate` with noaux_tc): scores = sigmoid(x W^T)
in f32; the score-correction bias is added for SELECTION only; each group is scored by the
sum of its top-2 biased scores; the best topk_group groups stay, the others are masked to
-inf; the top-k experts of what remains are chosen; their weights are the UNBIASED scores,
normalised by (sum + 1e-20) when norm_topk_prob, times routed_scaling_factor. Kimi-K2
(n_group = 1) runs through the same code: the one group always stays.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.layers import dense_weight, swiglu
from hmoe_jax.model.params import ExpertsParams, MoEParams

# x [T, D] f32, ids [T, k] int32, weights [T, k] f32, experts -> [T, D] f32: the routed part.
ExpertFn = Callable[[jax.Array, jax.Array, jax.Array, ExpertsParams], jax.Array]


def route(moe: MoEParams, cfg: ModelConfig, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [T, D] -> (ids [T, k] int32, weights [T, k] f32). Order within a row is top-k order."""
    e, g = cfg.n_routed_experts, cfg.n_group
    logits = x.astype(jnp.float32) @ jnp.asarray(moe.router, jnp.float32).T  # [T, E]
    scores = jax.nn.sigmoid(logits)
    biased = scores + jnp.asarray(moe.router_bias, jnp.float32)
    if g > 1:
        grouped = biased.reshape(-1, g, e // g)  # [T, G, E/G]
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, G]
        _, group_idx = jax.lax.top_k(group_scores, cfg.topk_group)  # [T, topk_group]
        keep = (
            jnp.zeros(group_scores.shape, bool)
            .at[jnp.arange(group_scores.shape[0])[:, None], group_idx]
            .set(True)
        )
        biased = jnp.where(jnp.repeat(keep, e // g, axis=-1), biased, -jnp.inf)
    _, ids = jax.lax.top_k(biased, cfg.num_experts_per_tok)  # [T, k]
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * cfg.routed_scaling_factor


def combine_matrix(ids: jax.Array, weights: jax.Array, n_experts: int) -> jax.Array:
    """ids/weights [T, k] -> C [T, E] with C[t, ids[t, j]] = weights[t, j]."""
    t = ids.shape[0]
    return jnp.zeros((t, n_experts), jnp.float32).at[jnp.arange(t)[:, None], ids].add(weights)


def experts_ref(x: jax.Array, ids: jax.Array, weights: jax.Array, experts: ExpertsParams) -> jax.Array:
    """Reference ExpertFn: every expert on every token (dense), combined with a [T, E]
    weight matrix. Exact but E/k times the work; for tiny models and tests."""
    gate, up, down = dense_weight(experts.gate), dense_weight(experts.up), dense_weight(experts.down)
    x = x.astype(jnp.float32)  # [T, D]
    hid = jax.nn.silu(jnp.einsum("td,eid->tei", x, gate)) * jnp.einsum("td,eid->tei", x, up)  # [T, E, I]
    y = jnp.einsum("tei,edi->ted", hid, down)  # [T, E, D]
    return jnp.einsum("te,ted->td", combine_matrix(ids, weights, gate.shape[0]), y)


def moe_block(moe: MoEParams, cfg: ModelConfig, x: jax.Array, expert_fn: ExpertFn = experts_ref) -> jax.Array:
    """x [T, D] (post-attention-normed) -> routed + shared experts [T, D] f32."""
    x = x.astype(jnp.float32)
    ids, weights = route(moe, cfg, x)
    out = expert_fn(x, ids, weights, moe.experts)
    if moe.shared is not None:
        out = out + swiglu(moe.shared, x)
    return out
