"""Distributed prefill as plan data (no jax): the zig-zag sequence layout and the per-layer
communication volume of SmallEP and standard expert parallelism. The mesh and the
shard_map maths that use them live in hmoe_jax/parallel/.

Everything here is device-kind agnostic: the mesh is built from `jax.devices()` (real GPUs,
the stand-in CPU devices of the tests, or every device of a multi-host `jax.distributed`
job), and the collectives run under `jax.shard_map`.

Zig-zag (striped) layout: the padded sequence is cut into 2N chunks of C tokens; rank r owns
chunks r and 2N-1-r. Under a causal mask chunk c needs keys of chunks 0..c, so rank r does
(r + 1) + (2N - r) = 2N + 1 chunk-pairs of attention work: the same on every rank.
A global array "in zig-zag order" holds rank 0's two chunks, then rank 1's, ..., so that a
plain `P(axis)` sharding of the sequence axis gives each rank exactly its tokens.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class ZigzagLayout:
    """Where each token of a (padded) sequence lives. Padding goes at the END of the
    sequence (positions >= seq_len): under the causal mask no real query ever attends to a
    pad key, and a pad token's own outputs are discarded, so padding cannot change results."""

    seq_len: int  # real tokens
    n_ranks: int
    chunk: int  # C: tokens per chunk; there are 2N chunks

    @staticmethod
    def for_sequence(seq_len: int, n_ranks: int) -> ZigzagLayout:
        if seq_len < 1 or n_ranks < 1:
            raise ValueError(f"ZigzagLayout: seq_len={seq_len} and n_ranks={n_ranks} must be >= 1")
        return ZigzagLayout(seq_len, n_ranks, math.ceil(seq_len / (2 * n_ranks)))

    @property
    def padded_len(self) -> int:
        return 2 * self.n_ranks * self.chunk

    @property
    def local_len(self) -> int:
        """Tokens per rank (two chunks)."""
        return 2 * self.chunk

    def chunks_of(self, rank: int) -> tuple[int, int]:
        return rank, 2 * self.n_ranks - 1 - rank

    def positions_of(self, rank: int) -> np.ndarray:
        """Natural sequence positions of rank's tokens, in its local order. [2C] int32"""
        a, b = self.chunks_of(rank)
        c = self.chunk
        return np.concatenate([np.arange(a * c, (a + 1) * c), np.arange(b * c, (b + 1) * c)]).astype(np.int32)

    @property
    def order(self) -> np.ndarray:
        """order[i] = natural position of the i-th token in zig-zag order. [padded_len]"""
        return np.concatenate([self.positions_of(r) for r in range(self.n_ranks)])

    @property
    def inverse(self) -> np.ndarray:
        """inverse[p] = zig-zag index of natural position p. [padded_len]"""
        inv = np.empty(self.padded_len, np.int32)
        inv[self.order] = np.arange(self.padded_len, dtype=np.int32)
        return inv

    @property
    def owner_of_last(self) -> tuple[int, int]:
        """(rank, local index) of the last real token (the one whose logits start decode)."""
        z = int(self.inverse[self.seq_len - 1])
        return z // self.local_len, z % self.local_len


# ---------------------------------------------------------------------------------------
# Communication volume per MoE layer, as data for the plan / simulator.
# Convention: bytes that cross a link, summed over all ranks (a rank receiving its own
# shard moves nothing). `per_rank_*` is the same divided by N (all schemes here are
# symmetric in expectation).


@dataclasses.dataclass(frozen=True)
class CommVolume:
    scheme: str  # "smallep" | "ep" | "cp_attention"
    n_ranks: int
    tokens: int  # T: tokens of the whole (padded) sequence in this layer
    all_gather_bytes: int = 0
    reduce_scatter_bytes: int = 0
    all_to_all_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.all_gather_bytes + self.reduce_scatter_bytes + self.all_to_all_bytes

    @property
    def per_rank_bytes(self) -> float:
        return self.total_bytes / self.n_ranks

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["total_bytes"] = self.total_bytes
        d["per_rank_bytes"] = self.per_rank_bytes
        return d


def smallep_comm(n_ranks: int, tokens: int, hidden: int, act_bytes: int = 4) -> CommVolume:
    """SmallEP: all-gather the hidden states (each rank receives the N-1 other shards), then
    reduce-scatter one partial per token (each rank sends N-1 shards of partials).
    Independent of routing: 2 (N-1) T D bytes in total."""
    shard = (tokens // n_ranks) * hidden * act_bytes
    moved = (n_ranks - 1) * shard * n_ranks
    return CommVolume("smallep", n_ranks, tokens, all_gather_bytes=moved, reduce_scatter_bytes=moved)


def ep_comm(ids: np.ndarray, n_ranks: int, n_experts: int, hidden: int, act_bytes: int = 4) -> CommVolume:
    """Standard EP from the actual routing `ids` [T, k] in zig-zag order (token t lives on
    rank t // (T/N)): every (token, expert) pair whose expert lives on another rank is
    dispatched there (all_to_all) and its result combined back (all_to_all): payload bytes,
    without the capacity padding of the fixed-shape buffers."""
    ids = np.asarray(ids)
    t = ids.shape[0]
    src = (np.arange(t) // (t // n_ranks))[:, None]
    dst = ids // (n_experts // n_ranks)
    remote_pairs = int((src != dst).sum())
    moved = 2 * remote_pairs * hidden * act_bytes
    return CommVolume("ep", n_ranks, t, all_to_all_bytes=moved)


def ep_comm_expected(n_ranks: int, tokens: int, hidden: int, top_k: int, act_bytes: int = 4) -> CommVolume:
    """Standard EP in expectation under balanced routing: a fraction (N-1)/N of the T k pairs
    is remote, each moved twice: 2 T k (N-1)/N D bytes."""
    moved = round(2 * tokens * top_k * (n_ranks - 1) / n_ranks * hidden * act_bytes)
    return CommVolume("ep", n_ranks, tokens, all_to_all_bytes=moved)


def ep_comm_buffers(
    n_ranks: int, tokens: int, hidden: int, top_k: int, capacity: int | None = None, act_bytes: int = 4
) -> CommVolume:
    """Standard EP as ep_moe runs it: fixed [N, capacity] buffers (capacity None = T_l k,
    the no-drop default) go out (hidden states + int32 expert ids) and back (results)
    whatever the routing, so this is what crosses the links, padding included."""
    cap = (tokens // n_ranks) * top_k if capacity is None else capacity
    off_rank = (n_ranks - 1) * cap * n_ranks  # rows each all_to_all sends to other ranks, all ranks
    moved = off_rank * (2 * hidden * act_bytes + 4)
    return CommVolume("ep", n_ranks, tokens, all_to_all_bytes=moved)


def cp_attention_comm(n_ranks: int, tokens: int, cache_dim: int, act_bytes: int = 4) -> CommVolume:
    """Context-parallel MLA: only the latent cache (cache_dim values per token) is
    all-gathered; queries and outputs stay on their owners."""
    moved = (n_ranks - 1) * (tokens // n_ranks) * cache_dim * act_bytes * n_ranks
    return CommVolume("cp_attention", n_ranks, tokens, all_gather_bytes=moved)


def smallep_beats_ep(n_ranks: int, top_k: int) -> bool:
    """SmallEP moves 2 (N-1) T D, EP 2 k (N-1)/N T D (balanced routing): the ratio is N / k,
    so SmallEP moves no more than EP while the EP size N <= k experts activated per token
    (the paper's rule). At N = 1 neither moves anything."""
    return n_ranks <= top_k
