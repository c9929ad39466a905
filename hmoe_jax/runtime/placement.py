"""Placement is data: which JAX device is the host and which are the accelerators, and
where each part of the weights lives.

Accelerators are real GPUs when `jax.devices("gpu")` has any; otherwise stand-in XLA CPU
devices cpu:1..cpu:N (cpu:0 is the host), which needs `jax_num_cpu_devices` >= N + 1 set
before the backend starts (configure_stand_ins; tests/conftest.py sets 4).

The host holds ONE copy of all weights (numpy, aligned or memmapped). Non-expert weights
(embeddings, attention, dense FFNs, shared experts, router, norms, lm_head) are placed on
the accelerator once: zero-copy on the CPU backend when 64-byte aligned, a VRAM copy on a
GPU (they are small next to the experts). Routed experts stay on the host: the CPU reads
them in decode / `cpu` prefill, SLP streams them through the staging ring.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from hmoe_jax.model.params import ExpertsParams, ModelParams, MoEParams
from hmoe_jax.quant.hostmem import aligned_empty, is_aligned


class PlacementError(RuntimeError):
    pass


def configure_stand_ins(num_accelerators: int) -> None:
    """Ask for host + N stand-in CPU devices; must run before jax initialises a backend."""
    want = int(num_accelerators) + 1
    try:
        jax.config.update("jax_num_cpu_devices", want)
    except RuntimeError as e:  # backend already up
        have = len(jax.devices("cpu"))
        if have < int(num_accelerators):  # == N works: the host doubles as stand-in 0
            raise PlacementError(
                f"need {want} CPU devices (host + {num_accelerators} stand-ins) but jax already started with {have}; "
                "set jax_num_cpu_devices before the first jax call"
            ) from e


def _gpus() -> list[jax.Device]:
    try:
        return list(jax.devices("gpu"))
    except RuntimeError:
        return []


@dataclasses.dataclass(frozen=True)
class Placement:
    host: jax.Device
    accelerators: tuple[jax.Device, ...]

    @property
    def acc(self) -> jax.Device:
        return self.accelerators[0]

    @property
    def stand_in(self) -> bool:
        return self.acc.platform == "cpu"

    def describe(self) -> str:
        kind = "stand-in CPU devices" if self.stand_in else self.acc.platform
        return (
            f"host {self.host}, {len(self.accelerators)} accelerator(s) ({kind}): {list(self.accelerators)}"
        )


def make_placement(num_accelerators: int = 1) -> Placement:
    n = int(num_accelerators)
    if n < 1:
        raise PlacementError(f"num_accelerators must be >= 1, got {n}")
    host = jax.devices("cpu")[0]
    gpus = _gpus()
    if gpus:
        if len(gpus) < n:
            raise PlacementError(f"asked for {n} accelerators, {len(gpus)} GPU(s) present")
        return Placement(host, tuple(gpus[:n]))
    cpus = jax.devices("cpu")
    if len(cpus) == n:
        # Every CPU device is asked for (e.g. 4 stand-ins under tests/conftest.py's 4 devices):
        # the host device doubles as the first stand-in. Results are the same; only the
        # separation of host and accelerator work onto different XLA devices is lost.
        return Placement(host, tuple(cpus))
    if len(cpus) < n + 1:
        raise PlacementError(
            f"asked for {n} stand-in accelerators but only {len(cpus)} CPU devices exist (host + {len(cpus) - 1}); "
            f"set jax_num_cpu_devices={n + 1} before jax starts (hmoe --devices {n} does)"
        )
    return Placement(host, tuple(cpus[1 : n + 1]))


def host_params(params: ModelParams) -> tuple[ModelParams, int]:
    """Params with every leaf a C-contiguous, 64-byte aligned host numpy array. Leaves that
    already are (e.g. an aligned arena or mmap) are kept as they are; others are copied once
    (the caller drops the original, so the host still holds one copy). Returns (params,
    bytes copied)."""
    copied = 0

    def fix(x: Any) -> np.ndarray:
        nonlocal copied
        a = np.asarray(x)
        if is_aligned(a):
            return a
        out = aligned_empty(a.shape, a.dtype)
        out[...] = a
        copied += a.nbytes
        return out

    return jax.tree_util.tree_map(fix, params), copied


def split_experts(params: ModelParams) -> tuple[ModelParams, list[ExpertsParams | None]]:
    """(params with routed experts removed, per-layer host ExpertsParams or None)."""
    experts: list[ExpertsParams | None] = []
    layers = []
    for lp in params.layers:
        if isinstance(lp.ffn, MoEParams):
            experts.append(lp.ffn.experts)
            lp = lp.replace(ffn=lp.ffn.replace(experts=None))
        else:
            experts.append(None)
        layers.append(lp)
    return params.replace(layers=tuple(layers)), experts


def put(tree: Any, device: jax.Device) -> Any:
    """device_put a pytree (zero-copy on CPU devices for aligned numpy leaves)."""
    return jax.device_put(tree, device)
