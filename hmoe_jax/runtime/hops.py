"""How a decode hop crosses between the accelerator and the host (the `d2h` / `h2d` ops of a
`cpu` plan): which memory it lands in, and what each crossing moved.

Per MoE layer a decode step sends the routed experts' inputs to the host (one packed array
of x | ids | weights, runtime/pieces.py pack_hop) and their output back (x's dtype). Where the
data goes on the host side:

- `direct`: `jax.device_put` straight between the accelerator and the host CPU device (one
  transfer each way; what a CPU stand-in always does: its "accelerator" is host memory).
- `pinned` (a GPU's default where its runtime has the memory kind): through the
  accelerator's page-locked host memory (jax memory kind "pinned_host"), so the DMA engine
  copies at the link's rate without the driver staging pageable memory, then between that
  buffer and the host CPU device (two device_puts each way: a DMA and a host copy).

Which is faster for ~15 KB per token is a GPU measurement (tools/gpu_check.py times decode
steps in both modes); `HMOE_HOP_MEMORY=direct|pinned` overrides the default. `pinned` is
probed once per device (a tiny round trip); a runtime that refuses it falls back to `direct`,
and the reason is returned (gpu_check records it).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import jax
import numpy as np

HOP_MEMORY_ENV = "HMOE_HOP_MEMORY"
HOP_MEMORY_MODES = ("auto", "pinned", "direct")
# device_puts per hop direction in each mode (what docs/engine.md counts as copies)
TRANSFERS_PER_DIRECTION = {"direct": 1, "pinned": 2}


def _has_pinned_host(device: jax.Device) -> bool:
    try:
        return "pinned_host" in {m.kind for m in device.addressable_memories()}
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


@functools.cache
def _pinned_probe(device: jax.Device, host: jax.Device) -> str | None:
    """None when a tiny array makes the pinned round trip intact, else why not."""
    try:
        x = jax.device_put(np.arange(8, dtype=np.uint16), device)
        back = np.asarray(to_host(x, device, host, "pinned"))
        again = np.asarray(to_acc(jax.device_put(back, host), device, "pinned"))
    except (ValueError, RuntimeError, NotImplementedError, TypeError) as e:
        return f"{type(e).__name__}: {e}"[:300]
    if not (np.array_equal(back, np.arange(8)) and np.array_equal(again, np.arange(8))):
        return "the pinned_host round trip changed the values"
    return None


def hop_memory(device: jax.Device, host: jax.Device, requested: str | None = None) -> tuple[str, str]:
    """(mode, why) for hops between accelerator `device` and `host`: "direct" or "pinned".
    requested: "auto" | "pinned" | "direct" (default: $HMOE_HOP_MEMORY, read at each call,
    else "auto")."""
    requested = requested or os.environ.get(HOP_MEMORY_ENV, "auto")
    if requested not in HOP_MEMORY_MODES:
        raise ValueError(f"{HOP_MEMORY_ENV}={requested!r}: expected one of {HOP_MEMORY_MODES}")
    return _resolve(device, host, requested)


@functools.cache
def _resolve(device: jax.Device, host: jax.Device, requested: str) -> tuple[str, str]:
    if device.platform == "cpu":
        return "direct", "a CPU stand-in: its memory is host memory already"
    if requested == "direct":
        return "direct", f"{HOP_MEMORY_ENV}=direct"
    if not _has_pinned_host(device):
        if requested == "pinned":
            raise ValueError(f"{HOP_MEMORY_ENV}=pinned: device {device} has no pinned_host memory kind")
        return "direct", f"device {device} has no pinned_host memory kind"
    err = _pinned_probe(device, host)
    if err is not None:
        if requested == "pinned":
            raise ValueError(f"{HOP_MEMORY_ENV}=pinned: the pinned_host round trip failed on {device}: {err}")
        return "direct", f"the pinned_host round trip failed: {err}"
    return "pinned", "the accelerator's pinned_host memory (probed)"


def _pinned(device: jax.Device) -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")


def to_host(x: jax.Array, acc: jax.Device, host: jax.Device, mode: str) -> jax.Array:
    """An accelerator array onto the host CPU device (mode from hop_memory)."""
    if mode == "pinned":
        x = jax.device_put(x, _pinned(acc))  # the DMA, into page-locked memory
    return jax.device_put(x, host)


def to_acc(y: jax.Array, acc: jax.Device, mode: str) -> jax.Array:
    """A host array onto the accelerator's device memory (mode from hop_memory)."""
    if mode == "pinned":
        y = jax.device_put(y, _pinned(acc))  # host copy into page-locked memory
        return jax.device_put(y, jax.sharding.SingleDeviceSharding(acc, memory_kind="device"))
    return jax.device_put(y, acc)


def moved_bytes(arrays: Sequence[jax.Array]) -> int:
    """Bytes a hop moved: the arrays handed to the transfer, as sent."""
    return int(sum(a.nbytes for a in arrays))
