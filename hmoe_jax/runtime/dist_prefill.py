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
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.generate import CACHE_BUCKET, GenerateResult
from hmoe_jax.model.layers import rms_norm, swiglu
from hmoe_jax.model.model import KVCache, embed, final_logits, forward, init_cache
from hmoe_jax.model.moe import ExpertFn, experts_ref
from hmoe_jax.model.params import LayerParams, ModelParams, MoEParams
from hmoe_jax.runtime.dist import (
    AXIS,
    ZigzagLayout,
    cp_attention_comm,
    ep_comm,
    smallep_comm,
)
from hmoe_jax.runtime.dist_attention import cp_attention_block
from hmoe_jax.runtime.dist_moe import ep_moe, grouped_experts_fn, smallep_moe
from hmoe_jax.runtime.dist_stream import RankStreamer

MOE_SCHEMES = ("smallep", "ep")
DEFAULT_EXPERT_FN = grouped_experts_fn(8)  # grouped GEMMs, 8 local experts dequantized at a time


@dataclasses.dataclass
class DistPrefillResult:
    logits_last: jax.Array  # [B, V] f32: logits of the last real token (decode starts from its argmax)
    cache: KVCache  # [L, B, max_len, ...] on `cache_device`, positions >= T zero
    logits: jax.Array | None  # [B, T, V] f32 when all_logits, else None
    comm: list[dict[str, Any]]  # per layer: CommVolume.as_dict() of attention and MoE
    stream: RankStreamer  # its .log lists every per-rank weight copy
    layout: ZigzagLayout


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
):
    """Post-attention norm + FFN + residual on one rank. h [B, 2C, D] -> h_out [B, 2C, D];
    MoE layers also return (ids [B 2C, k], dropped [])."""
    x = rms_norm(h, layer.ffn_norm, cfg.rms_norm_eps)
    b, t, d = x.shape
    if experts is None:
        return h + swiglu(layer.ffn, x)
    moe = dataclasses.replace(layer.ffn, experts=experts)
    xf = x.reshape(b * t, d)
    if scheme == "smallep":
        out, ids = smallep_moe(moe, cfg, xf, axis=AXIS, n_ranks=n_ranks, expert_fn=expert_fn)
        dropped = jnp.zeros((), jnp.int32)
    else:
        out, ids, dropped = ep_moe(
            moe, cfg, xf, axis=AXIS, n_ranks=n_ranks, capacity=capacity, expert_fn=expert_fn
        )
    return h + out.reshape(b, t, d), ids, dropped


@functools.cache
def attn_fn(mesh: Mesh, cfg: ModelConfig, layout: ZigzagLayout):
    """Jitted CP attention block: (layer without experts, h [B, S_pad, D] zig-zag, sharded)
    -> (h, latent [B, S_pad, R], k_rope [B, S_pad, dr]) (caches replicated, natural order)."""
    seq = P(None, AXIS)
    body = lambda layer, h: cp_attention_block(layer, cfg, h, layout, axis=AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), seq), out_specs=(seq, P(), P())))


@functools.cache
def ffn_fn(mesh: Mesh, cfg: ModelConfig, moe: bool, scheme: str, expert_fn: ExpertFn, capacity: int | None):
    """Jitted FFN block: (layer without experts, experts sharded P(AXIS) or None, h) -> h
    (dense) or (h, ids [B S_pad, k] rank-major, dropped) (MoE)."""
    body = functools.partial(
        _ffn_body, cfg=cfg, n_ranks=mesh.devices.size, scheme=scheme, expert_fn=expert_fn, capacity=capacity
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
def embed_fn(mesh: Mesh):
    def body(table, tok):  # tok [B, 2C] -> h [B, 2C, D]
        return embed(ModelParams(embed=table, layers=(), norm=None, lm_head=None), tok)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, AXIS)), out_specs=P(None, AXIS)))


@functools.cache
def logits_fn(mesh: Mesh, cfg: ModelConfig):
    """Final norm + lm_head on the sequence owners: h [B, 2C, D] -> [B, 2C, V]."""

    def body(norm, lm_head, h):
        return final_logits(ModelParams(embed=None, layers=(), norm=norm, lm_head=lm_head), cfg, h)

    seq = P(None, AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), seq), out_specs=seq))


@functools.cache
def last_logits_fn(cfg: ModelConfig, z_last: int):
    """lm_head on the last real token only (zig-zag index z_last): h [B, S_pad, D] -> [B, V]."""

    def f(norm, lm_head, h):
        p = ModelParams(embed=None, layers=(), norm=norm, lm_head=lm_head)
        return final_logits(p, cfg, h[:, z_last : z_last + 1])[:, 0]

    return jax.jit(f)


def dist_prefill(
    params: ModelParams,
    cfg: ModelConfig,
    tokens: Any,
    mesh: Mesh,
    *,
    moe_scheme: str = "smallep",
    expert_fn: ExpertFn | None = None,
    max_len: int | None = None,
    all_logits: bool = False,
    ep_capacity: int | None = None,
    cache_device: Any = None,
    streamer: RankStreamer | None = None,
) -> DistPrefillResult:
    """Prefill `tokens` [B, T] int from position 0 over the ranks of `mesh` (1-D, axis AXIS).
    params: host (numpy / memmap) or device arrays; each layer is streamed when needed.
    max_len: cache length of the result (default T). cache_device: where the decode cache
    goes (default the mesh's first device). expert_fn: the ranks' routed-expert function
    (default grouped GEMMs, 8 experts dequantized at a time; experts_ref computes every
    local expert on every token)."""
    expert_fn = DEFAULT_EXPERT_FN if expert_fn is None else expert_fn
    if moe_scheme not in MOE_SCHEMES:
        raise ValueError(f"dist_prefill: moe_scheme {moe_scheme!r} is not one of {MOE_SCHEMES}")
    tok = np.asarray(tokens)
    if tok.ndim != 2 or tok.shape[1] < 1:
        raise ValueError(f"dist_prefill: tokens must be [B, T] with T >= 1, got shape {tok.shape}")
    if tok.min() < 0 or tok.max() >= cfg.vocab_size:
        raise ValueError(
            f"dist_prefill: token ids must be in [0, {cfg.vocab_size}), got [{tok.min()}, {tok.max()}]"
        )
    b, t = tok.shape
    max_len = t if max_len is None else int(max_len)
    if max_len < t:
        raise ValueError(f"dist_prefill: max_len={max_len} is shorter than the prompt ({t} tokens)")
    n = mesh.devices.size
    layout = ZigzagLayout.for_sequence(t, n)
    cache_device = mesh.devices.flat[0] if cache_device is None else cache_device
    streamer = RankStreamer(mesh) if streamer is None else streamer
    seq_sharding = NamedSharding(mesh, P(None, AXIS))

    tok_zz = np.pad(tok, ((0, 0), (0, layout.padded_len - t)))[:, layout.order].astype(np.int32)
    h = embed_fn(mesh)(streamer.replicated(-1, params.embed), jax.device_put(tok_zz, seq_sharding))

    def put(i: int):
        rest, experts = split_layer(params.layers[i])
        return streamer.replicated(i, rest), None if experts is None else streamer.experts(i, experts)

    n_layers = cfg.num_hidden_layers
    nxt = put(0)
    lats, rops, comm = [], [], []
    act_bytes = 4  # activations are f32 on this path
    for i in range(n_layers):
        cur = nxt
        if i + 1 < n_layers:
            nxt = put(i + 1)  # issued before layer i computes: the copies overlap it
        is_moe = cur[1] is not None
        h, lat, rop = attn_fn(mesh, cfg, layout)(cur[0], h)
        lats.append(jax.device_put(lat, cache_device))
        rops.append(jax.device_put(rop, cache_device))
        outs = ffn_fn(mesh, cfg, is_moe, moe_scheme, expert_fn, ep_capacity)(cur[0], cur[1], h)
        tokens_all = layout.padded_len * b
        rec = {"layer": i, "attention": cp_attention_comm(n, tokens_all, cfg.cache_dim, act_bytes).as_dict()}
        if is_moe:
            h, ids, dropped = outs
            check_dropped(dropped, i, ep_capacity)
            rec.update(moe_comm_record(cfg, n, tokens_all, moe_scheme, ids, act_bytes))
        else:
            h = outs
        comm.append(rec)

    norm, lm_head = streamer.replicated(n_layers, (params.norm, params.lm_head))
    last_rank, last_local = layout.owner_of_last
    z_last = last_rank * layout.local_len + last_local
    logits = None
    if all_logits:
        lz = logits_fn(mesh, cfg)(norm, lm_head, h)  # [B, S_pad, V] zig-zag order, on the owners
        logits = jax.device_put(lz[:, layout.inverse[:t]], cache_device)
        logits_last = logits[:, -1]
    else:
        logits_last = jax.device_put(last_logits_fn(cfg, z_last)(norm, lm_head, h), cache_device)
    cache = _assemble_cache(cfg, lats, rops, b, t, max_len, cache_device)
    return DistPrefillResult(logits_last, cache, logits, comm, streamer, layout)


def _assemble_cache(cfg, lats, rops, b, t, max_len, device) -> KVCache:
    """Per-layer natural-order caches [B, S_pad, .] -> KVCache [L, B, max_len, .] with the
    first T positions filled (pad slots stay zero, as in a fresh single-device cache)."""
    with jax.default_device(device):
        return _cache_builder(cfg, b, t, max_len)(lats, rops)


@functools.cache
def _cache_builder(cfg: ModelConfig, b: int, t: int, max_len: int):
    @jax.jit
    def build(lats, rops):
        c = init_cache(cfg, b, max_len)
        lat = jnp.stack([x[:, :t] for x in lats])  # [L, B, T, R]
        rop = jnp.stack([x[:, :t] for x in rops])  # [L, B, T, dr]
        return KVCache(latent=c.latent.at[:, :, :t].set(lat), k_rope=c.k_rope.at[:, :, :t].set(rop))

    return build


def dist_generate(
    params: ModelParams,
    cfg: ModelConfig,
    prompt_ids: Any,
    max_new_tokens: int,
    mesh: Mesh,
    *,
    moe_scheme: str = "smallep",
    expert_fn: ExpertFn | None = None,
    decode_expert_fn: ExpertFn | None = None,
    stop_ids: Any = None,
) -> tuple[GenerateResult, DistPrefillResult]:
    """Greedy batch-1 generation: distributed prefill over `mesh`, then single-device decode
    (model.forward, T = 1) on the cache the prefill left on the mesh's first device.
    Same stopping rule as model.generate."""
    if max_new_tokens < 1:
        raise ValueError(f"dist_generate: max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = np.asarray(prompt_ids, np.int32).reshape(1, -1)
    t = ids.shape[1]
    stops = set(cfg.eos_ids if stop_ids is None else stop_ids)
    max_len = -(-(t + max_new_tokens) // CACHE_BUCKET) * CACHE_BUCKET
    t0 = time.perf_counter()
    pre = dist_prefill(params, cfg, ids, mesh, moe_scheme=moe_scheme, expert_fn=expert_fn, max_len=max_len)
    tok = int(jnp.argmax(pre.logits_last[0]))
    ttft_s = time.perf_counter() - t0
    dev = mesh.devices.flat[0]
    dparams = jax.device_put(params, dev)
    cache, tokens, decode_s = pre.cache, [tok], []
    efn = experts_ref if decode_expert_fn is None else decode_expert_fn  # as model.generate
    while len(tokens) < max_new_tokens and tok not in stops:
        t0 = time.perf_counter()
        with jax.default_device(dev):
            logits, cache = forward(
                dparams, cfg, np.array([[tok]], np.int32), cache, t + len(tokens) - 1, efn
            )
        tok = int(jnp.argmax(logits[0, -1]).block_until_ready())
        decode_s.append(time.perf_counter() - t0)
        tokens.append(tok)
    return GenerateResult(tokens=tokens, ttft_s=ttft_s, decode_s=decode_s), pre
