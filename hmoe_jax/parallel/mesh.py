"""The 1-D device mesh of distributed prefill. Device-kind agnostic: built from
`jax.devices()` (real GPUs, the stand-in CPU devices of the tests, or every device of a
multi-host `jax.distributed` job)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXIS = "sp"  # the single mesh axis: sequence owners for attention, expert owners for MoE


def make_mesh(n_devices: int, devices: list | None = None) -> Mesh:
    """A 1-D mesh over the first `n_devices` devices (all processes' devices under
    jax.distributed, in jax.devices() order)."""
    devs = list(jax.devices() if devices is None else devices)
    if not 1 <= n_devices <= len(devs):
        raise ValueError(f"make_mesh: n_devices={n_devices} must be in [1, {len(devs)}] (devices available)")
    # Auto said outright: the shard_map bodies and pjit placements are written for it, and
    # newer jax releases make the default of new meshes Explicit (AbstractMesh in 0.11 already).
    return Mesh(np.array(devs[:n_devices]), (AXIS,), axis_types=(AxisType.Auto,))
