"""MoE over N expert owners: SmallEP (the paper's) and standard expert parallelism.

Both are per-rank bodies meant to run inside `jax.shard_map` over the mesh axis `axis`,
with the routed experts sharded on their leading axis (rank r holds experts
[r E/N, (r+1) E/N)) and the router and shared expert replicated. Tokens arrive as the
rank's sequence shard x_local [T_l, D] (already post-attention-normed) and leave as the
rank's MoE output (routed + shared) [T_l, D]; the residual is the caller's.

Any `ExpertFn` can compute the local experts. Both schemes hand it pairs that belong to no
local expert with weight 0 (and a valid local id), so the ExpertFn must implement the
contract's sum_j weights[t, j] * f_{ids[t, j]}(x_t) literally: a zero-weight pair adds
nothing even when its id repeats a real one (experts_ref does).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.layers import dense_weight, swiglu
from hmoe_jax.model.moe import ExpertFn, experts_ref, route
from hmoe_jax.model.params import MoEParams


def _local_experts(cfg: ModelConfig, n_ranks: int) -> int:
    if cfg.n_routed_experts % n_ranks:
        raise ValueError(
            f"expert parallelism: n_routed_experts={cfg.n_routed_experts} is not divisible by "
            f"the number of ranks {n_ranks}"
        )
    return cfg.n_routed_experts // n_ranks


def _shared(moe: MoEParams, x: jax.Array) -> jax.Array:
    return jnp.zeros_like(x) if moe.shared is None else swiglu(moe.shared, x)


def smallep_moe(
    moe: MoEParams,
    cfg: ModelConfig,
    x_local: jax.Array,
    *,
    axis: str,
    n_ranks: int,
    expert_fn: ExpertFn = experts_ref,
) -> tuple[jax.Array, jax.Array]:
    """SmallEP: all-gather the unsorted hidden states, repeat gating for all tokens, compute
    the local experts, one weighted partial per token, reduce-scatter the partials back to
    the sequence owners. The shared expert runs on the owners.
    x_local [T_l, D] -> (out [T_l, D], ids of the local tokens [T_l, k] for accounting)"""
    el = _local_experts(cfg, n_ranks)
    x_all = lax.all_gather(x_local, axis, tiled=True)  # [T, D], the ranks' shards in rank order
    ids, w = route(moe, cfg, x_all)  # [T, k]: every rank routes every token (cheap, duplicated)
    local = ids - lax.axis_index(axis) * el
    mine = (local >= 0) & (local < el)
    partial = expert_fn(x_all, jnp.where(mine, local, 0), jnp.where(mine, w, 0.0), moe.experts)  # [T, D]
    routed = lax.psum_scatter(partial, axis, scatter_dimension=0, tiled=True)  # [T_l, D]
    own_ids = lax.dynamic_slice_in_dim(ids, lax.axis_index(axis) * x_local.shape[0], x_local.shape[0])
    return routed + _shared(moe, x_local), own_ids


def ep_moe(
    moe: MoEParams,
    cfg: ModelConfig,
    x_local: jax.Array,
    *,
    axis: str,
    n_ranks: int,
    capacity: int | None = None,
    expert_fn: ExpertFn = experts_ref,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Standard EP: route on the owner, dispatch each (token, expert) pair to the expert's
    owner with all_to_all (pairs sorted by destination into fixed [N, capacity] buffers),
    compute, all_to_all the results back, weighted sum on the owner.

    capacity: pair slots per (source, destination); None gives T_l k, which no routing can
    overflow (exactness over buffer size). Returns (out [T_l, D], ids [T_l, k], pairs dropped on all
    ranks [] int32): the caller must treat dropped > 0 as an error."""
    el = _local_experts(cfg, n_ranks)
    t_l, d = x_local.shape
    ids, w = route(moe, cfg, x_local)  # [T_l, k]
    k = ids.shape[1]
    cap = t_l * k if capacity is None else capacity
    n_pairs = t_l * k
    dest = (ids // el).reshape(n_pairs)  # [P] destination rank of each pair
    onehot = (dest[:, None] == jnp.arange(n_ranks)[None, :]).astype(jnp.int32)  # [P, N]
    pos = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, dest[:, None], axis=1)[:, 0]  # [P]
    kept = pos < cap
    dropped = lax.psum(jnp.sum(~kept).astype(jnp.int32), axis)  # over all ranks
    slot = jnp.where(kept, dest * cap + pos, n_ranks * cap)  # out of range: dropped by the scatter
    tok = jnp.arange(n_pairs) // k
    send_x = jnp.zeros((n_ranks * cap, d), x_local.dtype).at[slot].set(x_local[tok], mode="drop")
    send_e = jnp.full((n_ranks * cap,), -1, jnp.int32).at[slot].set((ids % el).reshape(n_pairs), mode="drop")
    # recv[s] = the slots rank s filled for this rank.
    recv_x = lax.all_to_all(send_x.reshape(n_ranks, cap, d), axis, 0, 0)  # [N, cap, D]
    recv_e = lax.all_to_all(send_e.reshape(n_ranks, cap), axis, 0, 0).reshape(n_ranks * cap)
    valid = recv_e >= 0
    y = expert_fn(
        recv_x.reshape(n_ranks * cap, d),
        jnp.where(valid, recv_e, 0)[:, None],
        valid.astype(jnp.float32)[:, None],
        moe.experts,
    )  # [N cap, D], unweighted: the owner applies the routing weights
    back = lax.all_to_all(y.reshape(n_ranks, cap, d), axis, 0, 0).reshape(n_ranks * cap, d)
    y_pairs = jnp.where(kept[:, None], back[jnp.minimum(slot, n_ranks * cap - 1)], 0.0)  # [P, D]
    routed = jnp.einsum("tk,tkd->td", w, y_pairs.reshape(t_l, k, d))
    return routed + _shared(moe, x_local), ids, dropped


def experts_grouped(x: jax.Array, ids: jax.Array, weights: jax.Array, experts) -> jax.Array:
    """ExpertFn with grouped GEMMs: the (token, expert) pairs sorted by expert and run through
    jax.lax.ragged_dot, so each pair costs one expert's FLOPs (experts_ref: every expert on
    every token). Pairs of weight 0 - other ranks' experts under SmallEP, empty EP buffer
    slots - are sorted past the last group and never computed. Same sum as experts_ref,
    another association. x [T, D], ids/weights [T, k] -> [T, D] f32."""
    gate, up, down = dense_weight(experts.gate), dense_weight(experts.up), dense_weight(experts.down)
    e = gate.shape[0]
    t, k = ids.shape
    w = weights.reshape(t * k).astype(jnp.float32)
    key = jnp.where(w != 0, ids.reshape(t * k), e)  # [P]; e = "not computed here"
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=e + 1)[:e].astype(jnp.int32)  # [E] rows per expert
    tok = order // k
    xs = x.astype(jnp.float32)[tok]  # [P, D] sorted by expert
    hid = jax.nn.silu(lax.ragged_dot(xs, jnp.swapaxes(gate, 1, 2), sizes)) * lax.ragged_dot(
        xs, jnp.swapaxes(up, 1, 2), sizes
    )  # [P, I]
    y = lax.ragged_dot(hid, jnp.swapaxes(down, 1, 2), sizes)  # [P, D]
    w_sorted = jnp.where(
        key[order] < e, w[order], 0.0
    )  # rows past the groups: zero, whatever the kernel left
    return jnp.zeros((t, x.shape[1]), jnp.float32).at[tok].add(y * w_sorted[:, None])


@functools.cache
def grouped_experts_fn(experts_per_chunk: int = 8) -> ExpertFn:
    """experts_grouped over the local experts `experts_per_chunk` at a time (lax.scan), so
    only one chunk's FP8 weights are dequantized at any time: a rank's share of a
    DeepSeek-V3 layer (128 experts at N = 2) would be 22 GB in f32 at once, 1.4 GB per chunk
    of 8. Cached: the same function object per chunk size (a static jit argument)."""
    if experts_per_chunk < 1:
        raise ValueError(f"grouped_experts_fn: experts_per_chunk={experts_per_chunk} must be >= 1")

    def fn(x: jax.Array, ids: jax.Array, weights: jax.Array, experts) -> jax.Array:
        e = jax.tree_util.tree_leaves(experts)[0].shape[0]
        g = math.gcd(e, experts_per_chunk)  # chunks must tile the local experts
        chunks = jax.tree_util.tree_map(lambda a: a.reshape(e // g, g, *a.shape[1:]), experts)

        def chunk_out(c, chunk):
            local = ids - c * g
            mine = (local >= 0) & (local < g)
            return experts_grouped(x, jnp.where(mine, local, 0), jnp.where(mine, weights, 0.0), chunk)

        # The first chunk outside the scan: its result has the carry's exact type (under
        # shard_map that includes whether it varies across ranks).
        first = chunk_out(0, jax.tree_util.tree_map(lambda a: a[0], chunks))
        if e // g == 1:
            return first
        rest = jax.tree_util.tree_map(lambda a: a[1:], chunks)
        body = lambda acc, xs: (acc + chunk_out(*xs), None)
        return lax.scan(body, first, (jnp.arange(1, e // g), rest))[0]

    fn.__name__ = f"experts_grouped_x{experts_per_chunk}"
    return fn
