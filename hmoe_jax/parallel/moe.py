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

Precision (model/precision.py): hidden states cross the links in the activation dtype (bf16
under the bf16 policy; ids int32), so do SmallEP's partials and EP's returned rows; the
router runs in f32; the grouped ExpertFn consumes FP8 experts through the policy's grouped
FP8 GEMM hook where it has one. The F32 policy is the exact path (f32 payloads).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.layers import dense_weight, swiglu
from hmoe_jax.model.moe import ExpertFn, experts_ref, route
from hmoe_jax.model.params import MoEParams
from hmoe_jax.model.precision import F32, Precision
from hmoe_jax.quant.fp8 import FP8_DTYPE, Fp8Tensor


def _local_experts(cfg: ModelConfig, n_ranks: int) -> int:
    if cfg.n_routed_experts % n_ranks:
        raise ValueError(
            f"expert parallelism: n_routed_experts={cfg.n_routed_experts} is not divisible by "
            f"the number of ranks {n_ranks}"
        )
    return cfg.n_routed_experts // n_ranks


def _shared(moe: MoEParams, x: jax.Array, prec: Precision = F32) -> jax.Array:
    """The shared expert(s) on the owner's rows, f32."""
    if moe.shared is None:
        return jnp.zeros(x.shape, jnp.float32)
    return swiglu(moe.shared, x, prec).astype(jnp.float32)


# SmallEP works on blocks of this many local tokens per rank (N times as many gathered):
# the gathered rows, routing, the ExpertFn's pairs and the partials exist for one block.
SMALLEP_LOCAL_BLOCK = 1024


def map_rows(f, x: jax.Array, block: int, *extra: jax.Array):
    """f applied to blocks of `block` rows of x [T, ...] (and of each extra [T, ...]) with
    lax.map, the last block zero-padded; -> f's outputs [T, ...] (leading axis concatenated).
    One call when T <= block. For row-wise f the result equals f(x, *extra)."""
    t = x.shape[0]
    if t <= block:
        return f(x, *extra)
    nb = -(-t // block)
    pad = lambda a: jnp.pad(a, ((0, nb * block - t),) + ((0, 0),) * (a.ndim - 1)).reshape(
        nb, block, *a.shape[1:]
    )
    out = lax.map(lambda args: f(*args), tuple(pad(a) for a in (x, *extra)))
    return jax.tree_util.tree_map(lambda o: o.reshape(nb * block, *o.shape[2:])[:t], out)


def smallep_moe(
    moe: MoEParams,
    cfg: ModelConfig,
    x_local: jax.Array,
    *,
    axis: str,
    n_ranks: int,
    expert_fn: ExpertFn = experts_ref,
    local_block: int = SMALLEP_LOCAL_BLOCK,
    prec: Precision = F32,
) -> tuple[jax.Array, jax.Array]:
    """SmallEP: all-gather the unsorted hidden states, repeat gating for all tokens, compute
    the local experts, one weighted partial per token, reduce-scatter the partials back to
    the sequence owners. The shared expert runs on the owners.
    x_local [T_l, D] -> (out [T_l, D], ids of the local tokens [T_l, k] for accounting)

    Memory-bounded: in blocks of `local_block` local rows (lax.map): each rank contributes
    rows [j b, (j+1) b) of its shard to gathered block j ([N b, D], ranks' rows in rank
    order), every rank routes the block and computes its experts' partials [N b, D], and
    the reduce-scatter hands each rank the sums of its own b rows. The same pairs, the same
    per-token sums, and the same total bytes moved as one gather of everything; no [T, D]
    tensor exists (padding rows of the last block are zeros, dropped). Both collectives
    carry the activation dtype (x_local is cast to it; the partials are rounded to it
    before the reduce-scatter); out is in the activation dtype."""
    el = _local_experts(cfg, n_ranks)
    rank = lax.axis_index(axis)
    act = prec.act_dtype
    x_local = x_local.astype(act)

    def block(xb: jax.Array) -> tuple[jax.Array, jax.Array]:
        b = xb.shape[0]
        x_all = lax.all_gather(xb, axis, tiled=True)  # [N b, D], the ranks' rows in rank order
        ids, w = route(moe, cfg, x_all)  # [N b, k]: every rank routes every token (cheap, duplicated)
        local = ids - rank * el
        mine = (local >= 0) & (local < el)
        partial = expert_fn(x_all, jnp.where(mine, local, 0), jnp.where(mine, w, 0.0), moe.experts)
        routed = lax.psum_scatter(partial.astype(act), axis, scatter_dimension=0, tiled=True)  # [b, D]
        return routed, lax.dynamic_slice_in_dim(ids, rank * b, b)

    routed, own_ids = map_rows(block, x_local, max(1, int(local_block)))
    return (routed.astype(jnp.float32) + _shared(moe, x_local, prec)).astype(act), own_ids


def ep_moe(
    moe: MoEParams,
    cfg: ModelConfig,
    x_local: jax.Array,
    *,
    axis: str,
    n_ranks: int,
    capacity: int | None = None,
    expert_fn: ExpertFn = experts_ref,
    prec: Precision = F32,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Standard EP: route on the owner, dispatch each (token, expert) pair to the expert's
    owner with all_to_all (pairs sorted by destination into fixed [N, capacity] buffers),
    compute, all_to_all the results back, weighted sum on the owner.

    capacity: pair slots per (source, destination); None gives T_l k, which no routing can
    overflow (exactness over buffer size). Memory: the dispatch buffers are not blocked:
    send/recv/result/return buffers of N capacity rows x D each (x dtype / f32) and the
    [T_l k, D] gathered results, i.e. ~5 N T_l k D 4 bytes at the default capacity (32K
    DeepSeek-V3 tokens on 2 ranks: 7.5 GB per buffer); the ExpertFn's own pair buffers are
    blocked by grouped_experts_fn's pair_block. Returns (out [T_l, D], ids [T_l, k], pairs dropped on all
    ranks [] int32): the caller must treat dropped > 0 as an error."""
    el = _local_experts(cfg, n_ranks)
    act = prec.act_dtype
    x_local = x_local.astype(act)  # the dispatched rows cross in the activation dtype
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
    back = lax.all_to_all(y.astype(act).reshape(n_ranks, cap, d), axis, 0, 0).reshape(n_ranks * cap, d)
    y_pairs = jnp.where(kept[:, None], back[jnp.minimum(slot, n_ranks * cap - 1)], 0.0)  # [P, D]
    routed = jnp.einsum("tk,tkd->td", w, y_pairs.reshape(t_l, k, d).astype(jnp.float32))
    return (routed + _shared(moe, x_local, prec)).astype(act), ids, dropped


def _grouped_matmul(xs: jax.Array, w, sizes: jax.Array, prec: Precision) -> jax.Array:
    """xs [P, K] sorted by group, w [G, N, K] (FP8 or plain), sizes [G] -> [P, N] f32. FP8
    weights under a policy with a grouped FP8 hook go to it (an FP8 grouped GEMM: no bf16
    copy, no dense expansion); otherwise the weights are dequantised to the dot dtype
    (f32 under F32) and run through ragged_dot with f32 accumulation."""
    if isinstance(w, Fp8Tensor) and not prec.exact and prec.fp8_grouped_matmul is not None:
        return prec.fp8_grouped_matmul(xs, w, sizes)
    dt = jnp.float32 if prec.exact else prec.dot_dtype
    wd = jnp.swapaxes(dense_weight(w, dt), 1, 2)
    return lax.ragged_dot(
        xs.astype(dt), wd, sizes, preferred_element_type=jnp.float32, precision=prec.matmul_precision
    )


def experts_grouped(
    x: jax.Array, ids: jax.Array, weights: jax.Array, experts, prec: Precision = F32
) -> jax.Array:
    """ExpertFn with grouped GEMMs: the (token, expert) pairs sorted by expert and run
    through grouped GEMMs (_grouped_matmul), so each pair costs one expert's FLOPs
    (experts_ref: every expert on every token). Pairs of weight 0 - other ranks' experts
    under SmallEP, empty EP buffer slots - are sorted past the last group and never
    computed. Same sum as experts_ref, another association. x [T, D], ids/weights [T, k]
    -> [T, D] f32. Under a non-f32 policy the rows go in the activation dtype and
    silu(gate) * up is rounded to it before down (as layers.swiglu)."""
    e = experts.gate.shape[0]
    t, k = ids.shape
    w = weights.reshape(t * k).astype(jnp.float32)
    key = jnp.where(w != 0, ids.reshape(t * k), e)  # [P]; e = "not computed here"
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=e + 1)[:e].astype(jnp.int32)  # [E] rows per expert
    tok = order // k
    act = jnp.float32 if prec.exact else prec.act_dtype
    xs = x.astype(act)[tok]  # [P, D] sorted by expert
    g = _grouped_matmul(xs, experts.gate, sizes, prec)
    u = _grouped_matmul(xs, experts.up, sizes, prec)
    hid = (jax.nn.silu(g) * u).astype(act)  # [P, I]
    y = _grouped_matmul(hid, experts.down, sizes, prec)  # [P, D] f32
    w_sorted = jnp.where(
        key[order] < e, w[order], 0.0
    )  # rows past the groups: zero, whatever the kernel left
    return jnp.zeros((t, x.shape[1]), jnp.float32).at[tok].add(y * w_sorted[:, None])


def _as_bytes(a: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(a, jnp.uint8) if a.dtype == FP8_DTYPE else a


def _from_bytes(a: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(a, FP8_DTYPE) if a.dtype == jnp.uint8 else a


def expert_bytes_view(experts: Any) -> Any:
    """Host experts with FP8 weights viewed as uint8 (numpy views, no copy): the form the
    executor hands a bytes-taking ExpertFn (`takes_fp8_bytes`), so that no FP8 stack is
    widened or bitcast-copied inside the computation (XLA:CPU materialises both)."""
    return jax.tree_util.tree_map(
        lambda a: a.view(np.uint8) if np.dtype(a.dtype) == np.dtype(FP8_DTYPE) else a, experts
    )


def experts_from_bytes(experts: Any) -> Any:
    """The inverse of expert_bytes_view inside a computation (for an ExpertFn that takes FP8)."""
    return jax.tree_util.tree_map(_from_bytes, experts)


@functools.cache
def grouped_experts_fn(
    experts_per_chunk: int | None = 8, pair_block: int = 8192, prec: Precision = F32
) -> ExpertFn:
    """experts_grouped over the local experts `experts_per_chunk` at a time (lax.scan), so
    only one chunk's FP8 weights are dequantized at any time: a rank's share of a
    DeepSeek-V3 layer (128 experts at N = 2) would be 22 GB in f32 at once, 1.4 GB per chunk
    of 8. Rows are processed in blocks of pair_block // k rows (lax.map; the chunk scan,
    with its dequantisation, inside each block), so the sorted pair buffer [P, D], the
    hidden [P, I] and the outputs exist for one block of <= pair_block pairs at a time.
    experts_per_chunk None: all local experts in one chunk (no loop; for a policy whose
    grouped FP8 hook consumes the FP8 stack directly, so nothing is dequantized). prec: the
    precision policy of experts_grouped. Cached: the same function object per arguments
    (a static jit argument)."""
    if (experts_per_chunk is not None and experts_per_chunk < 1) or pair_block < 1:
        raise ValueError(
            f"grouped_experts_fn: experts_per_chunk={experts_per_chunk} and pair_block={pair_block} must be >= 1"
        )

    def over_chunks(x: jax.Array, ids: jax.Array, weights: jax.Array, experts) -> jax.Array:
        e = jax.tree_util.tree_leaves(experts)[0].shape[0]
        g = e if experts_per_chunk is None else math.gcd(e, experts_per_chunk)  # chunks tile the experts

        def chunk_out(c, chunk):
            local = ids - c * g
            mine = (local >= 0) & (local < g)
            return experts_grouped(x, jnp.where(mine, local, 0), jnp.where(mine, weights, 0.0), chunk, prec)

        # Chunk c sliced in place from the stack inside a fori_loop (a scan over reshaped
        # chunks copies all of them first; unrolled static slices keep every chunk's
        # temporaries alive on XLA:CPU). FP8 leaves are sliced as bytes: XLA:CPU widens an FP8
        # stack to f16 for a dynamic slice (2x the stack); a bitcast of the stack to bytes is
        # a copy there too, so the executor passes FP8 leaves as uint8 (expert_bytes_view)
        # and only each chunk is bitcast back.
        raw = jax.tree_util.tree_map(_as_bytes, experts)
        at = lambda c: jax.tree_util.tree_map(
            lambda a: _from_bytes(lax.dynamic_slice_in_dim(a, c * g, g)), raw
        )
        # The first chunk outside the loop: its result has the carry's exact type (under
        # shard_map that includes whether it varies across ranks).
        first = chunk_out(0, jax.tree_util.tree_map(lambda a: _from_bytes(a[:g]), experts))
        if e // g == 1:
            return first
        return lax.fori_loop(1, e // g, lambda c, acc: acc + chunk_out(c, at(c)), first)

    def fn(x: jax.Array, ids: jax.Array, weights: jax.Array, experts) -> jax.Array:
        rows = max(1, pair_block // ids.shape[1])
        return map_rows(lambda xb, ib, wb: over_chunks(xb, ib, wb, experts), x, rows, ids, weights)

    fn.__name__ = f"experts_grouped_x{experts_per_chunk or 'all'}_p{pair_block}_{prec.name}"
    fn.takes_fp8_bytes = True  # FP8 leaves may come as uint8 (expert_bytes_view)
    return fn
