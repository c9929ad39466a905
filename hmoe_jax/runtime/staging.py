"""Python side of the C++ staging ring (xla_ffi/src/staging.cc): an aligned (pinned where
cudart is present) host arena of R slots, filled by background C++ copy threads from the
host weight arena, optionally at a capped rate (link emulation).

Control goes through the extension's C API with ctypes (calls release the GIL, so a
Python loader thread waiting on a fill does not stall the compute thread); the same wait is
also an XLA FFI target (`hmoe_staging_wait`) so a computation can block on a slot itself.
A filled slot is viewed as numpy arrays without a copy; jax.device_put of such a view is
zero-copy on the CPU backend (64-byte aligned) and one host->device copy on a GPU.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hmoe_jax.kernels import ffi as hffi
from hmoe_jax.model.params import ExpertsParams
from hmoe_jax.plan.costs import SLOT_ALIGN_BYTES
from hmoe_jax.quant.fp8 import Fp8Tensor

_ALIGN = SLOT_ALIGN_BYTES  # sub-array alignment inside a slot (>= 64 for zero-copy device_put)
u64 = ctypes.c_uint64


class StagingError(RuntimeError):
    pass


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(hffi.extension().__file__)
    vp = ctypes.c_void_p
    sig = {
        "hmoe_ring_create": (vp, [ctypes.c_int, u64, ctypes.c_int, ctypes.c_double]),
        "hmoe_ring_destroy": (None, [vp]),
        "hmoe_ring_slot_ptr": (u64, [vp, ctypes.c_int]),
        "hmoe_ring_slot_bytes": (u64, [vp]),
        "hmoe_ring_pinned": (ctypes.c_int, [vp]),
        "hmoe_ring_fill": (
            ctypes.c_int,
            [vp, ctypes.c_int, ctypes.c_int, ctypes.POINTER(u64), ctypes.POINTER(u64), ctypes.POINTER(u64)],
        ),
        "hmoe_ring_wait": (
            ctypes.c_int,
            [vp, ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)],
        ),
        "hmoe_ring_release": (ctypes.c_int, [vp, ctypes.c_int]),
        "hmoe_ring_state": (ctypes.c_int, [vp, ctypes.c_int]),
        "hmoe_ring_bytes_copied": (u64, [vp]),
        "hmoe_ring_fills_done": (u64, [vp]),
        "hmoe_ring_last_error": (ctypes.c_char_p, []),
        "hmoe_monotonic_ns": (ctypes.c_int64, []),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise StagingError(f"staging ring {what}: {_lib().hmoe_ring_last_error().decode()}")


def monotonic_ns() -> int:
    """The C++ copy threads' clock (CLOCK_MONOTONIC, same as time.perf_counter_ns on Linux)."""
    return int(_lib().hmoe_monotonic_ns())


@dataclasses.dataclass(frozen=True)
class Field:
    """One sub-array of a slot: path into ExpertsParams, per-expert shape, dtype, offset."""

    path: tuple[str, str]  # ("gate", "w") | ("gate", "scale_inv") | ("gate", "") for plain arrays
    shape: tuple[int, ...]  # per expert
    dtype: np.dtype
    offset: int  # bytes from the slot start, for a group of `experts_per_slot` experts

    @property
    def expert_bytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize


def _leaves(experts: ExpertsParams) -> list[tuple[tuple[str, str], Any]]:
    out = []
    for name in ("gate", "up", "down"):
        w = getattr(experts, name)
        if isinstance(w, Fp8Tensor):
            out += [((name, "w"), w.w), ((name, "scale_inv"), w.scale_inv)]
        else:
            out.append(((name, ""), w))
    return out


def slot_layout(experts: ExpertsParams, experts_per_slot: int) -> tuple[list[Field], int]:
    """Where each of a group's arrays lives in a slot; returns (fields, slot_bytes)."""
    fields, off = [], 0
    for path, arr in _leaves(experts):
        dt = np.dtype(arr.dtype)
        f = Field(path, tuple(arr.shape[1:]), dt, off)
        fields.append(f)
        off += -(-(f.expert_bytes * experts_per_slot) // _ALIGN) * _ALIGN
    return fields, off


def host_array(x: Any) -> np.ndarray:
    """A C-contiguous numpy view of a host leaf (numpy, memmap or a CPU jax array)."""
    a = np.asarray(x)
    if not a.flags.c_contiguous:
        raise StagingError(
            f"staging: host weight of shape {a.shape} is not C-contiguous (a copy would be a second host copy)"
        )
    return a


class StagingRing:
    """R slots of slot_bytes each. fill() queues a copy of experts [lo, hi) of one layer into a
    slot; wait() blocks until it is there; views() gives the slot's ExpertsParams (numpy);
    release() frees the slot for the next fill."""

    def __init__(
        self, n_slots: int, slot_bytes: int, *, copy_threads: int = 2, link_gbps: float | None = None
    ):
        rate = 0.0 if not link_gbps else float(link_gbps) * 1e9
        self._h = _lib().hmoe_ring_create(int(n_slots), int(slot_bytes), int(copy_threads), rate)
        if not self._h:
            raise StagingError(f"staging ring create: {_lib().hmoe_ring_last_error().decode()}")
        self.n_slots = int(n_slots)
        self.slot_bytes = int(_lib().hmoe_ring_slot_bytes(self._h))
        self.link_gbps = link_gbps
        self._keep: dict[int, list[np.ndarray]] = {}  # sources stay alive until the copy is done
        self._views: dict[tuple[int, int], ExpertsParams] = {}

    @property
    def handle(self) -> int:
        return int(self._h)

    @property
    def pinned(self) -> bool:
        return bool(_lib().hmoe_ring_pinned(self._h))

    def slot_ptr(self, slot: int) -> int:
        return int(_lib().hmoe_ring_slot_ptr(self._h, slot))

    def fill(self, slot: int, segments: list[tuple[np.ndarray, int]]) -> None:
        """segments: (contiguous source array, destination offset in the slot)."""
        n = len(segments)
        src, dst, nb = (u64 * n)(), (u64 * n)(), (u64 * n)()
        for i, (a, off) in enumerate(segments):
            src[i], dst[i], nb[i] = a.ctypes.data, off, a.nbytes
        _check(_lib().hmoe_ring_fill(self._h, slot, n, src, dst, nb), f"fill slot {slot}")
        self._keep[slot] = [a for a, _ in segments]

    def fill_experts(self, slot: int, experts: ExpertsParams, lo: int, hi: int, fields: list[Field]) -> int:
        """Queue experts [lo, hi) of a layer's stacked host experts; returns bytes queued."""
        segs = []
        for f, (path, arr) in zip(fields, _leaves(experts)):
            assert f.path == path
            segs.append((host_array(arr)[lo:hi], f.offset))
        self.fill(slot, segs)
        return sum(a.nbytes for a, _ in segs)

    def wait(self, slot: int) -> tuple[int, int]:
        """Block (GIL released) until the slot is filled; returns the copy's (start_ns, end_ns)."""
        t0, t1 = ctypes.c_int64(), ctypes.c_int64()
        _check(_lib().hmoe_ring_wait(self._h, slot, ctypes.byref(t0), ctypes.byref(t1)), f"wait slot {slot}")
        self._keep.pop(slot, None)
        return int(t0.value), int(t1.value)

    def release(self, slot: int) -> None:
        _check(_lib().hmoe_ring_release(self._h, slot), f"release slot {slot}")

    def state(self, slot: int) -> str:
        return {0: "free", 1: "filling", 2: "ready"}.get(_lib().hmoe_ring_state(self._h, slot), "invalid")

    def views(self, slot: int, fields: list[Field], count: int, like: ExpertsParams) -> ExpertsParams:
        """The slot's first `count` experts as numpy views (no copy), shaped like `like`.
        Cached per (slot, count): the same view objects every time the slot is reused."""
        key = (slot, count)
        if key not in self._views:
            base = self.slot_ptr(slot)
            arrs: dict[tuple[str, str], np.ndarray] = {}
            for f in fields:
                nbytes = f.expert_bytes * count
                buf = (ctypes.c_uint8 * nbytes).from_address(base + f.offset)
                arrs[f.path] = np.frombuffer(buf, dtype=f.dtype).reshape(count, *f.shape)

            def rebuild(name: str) -> Any:
                w = getattr(like, name)
                if isinstance(w, Fp8Tensor):
                    return Fp8Tensor(
                        w=arrs[(name, "w")],
                        scale_inv=arrs[(name, "scale_inv")],
                        block_n=w.block_n,
                        block_k=w.block_k,
                    )
                return arrs[(name, "")]

            self._views[key] = ExpertsParams(gate=rebuild("gate"), up=rebuild("up"), down=rebuild("down"))
        return self._views[key]

    @property
    def bytes_copied(self) -> int:
        return int(_lib().hmoe_ring_bytes_copied(self._h))

    @property
    def fills_done(self) -> int:
        return int(_lib().hmoe_ring_fills_done(self._h))

    def close(self) -> None:
        if self._h:
            self._views.clear()
            _lib().hmoe_ring_destroy(self._h)
            self._h = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def ffi_wait(ring: StagingRing, slot: int) -> jax.Array:
    """The same wait as ring.wait, as an XLA FFI call on the host CPU: s64[2] (start, end ns)."""
    hffi.register_all()
    call = jax.ffi.ffi_call("hmoe_staging_wait", jax.ShapeDtypeStruct((2,), jnp.int64), has_side_effect=True)
    with jax.default_device(jax.devices("cpu")[0]):
        return call(ring=np.int64(ring.handle), slot=np.int32(slot))
