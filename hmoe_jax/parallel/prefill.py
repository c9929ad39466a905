"""Distributed prefill (DSLP): a prompt over N accelerators, layer by layer.

Per layer: attention by context parallelism over the zig-zag split (dist_attention), the
FFN on the sequence owners (dense layers) or MoE by SmallEP or standard EP (dist_moe),
the weights of the layer streamed just before it (dist_stream: each rank receives only its
experts; non-expert weights are replicated), the next layer's copies issued before the
current layer computes. Output: the last token's logits and the latent cache in the layout
single-device decode expects (model.KVCache on one device), so `model.forward` decode steps
continue from it.

Padding: a prompt of T tokens is padded at the end to a multiple of 2N (token id 0). Pad
tokens sit after every real token, so the causal mask keeps them out of every real token's
attention; their own outputs are dropped and their cache slots are zero in the result
(as in a fresh single-device cache). They do take part in the MoE (as extra rows), which
changes no real token's result.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.layers import linear, policy_linear, rms_norm, swiglu
from hmoe_jax.model.moe import ExpertFn
from hmoe_jax.model.params import LayerParams, MoEParams
from hmoe_jax.model.precision import F32, Precision
from hmoe_jax.parallel.attention import cp_attention_block
from hmoe_jax.parallel.mesh import AXIS
from hmoe_jax.parallel.moe import ep_moe, experts_from_bytes, grouped_experts_fn, map_rows, smallep_moe
from hmoe_jax.plan.costs import CP_BLOCK
from hmoe_jax.plan.dist import (
    ZigzagLayout,
    ep_comm,
    smallep_comm,
)

MOE_SCHEMES = ("smallep", "ep")
# grouped GEMMs: 2 local experts dequantized at a time, in blocks of 8192 (token, expert) pairs
DEFAULT_EXPERT_FN = grouped_experts_fn(2)
DENSE_FFN_BLOCK = 2048  # tokens per block of the dense layers' FFN on a rank


def grouped_expert_fn(prec: Precision) -> ExpertFn:
    """The default ExpertFn under a policy: with a grouped FP8 GEMM hook (a GPU under the
    bf16 policy) all local experts in one grouped call per pair block (the hook reads the
    FP8 stack, nothing is dequantized); otherwise 2 experts dequantized at a time."""
    if prec.fp8_grouped_matmul is not None and not prec.exact:
        return grouped_experts_fn(None, 8192, prec)
    return grouped_experts_fn(2, 8192, prec)


def split_layer(layer: LayerParams) -> tuple[LayerParams, Any]:
    """(layer without routed experts, the routed experts or None)."""
    if isinstance(layer.ffn, MoEParams):
        return dataclasses.replace(layer, ffn=dataclasses.replace(layer.ffn, experts=None)), layer.ffn.experts
    return layer, None


def _ffn_body(
    layer: LayerParams,
    experts: Any,
    h: jax.Array,
    *,
    cfg: ModelConfig,
    n_ranks: int,
    scheme: str,
    expert_fn: ExpertFn,
    capacity: int | None,
    prec: Precision = F32,
):
    """Post-attention norm + FFN + residual on one rank. h [B, 2C, D] -> h_out [B, 2C, D]
    (activation dtype); MoE layers also return (ids [B 2C, k], dropped [])."""
    act = prec.act_dtype
    h = h.astype(act)
    x = rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps).astype(act)
    b, t, d = x.shape
    if experts is None:  # row-wise: in token blocks, so [rows, intermediate] exists per block only
        out = map_rows(
            lambda xb: swiglu(layer.ffn, xb, prec).astype(act), x.reshape(b * t, d), DENSE_FFN_BLOCK
        )
        return h + out.reshape(b, t, d)
    if not getattr(expert_fn, "takes_fp8_bytes", False):
        experts = experts_from_bytes(experts)  # FP8 leaves passed as uint8 (expert_bytes_view)
    moe = dataclasses.replace(layer.ffn, experts=experts)
    xf = x.reshape(b * t, d)
    if scheme == "smallep":
        out, ids = smallep_moe(moe, cfg, xf, axis=AXIS, n_ranks=n_ranks, expert_fn=expert_fn, prec=prec)
        dropped = jnp.zeros((), jnp.int32)
    else:
        out, ids, dropped = ep_moe(
            moe, cfg, xf, axis=AXIS, n_ranks=n_ranks, capacity=capacity, expert_fn=expert_fn, prec=prec
        )
    return h + out.reshape(b, t, d), ids, dropped


@functools.cache
def attn_fn(
    mesh: Mesh,
    cfg: ModelConfig,
    layout: ZigzagLayout,
    prec: Precision = F32,
    block: int = CP_BLOCK,
    head_groups: int = 1,
):
    """Jitted CP attention block: (layer without experts, h [B, S_pad, D] zig-zag, sharded)
    -> (h, latent [B, S_pad, R], k_rope [B, S_pad, dr]) (caches replicated, natural order).
    block, head_groups: cp_attention_block's (the plan's dslp_attn args)."""
    seq = P(None, AXIS)
    body = lambda layer, h: cp_attention_block(
        layer, cfg, h, layout, axis=AXIS, prec=prec, block=block, head_groups=head_groups
    )
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), seq), out_specs=(seq, P(), P())))


@functools.cache
def ffn_fn(
    mesh: Mesh,
    cfg: ModelConfig,
    moe: bool,
    scheme: str,
    expert_fn: ExpertFn,
    capacity: int | None,
    prec: Precision = F32,
):
    """Jitted FFN block: (layer without experts, experts sharded P(AXIS) or None, h) -> h
    (dense) or (h, ids [B S_pad, k] rank-major, dropped) (MoE)."""
    body = functools.partial(
        _ffn_body,
        cfg=cfg,
        n_ranks=mesh.size,
        scheme=scheme,
        expert_fn=expert_fn,
        capacity=capacity,
        prec=prec,
    )
    seq = P(None, AXIS)
    out_specs = (seq, P(AXIS), P()) if moe else seq
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), P(AXIS) if moe else P(), seq), out_specs=out_specs)
    )


def moe_comm_record(cfg: ModelConfig, n: int, tokens: int, scheme: str, ids: Any, act_bytes: int = 4) -> dict:
    """This layer's MoE traffic under the scheme that ran and under the other one (from the
    actual routing `ids` for EP)."""
    sm = smallep_comm(n, tokens, cfg.hidden_size, act_bytes)
    ep = ep_comm(np.asarray(ids), n, cfg.n_routed_experts, cfg.hidden_size, act_bytes)
    return {
        "moe": (sm if scheme == "smallep" else ep).as_dict(),
        "moe_alternative": (ep if scheme == "smallep" else sm).as_dict(),
    }


def check_dropped(dropped: Any, layer: int, capacity: int | None) -> None:
    if int(dropped):
        raise RuntimeError(
            f"dist_prefill: standard EP dropped {int(dropped)} (token, expert) pairs in layer {layer} "
            f"(ep_capacity={capacity}); raise the capacity or leave it None"
        )


@functools.cache
def embed_fn(mesh: Mesh, prec: Precision = F32):
    def body(table, tok):  # tok [B, 2C] -> h [B, 2C, D] (activation dtype)
        return jnp.take(jnp.asarray(table), tok, axis=0).astype(prec.act_dtype)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, AXIS)), out_specs=P(None, AXIS)))


def _logits(norm, lm_head, h, cfg: ModelConfig, prec: Precision) -> jax.Array:
    """Final norm + lm_head -> f32 logits: f32 under F32, else the policy's matmul (bf16
    lm_head, f32 accumulation; no f32 copy of the head)."""
    x = rms_norm(h, norm, cfg.rms_norm_eps)
    if prec.exact:
        return linear(x, lm_head)
    return policy_linear(x.astype(prec.act_dtype), lm_head, prec)


@functools.cache
def logits_fn(mesh: Mesh, cfg: ModelConfig, prec: Precision = F32):
    """Final norm + lm_head on the sequence owners: h [B, 2C, D] -> [B, 2C, V] f32."""

    def body(norm, lm_head, h):
        return _logits(norm, lm_head, h, cfg, prec)

    seq = P(None, AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), seq), out_specs=seq))


@functools.cache
def last_logits_fn(cfg: ModelConfig, z_last: int, prec: Precision = F32):
    """lm_head on the last real token only (zig-zag index z_last): h [B, S_pad, D] -> [B, V] f32."""

    def f(norm, lm_head, h):
        return _logits(norm, lm_head, h[:, z_last : z_last + 1], cfg, prec)[:, 0]

    return jax.jit(f)
