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
from hmoe_jax.runtime.dist import AXIS


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

    def experts(self, layer: int, experts: ExpertsParams) -> ExpertsParams:
        """Shard a layer's experts over the ranks: rank r gets experts [r El, (r+1) El)."""
        leaves, treedef = jax.tree_util.tree_flatten(experts)
        e = leaves[0].shape[0]
        if e % self.n_ranks:
            raise ValueError(
                f"RankStreamer: layer {layer} has {e} experts, not divisible by {self.n_ranks} ranks"
            )
        el = e // self.n_ranks
        sharding = NamedSharding(self.mesh, P(AXIS))
        rank_bytes = [0] * self.n_ranks
        out = []
        for leaf in leaves:
            if leaf.shape[0] != e:
                raise ValueError(
                    f"RankStreamer: layer {layer} expert leaf {leaf.shape} is not stacked on E={e}"
                )
            pieces = []
            for d in sharding.addressable_devices:
                r = self._rank_of[d]
                part = leaf[r * el : (r + 1) * el]  # a view of the host copy
                rank_bytes[r] += _nbytes(part)
                pieces.append(jax.device_put(part, d))
            out.append(jax.make_array_from_single_device_arrays(leaf.shape, sharding, pieces))
        for d in sharding.addressable_devices:
            r = self._rank_of[d]
            self.log.append(StreamRecord(layer, r, "experts", (r * el, (r + 1) * el), rank_bytes[r]))
        return jax.tree_util.tree_unflatten(treedef, out)

    def replicated(self, layer: int, tree: Any) -> Any:
        """Every rank gets the whole tree (non-expert weights of the layer)."""
        sharding = NamedSharding(self.mesh, P())
        nbytes = sum(_nbytes(x) for x in jax.tree_util.tree_leaves(tree))
        for d in sharding.addressable_devices:
            self.log.append(StreamRecord(layer, self._rank_of[d], "replicated", (0, 0), nbytes))
        return jax.device_put(tree, sharding)

    def expert_bytes_by_rank(self) -> dict[int, int]:
        out = {r: 0 for r in range(self.n_ranks)}
        for rec in self.log:
            if rec.what == "experts":
                out[rec.rank] += rec.bytes
        return out
