"""Distributed building blocks vs their single-device references, on 1, 2 and 4 stand-in
devices: zig-zag layout (exhaustive), context-parallel MLA vs model.attention_block,
SmallEP and standard EP vs model.moe.moe_block with experts_ref (f32 and FP8), the
communication accounting vs an explicit transfer count.

Tolerance: the distributed code computes the same products in another summation order
(blockwise online softmax, per-rank partial sums reduced by a collective), so results agree
to f32 rounding, not bitwise. Observed max |err| ~1.5e-6 * max|ref| on these shapes; we
allow 1e-5 * max|ref| (about 80 ulps of the largest value), far below any real bug (a
missing chunk, expert or weight changes outputs at the 1e-2 level).
"""

from __future__ import annotations

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from hmoe_jax.config import QuantConfig
from hmoe_jax.model.model import attention_block
from hmoe_jax.model.moe import experts_ref, moe_block, route
from hmoe_jax.model.params import MoEParams
from hmoe_jax.model.precision import F32
from hmoe_jax.parallel.attention import _group_ready, cp_attention_block
from hmoe_jax.parallel.mesh import AXIS, make_mesh
from hmoe_jax.parallel.moe import ep_moe, experts_grouped, grouped_experts_fn, smallep_moe
from hmoe_jax.plan.dist import (
    ZigzagLayout,
    cp_attention_comm,
    ep_comm,
    ep_comm_buffers,
    ep_comm_expected,
    smallep_beats_ep,
    smallep_comm,
)
from hmoe_jax.quant.fp8 import Fp8Tensor
from hmoe_jax.runtime.synthetic import random_params
from tests.helpers import assert_close, model_config

# --- zig-zag layout -------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_zigzag_layout_exhaustive(n):
    for t in range(1, 4 * n + 3):
        lay = ZigzagLayout.for_sequence(t, n)
        assert lay.padded_len % (2 * n) == 0 and t <= lay.padded_len < t + 2 * n
        assert sorted(lay.order) == list(range(lay.padded_len))
        assert (lay.order[lay.inverse] == np.arange(lay.padded_len)).all()
        work = []
        for r in range(n):
            pos = lay.positions_of(r)
            chunks = set((pos // lay.chunk).tolist())
            assert chunks == {r, 2 * n - 1 - r}
            # causal (query, key-chunk) blocks this rank computes: chunk c needs c + 1
            work.append(sum(c + 1 for c in chunks))
        assert work == [2 * n + 1] * n  # balanced
        rank, local = lay.owner_of_last
        assert lay.positions_of(rank)[local] == t - 1


# --- context-parallel attention -----------------------------------------------------------


# 13 is a multiple of 2N for no N: padded and masked; 16 is one for every N here.
# attn: the walk's options; small blocks so several query and key blocks run per chunk
# (block 3 divides no chunk of 7: the last query block and the gathered row are padded),
# and two head groups (o_proj accumulated over them).
ATTN_OPTS = [
    {},
    {"block": 2},
    {"block": 3, "head_groups": 2},
]


@pytest.mark.parametrize("attn", ATTN_OPTS)
@pytest.mark.parametrize("n,t", [(1, 13), (2, 16), (2, 13), (4, 13)])
def test_cp_attention_matches_attention_block(n, t, attn):
    cfg = model_config()
    layer = jax.tree.map(jnp.asarray, random_params(cfg, seed=1, fp8=False).layers[0])
    b = 2
    h = np.random.default_rng(t + n).standard_normal((b, t, cfg.hidden_size)).astype(np.float32)
    lay = ZigzagLayout.for_sequence(t, n)
    h_zz = np.pad(h, ((0, 0), (0, lay.padded_len - t), (0, 0)))[:, lay.order]
    f = jax.jit(
        jax.shard_map(
            lambda lp, x: cp_attention_block(lp, cfg, x, lay, axis=AXIS, **attn),
            mesh=make_mesh(n),
            in_specs=(P(), P(None, AXIS)),
            out_specs=(P(None, AXIS), P(), P()),
        )
    )
    out, lat, rop = f(layer, h_zz)
    z = jnp.zeros
    ref, ref_lat, ref_rop = jax.jit(attention_block, static_argnames="cfg")(
        layer, cfg, jnp.asarray(h), z((b, t, cfg.kv_lora_rank)), z((b, t, cfg.qk_rope_head_dim)), 0
    )
    assert_close(np.asarray(out)[:, lay.inverse[:t]], ref, f"CP attention N={n} T={t}")
    assert_close(np.asarray(lat)[:, :t], ref_lat, "gathered latent cache")
    assert_close(np.asarray(rop)[:, :t], ref_rop, "gathered k_rope cache")


def test_cp_attention_head_groups_slice_fp8_weights_on_their_scale_blocks():
    # 32 x 32 scale blocks: every head group's rows of kv_b (2 x 64) and q_b (2 x 48) and
    # columns of o_proj (2 x 32) fall on whole blocks, so the group scan slices the FP8
    # values and their scales (dynamic slices by the group index), never a dequantised copy
    cfg = model_config(quant=QuantConfig(block_n=32, block_k=32))
    layer = jax.tree.map(jnp.asarray, random_params(cfg, seed=3, fp8=True).layers[0])
    assert isinstance(layer.attn.kv_b, Fp8Tensor) and isinstance(layer.attn.o, Fp8Tensor)
    hg = cfg.num_attention_heads // 2
    for w, size, axis in (
        (layer.attn.kv_b, hg * (cfg.qk_nope_head_dim + cfg.v_head_dim), 0),
        (layer.attn.q_b, hg * cfg.qk_head_dim, 0),
        (layer.attn.o, hg * cfg.v_head_dim, 1),
    ):
        assert isinstance(_group_ready(w, size, axis, F32), Fp8Tensor)
    n, t, b = 2, 16, 2
    h = np.random.default_rng(5).standard_normal((b, t, cfg.hidden_size)).astype(np.float32)
    lay = ZigzagLayout.for_sequence(t, n)
    h_zz = np.pad(h, ((0, 0), (0, lay.padded_len - t), (0, 0)))[:, lay.order]
    f = jax.jit(
        jax.shard_map(
            lambda lp, x: cp_attention_block(lp, cfg, x, lay, axis=AXIS, block=4, head_groups=2),
            mesh=make_mesh(n),
            in_specs=(P(), P(None, AXIS)),
            out_specs=(P(None, AXIS), P(), P()),
        )
    )
    out = f(layer, h_zz)[0]
    z = jnp.zeros
    ref = jax.jit(attention_block, static_argnames="cfg")(
        layer, cfg, jnp.asarray(h), z((b, t, cfg.kv_lora_rank)), z((b, t, cfg.qk_rope_head_dim)), 0
    )[0]
    assert_close(np.asarray(out)[:, lay.inverse[:t]], ref, "CP attention, FP8 head-group slices")


def test_cp_attention_rejects_wrong_shard():
    cfg = model_config()
    layer = random_params(cfg, fp8=False).layers[0]
    lay = ZigzagLayout.for_sequence(16, 2)
    f = jax.shard_map(
        lambda lp, x: cp_attention_block(lp, cfg, x, lay, axis=AXIS),
        mesh=make_mesh(2),
        in_specs=(P(), P(None, AXIS)),
        out_specs=(P(None, AXIS), P(), P()),
    )
    with pytest.raises(ValueError, match="layout expects 2\\*chunk = 8"):
        f(layer, jnp.zeros((1, 12, cfg.hidden_size)))


# --- MoE: SmallEP and standard EP ----------------------------------------------------------


def _moe_specs(moe: MoEParams) -> MoEParams:
    return MoEParams(
        router=P(),
        router_bias=P(),
        experts=jax.tree.map(lambda _: P(AXIS), moe.experts),
        shared=jax.tree.map(lambda _: P(), moe.shared),
    )


def _run_moe(scheme, moe, cfg, x, n, capacity=None, expert_fn=experts_ref, local_block=1024):
    if scheme == "smallep":
        body = lambda m, xs: smallep_moe(
            m, cfg, xs, axis=AXIS, n_ranks=n, expert_fn=expert_fn, local_block=local_block
        )
        outs = (P(AXIS), P(AXIS))
    else:
        body = lambda m, xs: ep_moe(m, cfg, xs, axis=AXIS, n_ranks=n, capacity=capacity, expert_fn=expert_fn)
        outs = (P(AXIS), P(AXIS), P())
    return jax.jit(
        jax.shard_map(body, mesh=make_mesh(n), in_specs=(_moe_specs(moe), P(AXIS)), out_specs=outs)
    )(moe, x)


MOE_CASES = [
    *(("deepseek_v3_tiny", False, n) for n in (1, 2, 4)),
    ("deepseek_v3_tiny", True, 2),
    ("kimi_k2_tiny", True, 4),
]


@pytest.mark.parametrize("scheme", ["smallep", "ep"])
@pytest.mark.parametrize("name,fp8,n", MOE_CASES)
def test_moe_schemes_match_moe_block(scheme, name, fp8, n):
    cfg = model_config(name)
    moe = jax.tree.map(jnp.asarray, random_params(cfg, seed=2, fp8=fp8).layers[-1].ffn)
    x = np.random.default_rng(3).standard_normal((24, cfg.hidden_size)).astype(np.float32)
    ref = jax.jit(moe_block, static_argnames="cfg")(moe, cfg, jnp.asarray(x))
    seen = []

    def local_only(xs, ids, w, experts):  # what each rank's ExpertFn is handed
        seen.append(jax.tree_util.tree_leaves(experts)[0].shape[0])
        return experts_ref(xs, ids, w, experts)

    outs = _run_moe(scheme, moe, cfg, x, n, expert_fn=local_only)
    assert seen == [cfg.n_routed_experts // n], "each rank computes with its E/N experts only"
    assert_close(outs[0], ref, f"{scheme} N={n} {name} fp8={fp8}")
    ref_ids, _ = route(moe, cfg, jnp.asarray(x))
    assert (np.asarray(outs[1]) == np.asarray(ref_ids)).all(), "ids returned for accounting"
    if scheme == "ep":
        assert int(outs[2]) == 0


@pytest.mark.parametrize("chunk", [None, 3, 8])  # None: one ragged_dot over all; 3 -> gcd 1: 16 chunks
@pytest.mark.parametrize("fp8", [False, True])
def test_experts_grouped_matches_experts_ref(fp8, chunk):
    """Including what SmallEP/EP hand it: zero-weight pairs whose id repeats a real one."""
    cfg = model_config()
    moe = jax.tree.map(jnp.asarray, random_params(cfg, seed=5, fp8=fp8).layers[-1].ffn)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((20, cfg.hidden_size)), jnp.float32)
    ids, w = route(moe, cfg, x)
    ids = ids.at[::2, 1].set(ids[::2, 0])  # duplicate ids ...
    w = w.at[::2, 1].set(0.0).at[5].set(0.0)  # ... with weight 0, and a token with no pair at all
    ref = jax.jit(experts_ref)(x, ids, w, moe.experts)
    fn = experts_grouped if chunk is None else grouped_experts_fn(chunk)
    assert_close(jax.jit(fn)(x, ids, w, moe.experts), ref, f"grouped experts fp8={fp8} chunk={chunk}")
    assert not np.asarray(ref)[5].any()


@pytest.mark.parametrize("scheme", ["smallep", "ep"])
def test_moe_schemes_with_grouped_experts(scheme):
    cfg = model_config()
    moe = jax.tree.map(jnp.asarray, random_params(cfg, seed=2, fp8=True).layers[-1].ffn)
    x = np.random.default_rng(3).standard_normal((24, cfg.hidden_size)).astype(np.float32)
    ref = jax.jit(moe_block, static_argnames="cfg")(moe, cfg, jnp.asarray(x))
    fn = grouped_experts_fn(2)  # 4 local experts at N = 4: two chunks
    assert_close(_run_moe(scheme, moe, cfg, x, 4, expert_fn=fn)[0], ref, f"{scheme} grouped")


@pytest.mark.parametrize("scheme", ["smallep", "ep"])
@pytest.mark.parametrize("n", [2, 4])
def test_moe_schemes_in_token_blocks(scheme, n):
    """SmallEP in blocks of 5 local rows (T_l = 12 or 6: padded last block, gathers and
    reduce-scatters per block) and grouped experts in blocks of 7 pairs' rows."""
    cfg = model_config()
    moe = jax.tree.map(jnp.asarray, random_params(cfg, seed=2, fp8=True).layers[-1].ffn)
    x = np.random.default_rng(3).standard_normal((24, cfg.hidden_size)).astype(np.float32)
    ref = jax.jit(moe_block, static_argnames="cfg")(moe, cfg, jnp.asarray(x))
    fn = grouped_experts_fn(2, pair_block=7 * cfg.num_experts_per_tok)
    outs = _run_moe(scheme, moe, cfg, x, n, expert_fn=fn, local_block=5)
    assert_close(outs[0], ref, f"{scheme} N={n} blocked")
    ref_ids, _ = route(moe, cfg, jnp.asarray(x))
    assert (np.asarray(outs[1]) == np.asarray(ref_ids)).all()


def test_ep_reports_dropped_pairs_when_capacity_is_short():
    cfg = model_config()
    moe = jax.tree.map(jnp.asarray, random_params(cfg, seed=2, fp8=False).layers[-1].ffn)
    x = np.random.default_rng(3).standard_normal((24, cfg.hidden_size)).astype(np.float32)
    ids = np.asarray(route(moe, cfg, jnp.asarray(x))[0])
    n, el, cap = 2, cfg.n_routed_experts // 2, 3
    # independent count: per (source rank, destination rank) pairs beyond `cap` are dropped
    src = np.repeat(np.arange(24) // 12, cfg.num_experts_per_tok)
    dst = ids.reshape(-1) // el
    want = sum(max(0, int(((src == s) & (dst == d)).sum()) - cap) for s in range(n) for d in range(n))
    assert want > 0
    assert int(_run_moe("ep", moe, cfg, x, n, capacity=cap)[2]) == want


def test_moe_rejects_indivisible_expert_count():
    cfg = model_config("kimi_k2_tiny")  # 24 experts
    moe = random_params(cfg, fp8=False).layers[-1].ffn
    moe = moe.replace(experts=jax.tree.map(lambda a: a[:18], moe.experts))
    cfg18 = model_config("kimi_k2_tiny", n_routed_experts=18)
    with pytest.raises(ValueError, match="n_routed_experts=18 is not divisible by the number of ranks 4"):
        jax.shard_map(
            lambda m, xs: smallep_moe(m, cfg18, xs, axis=AXIS, n_ranks=4),
            mesh=make_mesh(4),
            in_specs=(P(), P(AXIS)),
            out_specs=(P(AXIS), P(AXIS)),
        )(moe, jnp.zeros((8, cfg.hidden_size)))


# --- communication accounting -----------------------------------------------------------


def _transfers_allgather(n, shard_bytes):
    """Explicit list of (src, dst, bytes) of an all-gather: every rank gets every other shard."""
    return [(s, d, shard_bytes) for s, d in itertools.product(range(n), range(n)) if s != d]


@pytest.mark.parametrize("n", [1, 2, 4])
def test_smallep_and_cp_comm_match_explicit_transfers(n):
    t, d, cache_dim = 32, 256, 144
    shard = (t // n) * d * 4
    ag = sum(b for *_, b in _transfers_allgather(n, shard))
    v = smallep_comm(n, t, d)
    assert v.all_gather_bytes == ag
    assert v.reduce_scatter_bytes == ag  # reduce-scatter: the transpose of the all-gather
    assert v.all_to_all_bytes == 0 and v.per_rank_bytes == 2 * ag / n
    assert cp_attention_comm(n, t, cache_dim).all_gather_bytes == sum(
        b for *_, b in _transfers_allgather(n, (t // n) * cache_dim * 4)
    )


def test_ep_comm_counts_remote_pairs():
    rng = np.random.default_rng(0)
    n, e, k, t, d = 4, 16, 4, 32, 8
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(t)])
    moved = 0
    for tok in range(t):  # brute force: a pair moves out and back iff its expert is remote
        for j in range(k):
            if ids[tok, j] // (e // n) != tok // (t // n):
                moved += 2 * d * 4
    assert ep_comm(ids, n, e, d).all_to_all_bytes == moved
    assert ep_comm(ids, 1, e, d).all_to_all_bytes == 0


def test_smallep_beats_ep_rule_matches_volumes():
    for n, k in itertools.product([2, 3, 4, 8, 16], range(1, 10)):
        sm = smallep_comm(n, 48 * n, 64).total_bytes
        ep = ep_comm_expected(n, 48 * n, 64, k).total_bytes
        assert (sm <= ep) == smallep_beats_ep(n, k), (n, k, sm, ep)


# --- accounting vs the collectives in the compiled program ----------------------------------

_COLLECTIVE = re.compile(r'"stablehlo\.(all_gather|reduce_scatter|all_to_all)"')
_SIG = re.compile(r":\s*\((tensor<[^>]*>)\)\s*->\s*(tensor<[^>]*>)")


def _tensor_bytes(t: str) -> int:
    *dims, dt = t[len("tensor<") : -1].split("x")
    return int(np.prod([int(d) for d in dims])) * {"f32": 4, "i32": 4}[dt]


def collective_bytes(lowered_text: str, n: int) -> dict[str, int]:
    """Bytes that must cross links for each collective kind in a lowered shard_map program,
    summed over the N ranks, from the per-rank operand/result types: an all-gather brings
    each rank the N-1 shards it lacks, a reduce-scatter sends each rank's partials of the
    other N-1 shards, an all-to-all sends (N-1)/N of each rank's buffer."""
    out = {"all_gather": 0, "reduce_scatter": 0, "all_to_all": 0}
    for m in _COLLECTIVE.finditer(lowered_text):
        operand, result = (_tensor_bytes(t) for t in _SIG.search(lowered_text, m.end()).groups())
        kind = m.group(1)
        if kind == "all_gather":
            out[kind] += n * (result - operand)
        elif kind == "reduce_scatter":
            out[kind] += n * (operand - result)
        else:
            out[kind] += (n - 1) * operand
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_accounting_matches_compiled_collectives(n):
    cfg = model_config()
    moe = random_params(cfg, fp8=False).layers[-1].ffn
    t = 24
    x = jax.ShapeDtypeStruct((t, cfg.hidden_size), jnp.float32)
    mesh = make_mesh(n)

    def lowered(body, outs):
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(_moe_specs(moe), P(AXIS)), out_specs=outs))
        return f.lower(moe, x).as_text()

    sm = collective_bytes(
        lowered(lambda m, xs: smallep_moe(m, cfg, xs, axis=AXIS, n_ranks=n), (P(AXIS),) * 2), n
    )
    want = smallep_comm(n, t, cfg.hidden_size)
    assert (sm["all_gather"], sm["reduce_scatter"], sm["all_to_all"]) == (
        want.all_gather_bytes,
        want.reduce_scatter_bytes,
        0,
    )
    ep = collective_bytes(
        lowered(lambda m, xs: ep_moe(m, cfg, xs, axis=AXIS, n_ranks=n), (P(AXIS), P(AXIS), P())), n
    )
    want = ep_comm_buffers(n, t, cfg.hidden_size, cfg.num_experts_per_tok)
    assert ep == {"all_gather": 0, "reduce_scatter": 0, "all_to_all": want.all_to_all_bytes}

    lay = ZigzagLayout.for_sequence(t, n)
    h = jax.ShapeDtypeStruct((1, lay.padded_len, cfg.hidden_size), jnp.float32)
    f = jax.jit(
        jax.shard_map(
            lambda lp, hs: cp_attention_block(lp, cfg, hs, lay, axis=AXIS),
            mesh=mesh,
            in_specs=(P(), P(None, AXIS)),
            out_specs=(P(None, AXIS), P(), P()),
        )
    )
    cp = collective_bytes(f.lower(random_params(cfg, fp8=False).layers[0], h).as_text(), n)
    assert cp["all_gather"] == cp_attention_comm(n, lay.padded_len, cfg.cache_dim).all_gather_bytes
    assert cp["reduce_scatter"] == cp["all_to_all"] == 0
