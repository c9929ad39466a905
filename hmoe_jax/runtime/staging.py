"""Python side of the C++ staging ring (xla_ffi/src/staging.cc): an aligned (pinned where
cudart is present) host arena of R slots, filled by background C++ copy threads from the
host weight arena, optionally at a capped rate (link emulation).

The ring is the extension's class `_hmoe_ffi.StagingRing` (nanobind; its blocking calls
release the GIL, so a Python loader thread waiting on a fill does not stall the compute
thread); the same wait is also an XLA FFI target (`hmoe_staging_wait`) so a computation can
block on a slot itself. A filled slot is viewed as numpy arrays without a copy and handed to
the accelerator by `StagingRing.to_device`, whose device side is a fixed ring too
(`device_ring` modes): "alias" (CPU stand-ins: the device arrays ARE the slot's memory,
created once per slot and reused, zero-copy), "inplace" (GPUs: per slot preallocated device
buffers, overwritten in place by the FFI target hmoe_staging_put, donated; on a GPU one
host->device DMA from the page-locked slot on the ring's own copy stream, ordered by CUDA
events: staging_cuda.h) and "put" (plain jax.device_put each time: XLA's allocator gives a
new device buffer per group; the behaviour before the device ring).

Copy threads: `copy_threads=None` sizes them from a measurement, ceil(link rate / one
thread's memcpy rate) within [1, min(cores, MAX_COPY_THREADS)] (copy_threads_for).
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
from hmoe_jax.plan import system
from hmoe_jax.plan.costs import SLOT_ALIGN_BYTES
from hmoe_jax.plan.system import MAX_COPY_THREADS
from hmoe_jax.quant.fp8 import Fp8Tensor

_ALIGN = SLOT_ALIGN_BYTES  # sub-array alignment inside a slot (>= 64 for zero-copy device_put)
DEFAULT_COPY_THREADS = 2  # without a link rate to size against (the count before sizing)
_PROBE_BYTES = 64 << 20  # well over L2, so the probe times DRAM -> DRAM like a real fill


class StagingError(RuntimeError):
    pass


def _ext() -> Any:
    ext = hffi.extension()
    if not hasattr(ext, "StagingRing"):  # an extension built before the ring was a class
        raise StagingError(
            f"the compiled extension {ext.__file__} has no StagingRing class (built from older sources); "
            "rebuild it: pip install . (or tools/build_ffi.sh build/dev; PYTHONPATH=build/dev)"
        )
    return ext


def _call(what: str, fn, *args) -> Any:
    """A call into the C++ ring with its error as a StagingError naming `what`."""
    try:
        return fn(*args)
    except _ext().StagingRingError as e:
        raise StagingError(f"staging ring {what}: {e}") from None


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@functools.cache
def memcpy_gbps_one_thread() -> float:
    """One thread's memcpy rate on this host (GB/s): best of 3 copies of 64 MiB (~30 ms),
    measured once per process by the extension (the copy threads' own memcpy)."""
    return float(_ext().memcpy_gbps(_PROBE_BYTES, 3))


def copy_threads_for(
    link_gbps: float, one_thread_gbps: float, cores: int, max_threads: int = MAX_COPY_THREADS
) -> int:
    """plan/system.copy_threads_for (ceil(link / one thread's rate) within [1, min(cores,
    max_threads)]), bad input as a StagingError."""
    try:
        return system.copy_threads_for(link_gbps, one_thread_gbps, cores, max_threads)
    except ValueError as e:
        raise StagingError(str(e)) from None


def size_copy_threads(copy_threads: int | None, link_gbps: float | None) -> tuple[int, str]:
    """(copy threads, why): `copy_threads` as given, else sized against `link_gbps` (the
    emulated cap or the accelerator's host link) from this host's measured memcpy rate."""
    if copy_threads is not None:
        if int(copy_threads) < 1:
            raise StagingError(
                f"copy_threads must be >= 1 (or None: sized automatically), got {copy_threads}"
            )
        return int(copy_threads), "given"
    if not link_gbps:
        return DEFAULT_COPY_THREADS, "default: no link rate to size against"
    one, cores = memcpy_gbps_one_thread(), available_cores()
    n = copy_threads_for(float(link_gbps), one, cores)
    return n, (
        f"ceil({float(link_gbps):.3g} GB/s link / {one:.3g} GB/s one-thread memcpy), "
        f"within [1, min({cores} cores, {MAX_COPY_THREADS})]"
    )


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
    to_device() hands it to an accelerator; release() frees the slot for the next fill.

    copy_threads: host memcpy threads (None: sized by size_copy_threads against link_gbps,
    else h2d_gbps); link_gbps: cap the copies at this rate (link emulation); h2d_gbps: the
    accelerator's host link, only to size the threads. In "inplace" mode the arrays that
    to_device returns for a slot are donated (deleted) by that slot's next to_device."""

    def __init__(
        self,
        n_slots: int,
        slot_bytes: int,
        *,
        copy_threads: int | None = None,
        link_gbps: float | None = None,
        device_ring: str = "auto",
        h2d_gbps: float | None = None,
    ):
        if link_gbps is not None and not link_gbps > 0:
            raise StagingError(f"staging ring: link_gbps must be > 0 (or None: no cap), got {link_gbps}")
        self.copy_threads, self.copy_threads_why = size_copy_threads(copy_threads, link_gbps or h2d_gbps)
        rate = 0.0 if not link_gbps else float(link_gbps) * 1e9
        self._ring = _call(
            "create", _ext().StagingRing, int(n_slots), int(slot_bytes), self.copy_threads, rate
        )
        self.n_slots = int(n_slots)
        self.slot_bytes = int(self._ring.slot_bytes)
        self.link_gbps = link_gbps
        self._keep: dict[int, list[np.ndarray]] = {}  # sources stay alive until the copy is done
        self._views: dict[tuple[int, int], ExpertsParams] = {}
        self.device_ring = device_ring  # see device_ring_mode
        self._dev: dict[tuple[int, int, jax.Device], ExpertsParams] = {}  # the device-side ring
        self._dma_client: Any = None  # the XLA client the arena is registered with (GPU)
        self._puts: dict[int, int] = {}  # CUDA puts dispatched per slot (DeviceCopier's generations)

    @property
    def handle(self) -> int:
        return int(_call("handle", lambda: self._ring.handle))

    @property
    def pinned(self) -> bool:
        return bool(self._ring.pinned) or bool(self._dma_client)

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
        was_pinned = bool(self._ring.set_pinned(False))
        try:
            device.client.dma_map(self.slot_ptr(0), self.n_slots * self.slot_bytes)
            self._dma_client = device.client
        except Exception:
            self._dma_client = False
            if was_pinned:
                self._ring.set_pinned(True)

    def slot_ptr(self, slot: int) -> int:
        return int(_call(f"slot_ptr {slot}", self._ring.slot_ptr, int(slot)))

    def fill(self, slot: int, segments: list[tuple[np.ndarray, int]]) -> None:
        """segments: (contiguous source array, destination offset in the slot)."""
        segs = [(a.ctypes.data, int(off), a.nbytes) for a, off in segments]
        _call(f"fill slot {slot}", self._ring.fill, int(slot), segs)
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
        t0, t1 = _call(f"wait slot {slot}", self._ring.wait, int(slot))
        self._keep.pop(slot, None)
        return int(t0), int(t1)

    def release(self, slot: int) -> None:
        """Free the slot for its next fill (on a GPU also the point, in XLA's stream order,
        after which the next DMA may overwrite the slot's device buffers)."""
        _call(f"release slot {slot}", self._ring.release, int(slot))

    def state(self, slot: int) -> str:
        return {0: "free", 1: "filling", 2: "ready"}.get(
            _call("state", self._ring.state, int(slot)), "invalid"
        )

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
            _call("bind_device", self._ring.bind_device, first.unsafe_buffer_pointer(), int(slot))
        leaves, treedef = jax.tree_util.tree_flatten(dev)
        base = self.slot_ptr(slot)
        offsets = tuple(v.ctypes.data - base for v in jax.tree_util.tree_leaves(views))
        try:
            out = _inplace_put(self.handle, offsets)(leaves)
        except Exception as e:
            if not all(a.is_deleted() for a in leaves):
                raise _refused_donation(slot) from e
            raise
        if not all(a.is_deleted() for a in leaves):
            raise _refused_donation(slot)
        if device.platform != "cpu":
            self._puts[slot] = self._puts.get(slot, 0) + 1
            self._wait_device(slot, self._puts[slot], out)
        dev = jax.tree_util.tree_unflatten(treedef, out)
        self._dev[key] = dev
        return dev

    def _wait_device(self, slot: int, generation: int, out: list[jax.Array]) -> None:
        """GPU: the put's DMA went to the ring's copy stream; block (GIL released) until it
        landed, so the load op completes, and its consumers launch, only after it
        (staging_cuda.h). XLA may launch the put after jit returned, so first wait until it
        was issued; if XLA finished the put without issuing it, surface its error."""
        while not _call(f"wait_device slot {slot}", self._ring.wait_device, int(slot), generation, 0.05):
            if all(a.is_ready() for a in out):
                jax.block_until_ready(out)  # raises the handler's error, if it failed
                if not _call(f"wait_device slot {slot}", self._ring.wait_device, int(slot), generation, 0.0):
                    raise StagingError(f"to_device: the put of slot {slot} finished without issuing its copy")

    def device_buffers(self) -> dict[tuple[int, int, jax.Device], list[int]]:
        """(slot, count, device) -> addresses of the device-side ring's buffers (tests, docs)."""
        return {
            k: [a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(v)] for k, v in self._dev.items()
        }

    @property
    def bytes_copied(self) -> int:
        return int(self._ring.bytes_copied)

    @property
    def fills_done(self) -> int:
        return int(self._ring.fills_done)

    def close(self) -> None:
        if not self._ring.closed:
            self._dev.clear()  # alias-mode arrays point into the arena
            if self._dma_client:
                self._dma_client.dma_unmap(self.slot_ptr(0))
                self._dma_client = None
            self._views.clear()
            self._ring.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _refused_donation(slot: int) -> StagingError:
    return StagingError(
        f"device_ring='inplace': XLA refused to donate slot {slot}'s device buffers, so it could not "
        "overwrite them in place. Something still holds them: a host view of a previous to_device "
        "result (on a CPU device, np.asarray(array) of jax >= 0.11 caches a zero-copy view on the "
        "array, which pins its buffer for the array's lifetime); read such arrays through a copy "
        "(np.asarray(jax.device_put(a, other_device))), or use device_ring='put'"
    )


def ffi_wait(ring: StagingRing, slot: int) -> jax.Array:
    """The same wait as ring.wait, as an XLA FFI call on the host CPU: s64[2] (start, end ns)."""
    hffi.register_all()
    call = jax.ffi.ffi_call("hmoe_staging_wait", jax.ShapeDtypeStruct((2,), jnp.int64), has_side_effect=True)
    with jax.default_device(jax.devices("cpu")[0]):
        return call(ring=np.int64(ring.handle), slot=np.int32(slot))
