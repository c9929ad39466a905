"""Python side of the C++ staging ring (xla_ffi/src/staging.cc): an aligned (pinned where
cudart is present) host arena of R slots, filled by background C++ copy threads from the
host weight arena, optionally at a capped rate (link emulation).

Control goes through the extension's C API with ctypes (calls release the GIL, so a
Python loader thread waiting on a fill does not stall the compute thread); the same wait is
also an XLA FFI target (`hmoe_staging_wait`) so a computation can block on a slot itself.
A filled slot is viewed as numpy arrays without a copy and handed to the accelerator by
`StagingRing.to_device`, whose device side is a fixed ring too (`device_ring` modes):
"alias" (CPU stand-ins: the device arrays ARE the slot's memory, created once per slot and
reused, zero-copy), "inplace" (GPUs: per slot preallocated device buffers, overwritten in
place by the FFI target hmoe_staging_put, donated, one host->device DMA from the page-locked
slot, nothing allocated per group) and "put" (plain jax.device_put each time: XLA's
allocator gives a new device buffer per group; the behaviour before the device ring).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
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
        "hmoe_ring_bind_device": (ctypes.c_int, [vp, u64, ctypes.c_int]),
        "hmoe_ring_set_pinned": (ctypes.c_int, [vp, ctypes.c_int]),
    }
    for name, (res, args) in sig.items():
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise StagingError(f"staging ring {what}: {_lib().hmoe_ring_last_error().decode()}")


DEVICE_RING_MODES = ("alias", "inplace", "put")


def device_ring_mode(device: jax.Device, requested: str = "auto") -> str:
    """The device-side ring mode for `device`: "auto" (or the HMOE_DEVICE_RING environment
    variable, when set) is "alias" on a CPU stand-in and "inplace" on a GPU."""
    mode = os.environ.get("HMOE_DEVICE_RING", "auto") if requested == "auto" else requested
    if mode == "auto":
        mode = "alias" if device.platform == "cpu" else "inplace"
    if mode not in DEVICE_RING_MODES:
        raise StagingError(f"device_ring={mode!r} not in {('auto', *DEVICE_RING_MODES)}")
    if mode == "alias" and device.platform != "cpu":
        raise StagingError(f"device_ring='alias' needs a CPU device (the slot memory itself), got {device}")
    return mode


@functools.cache
def _inplace_put(ring_handle: int, offsets: tuple[int, ...]):
    """jit(put)(device slot buffers) -> the same buffers, overwritten in place with the host
    slot's bytes at `offsets` (donated; the FFI result aliases each operand)."""
    hffi.register_all()

    def put(bufs):
        call = jax.ffi.ffi_call(
            "hmoe_staging_put",
            [jax.ShapeDtypeStruct(b.shape, b.dtype) for b in bufs],
            input_output_aliases={i: i for i in range(len(bufs))},
        )
        return call(*bufs, ring=np.int64(ring_handle), offsets=np.asarray(offsets, np.int64))

    return jax.jit(put, donate_argnums=0)


@functools.cache
def _register_cuda_put() -> None:
    hffi.register_all()
    handler = hffi.extension().registrations()["hmoe_staging_put_cuda"]
    jax.ffi.register_ffi_target("hmoe_staging_put", handler, platform="CUDA")


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
        self,
        n_slots: int,
        slot_bytes: int,
        *,
        copy_threads: int = 2,
        link_gbps: float | None = None,
        device_ring: str = "auto",
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
        self.device_ring = device_ring  # see device_ring_mode
        self._dev: dict[tuple[int, int, jax.Device], ExpertsParams] = {}  # the device-side ring
        self._dma_client: Any = None  # the XLA client the arena is registered with (GPU)

    @property
    def handle(self) -> int:
        return int(self._h)

    @property
    def pinned(self) -> bool:
        return bool(_lib().hmoe_ring_pinned(self._h)) or bool(self._dma_client)

    def _register_with_xla(self, device: jax.Device) -> None:
        """On a GPU, page-lock the arena through XLA (Client.dma_map) instead of our own
        cudaHostRegister: XLA then knows the range is DMA-mapped, so a plain device_put of a
        slot view is one DMA from the arena ("put" mode: PjRt skips its pinned staging
        copy), and the in-place copies read pinned memory as before. Tried once; on failure
        the ring keeps its own pinning. Untested here (no GPU)."""
        if self._dma_client is not None or device.platform == "cpu":
            return
        if os.environ.get("HMOE_STAGING_PIN") == "0":
            self._dma_client = False
            return
        was_pinned = bool(_lib().hmoe_ring_set_pinned(self._h, 0))
        try:
            device.client.dma_map(self.slot_ptr(0), self.n_slots * self.slot_bytes)
            self._dma_client = device.client
        except Exception:
            self._dma_client = False
            if was_pinned:
                _lib().hmoe_ring_set_pinned(self._h, 1)

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

    def to_device(
        self, slot: int, fields: list[Field], count: int, like: ExpertsParams, device: jax.Device
    ) -> ExpertsParams:
        """The filled slot's experts on `device` (the slot must be ready: wait() first).
        "alias" and "inplace" keep one fixed set of device arrays per (slot, count): the
        device-side ring never grows after its first use of each slot."""
        if self.state(slot) != "ready":
            raise StagingError(
                f"to_device: slot {slot} is not filled (state {self.state(slot)}); wait() first"
            )
        views = self.views(slot, fields, count, like)
        mode = device_ring_mode(device, self.device_ring)
        self._register_with_xla(device)
        if mode == "put":
            return jax.device_put(views, device)
        key = (slot, count, device)
        dev = self._dev.get(key)
        if mode == "alias":
            if dev is None:
                dev = jax.device_put(views, device)
                for v, d in zip(jax.tree_util.tree_leaves(views), jax.tree_util.tree_leaves(dev)):
                    if d.unsafe_buffer_pointer() != v.ctypes.data:
                        raise StagingError(
                            f"device_ring='alias': device_put of slot {slot} copied (the view at "
                            f"{v.ctypes.data:#x} is not usable zero-copy); use device_ring='put'"
                        )
                self._dev[key] = dev
            # The slot's memory itself: the fill already updated it. (Read it through views(),
            # not np.asarray(dev): a jax array caches its first host copy.)
            return dev
        if device.platform != "cpu":
            _register_cuda_put()
        if dev is None:  # allocate this slot's device buffers once
            dev = jax.tree_util.tree_map(lambda v: jax.numpy.zeros(v.shape, v.dtype, device=device), views)
            first = jax.block_until_ready(jax.tree_util.tree_leaves(dev))[0]
            _check(_lib().hmoe_ring_bind_device(self._h, first.unsafe_buffer_pointer(), slot), "bind_device")
        leaves, treedef = jax.tree_util.tree_flatten(dev)
        base = self.slot_ptr(slot)
        offsets = tuple(v.ctypes.data - base for v in jax.tree_util.tree_leaves(views))
        dev = jax.tree_util.tree_unflatten(treedef, _inplace_put(self.handle, offsets)(leaves))
        self._dev[key] = dev
        return dev

    def device_buffers(self) -> dict[tuple[int, int, jax.Device], list[int]]:
        """(slot, count, device) -> addresses of the device-side ring's buffers (tests, docs)."""
        return {
            k: [a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(v)] for k, v in self._dev.items()
        }

    @property
    def bytes_copied(self) -> int:
        return int(_lib().hmoe_ring_bytes_copied(self._h))

    @property
    def fills_done(self) -> int:
        return int(_lib().hmoe_ring_fills_done(self._h))

    def close(self) -> None:
        if self._h:
            self._dev.clear()  # alias-mode arrays point into the arena
            if self._dma_client:
                self._dma_client.dma_unmap(self.slot_ptr(0))
                self._dma_client = None
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
