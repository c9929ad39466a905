"""Per-rank weight streaming for distributed prefill: each rank receives only ITS experts.

A layer's routed experts ([E, ...] host arrays or Fp8Tensors, FP8 as stored) are cut on
the expert axis; rank r's slice [r E/N, (r+1) E/N) is copied to rank r's device and
nowhere else, and the per-device pieces are assembled into one global array sharded
`P(axis)` (jax.make_array_from_single_device_arrays: no gather, no second copy; under
jax.distributed each process copies to its own devices only). Non-expert weights of a
layer (attention, norms, router, shared expert, dense FFN) are replicated to every rank.

Every copy is recorded (rank, layer, expert range, bytes) so tests can prove the SmallEP
property "each rank streams only its half of the experts" from what was actually sent.
The copies are jax.device_put calls, asynchronous on accelerators: issuing layer i+1's
puts before computing layer i overlaps them with compute.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from hmoe_jax.model.params import ExpertsParams
from hmoe_jax.parallel.mesh import AXIS


@dataclasses.dataclass(frozen=True)
class StreamRecord:
    layer: int
    rank: int
    what: str  # "experts" | "replicated"
    experts: tuple[int, int]  # [lo, hi) expert ids; (0, 0) for replicated weights
    bytes: int


def _nbytes(x: Any) -> int:
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


class RankStreamer:
    """Copies one layer's weights at a time to the mesh, logging every per-rank copy."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.n_ranks = mesh.devices.size
        self.log: list[StreamRecord] = []
        self._rank_of = {d: r for r, d in enumerate(mesh.devices.flat)}

    @property
    def local_ranks(self) -> list[int]:
        """Ranks whose device this process can address (all of them in one process)."""
        return [self._rank_of[d] for d in NamedSharding(self.mesh, P()).addressable_devices]

    def device(self, rank: int):
        return self.mesh.devices.flat[rank]

    def rank_copy(
        self, layer: int, rank: int, tree: Any, what: str, experts: tuple[int, int] = (0, 0)
    ) -> Any:
        """Copy `tree` (host arrays) to rank's device only, and log it."""
        nbytes = sum(_nbytes(x) for x in jax.tree_util.tree_leaves(tree))
        self.log.append(StreamRecord(layer, rank, what, tuple(experts), nbytes))
        return jax.device_put(tree, self.device(rank))

    def assemble_sharded(self, pieces: dict[int, Any], like: Any) -> Any:
        """Per-rank expert slices {rank: tree of [El, ...] on its device} -> one tree of
        global [E, ...] arrays sharded P(axis) (no data moves). `like`: the host tree."""
        sharding = NamedSharding(self.mesh, P(AXIS))
        ranks = self.local_ranks
        flat = [jax.tree_util.tree_leaves(pieces[r]) for r in ranks]
        full, treedef = jax.tree_util.tree_flatten(like)
        out = [
            jax.make_array_from_single_device_arrays(tuple(full[j].shape), sharding, [f[j] for f in flat])
            for j in range(len(full))
        ]
        return jax.tree_util.tree_unflatten(treedef, out)

    def assemble_replicated(self, pieces: dict[int, Any]) -> Any:
        """Per-rank full copies {rank: tree on its device} -> one replicated tree."""
        sharding = NamedSharding(self.mesh, P())
        ranks = self.local_ranks
        flat = [jax.tree_util.tree_leaves(pieces[r]) for r in ranks]
        _, treedef = jax.tree_util.tree_flatten(pieces[ranks[0]])
        out = [
            jax.make_array_from_single_device_arrays(tuple(flat[0][j].shape), sharding, [f[j] for f in flat])
            for j in range(len(flat[0]))
        ]
        return jax.tree_util.tree_unflatten(treedef, out)

    def expert_range(self, n_experts: int, rank: int) -> tuple[int, int]:
        if n_experts % self.n_ranks:
            raise ValueError(f"RankStreamer: {n_experts} experts are not divisible by {self.n_ranks} ranks")
        el = n_experts // self.n_ranks
        return rank * el, (rank + 1) * el

    def experts(self, layer: int, experts: ExpertsParams) -> ExpertsParams:
        """Shard a layer's experts over the ranks: rank r gets experts [r El, (r+1) El)."""
        e = jax.tree_util.tree_leaves(experts)[0].shape[0]
        pieces = {}
        for r in self.local_ranks:
            lo, hi = self.expert_range(e, r)
            part = jax.tree_util.tree_map(lambda x, lo=lo, hi=hi: x[lo:hi], experts)  # views of the host copy
            pieces[r] = self.rank_copy(layer, r, part, "experts", (lo, hi))
        return self.assemble_sharded(pieces, experts)

    def replicated(self, layer: int, tree: Any) -> Any:
        """Every rank gets the whole tree (non-expert weights of the layer)."""
        return self.assemble_replicated(
            {r: self.rank_copy(layer, r, tree, "replicated") for r in self.local_ranks}
        )

    def expert_bytes_by_rank(self) -> dict[int, int]:
        out = {r: 0 for r in range(self.n_ranks)}
        for rec in self.log:
            if rec.what == "experts":
                out[rec.rank] += rec.bytes
        return out
