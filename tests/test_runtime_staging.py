"""The C++ staging ring: copies land byte-exact, slots are fixed and reused, the slot
life cycle is enforced, the rate cap holds as a lower bound, and the FFI wait agrees."""

from __future__ import annotations

import ctypes

import jax
import numpy as np
import pytest

from hmoe_jax.model.params import ExpertsParams
from hmoe_jax.quant.fp8 import quantize_np
from hmoe_jax.quant.hostmem import aligned_empty
from hmoe_jax.runtime.staging import StagingError, StagingRing, _inplace_put, ffi_wait, slot_layout

pytest.importorskip("_hmoe_ffi", reason="the compiled extension is needed (tools/build_ffi.sh)")


def slot_bytes_of(ring: StagingRing, slot: int, n: int) -> np.ndarray:
    return np.frombuffer((ctypes.c_uint8 * n).from_address(ring.slot_ptr(slot)), np.uint8)


@pytest.mark.parametrize("threads", [1, 3])
def test_fill_copies_segments_exactly(threads):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 255, 3 * 2**20 + 17, dtype=np.uint8)  # > several 1 MiB chunks, odd tail
    b = rng.integers(0, 255, 1000, dtype=np.uint8)
    ring = StagingRing(2, 4 * 2**20, copy_threads=threads)
    ring.fill(1, [(a, 0), (b, a.nbytes + 64)])
    t0, t1 = ring.wait(1)
    got = slot_bytes_of(ring, 1, a.nbytes + 64 + b.nbytes)
    assert np.array_equal(got[: a.nbytes], a) and np.array_equal(got[a.nbytes + 64 :], b)
    assert t1 >= t0 > 0 and ring.bytes_copied == a.nbytes + b.nbytes and ring.fills_done == 1
    ring.close()


def test_slots_are_aligned_fixed_and_reused():
    ring = StagingRing(3, 10_000)
    ptrs = [ring.slot_ptr(s) for s in range(3)]
    assert all(p % 4096 == 0 for p in ptrs) and ring.slot_bytes % 4096 == 0
    src = np.arange(2500, dtype=np.float32)
    for rep in range(4):  # fill / wait / release every slot several times
        for s in range(3):
            ring.fill(s, [(src + rep, 0)])
        for s in range(3):
            ring.wait(s)
            assert np.array_equal(slot_bytes_of(ring, s, src.nbytes).view(np.float32), src + rep)
            ring.release(s)
    assert [ring.slot_ptr(s) for s in range(3)] == ptrs
    assert ring.fills_done == 12


def test_slot_life_cycle_errors_name_the_slot():
    ring = StagingRing(2, 4096)
    src = np.zeros(100, np.uint8)
    with pytest.raises(StagingError, match="slot 0 has no fill queued"):
        ring.wait(0)
    with pytest.raises(StagingError, match="slot 0 is not ready"):
        ring.release(0)
    with pytest.raises(StagingError, match="out of range"):
        ring.fill(2, [(src, 0)])
    with pytest.raises(StagingError, match="exceeds slot_bytes"):
        ring.fill(0, [(np.zeros(5000, np.uint8), 0)])
    ring.fill(0, [(src, 0)])
    with pytest.raises(StagingError, match="slot 0 is not free"):
        ring.fill(0, [(src, 0)])
    ring.wait(0)
    ring.release(0)
    assert ring.state(0) == "free"


def test_rate_cap_is_a_lower_bound_on_copy_time():
    nbytes = 8 * 2**20
    gbps = 0.4
    ring = StagingRing(1, nbytes, copy_threads=2, link_gbps=gbps)
    ring.fill(0, [(np.ones(nbytes, np.uint8), 0)])
    t0, t1 = ring.wait(0)
    assert (t1 - t0) / 1e9 >= nbytes / (gbps * 1e9) * 0.999


def test_ffi_wait_returns_the_copy_times():
    ring = StagingRing(1, 2**20, link_gbps=1.0)
    ring.fill(0, [(np.ones(2**20, np.uint8), 0)])
    times = np.asarray(jax.block_until_ready(ffi_wait(ring, 0)))
    assert tuple(int(t) for t in times) == ring.wait(0)
    assert times[1] - times[0] >= 2**20 * 0.999  # ns: 1 GB/s is one byte per ns


def test_expert_slot_views_alias_the_arena_zero_copy():
    e, i, d = 6, 128, 256
    rng = np.random.default_rng(1)
    q = [quantize_np(rng.normal(size=s).astype(np.float32)) for s in ((e, i, d), (e, i, d), (e, d, i))]

    def aligned(x):
        out = aligned_empty(x.shape, x.dtype)
        out[...] = x
        return out

    from hmoe_jax.quant.fp8 import Fp8Tensor

    experts = ExpertsParams(*[Fp8Tensor(w=aligned(t.w), scale_inv=aligned(t.scale_inv)) for t in q])
    fields, nbytes = slot_layout(experts, 2)
    ring = StagingRing(2, nbytes)
    ring.fill_experts(1, experts, 4, 6, fields)
    ring.wait(1)
    v = ring.views(1, fields, 2, experts)
    assert np.array_equal(v.down.w.view(np.uint8), experts.down.w[4:6].view(np.uint8))
    assert np.array_equal(v.up.scale_inv, experts.up.scale_inv[4:6])
    dev = jax.device_put(v, jax.devices("cpu")[1])  # a stand-in accelerator
    assert dev.gate.w.unsafe_buffer_pointer() == ring.slot_ptr(1) + fields[0].offset
    assert ring.views(1, fields, 2, experts) is v  # cached: the same views every reuse


def test_back_to_back_fills_are_paced_as_one_link():
    """Fills queued while the link is busy are paced from the previous fill's due time (a
    FIFO link at the cap): fill k ends no earlier than (k + 1) * bytes / rate after the first
    starts, and a copy thread that wakes late does not lower the throughput below the cap
    by much (loose upper bound: a shared machine)."""
    nbytes, gbps, n = 2 * 2**20, 0.4, 4
    ring = StagingRing(n, nbytes, copy_threads=2, link_gbps=gbps)
    src = np.ones(nbytes, np.uint8)
    for s in range(n):
        ring.fill(s, [(src, 0)])
    times = [ring.wait(s) for s in range(n)]
    per_s = nbytes / (gbps * 1e9)
    first = times[0][0]
    for k, (_, end) in enumerate(times):
        assert (end - first) / 1e9 >= (k + 1) * per_s * 0.999
    assert all(times[k + 1][0] >= times[k][1] for k in range(n - 1)), "the link copies one fill at a time"
    assert (times[-1][1] - first) / 1e9 < 2.0 * n * per_s


def _aligned_experts(e=6, i=128, d=256, seed=1):
    from hmoe_jax.quant.fp8 import Fp8Tensor

    rng = np.random.default_rng(seed)
    q = [quantize_np(rng.normal(size=s).astype(np.float32)) for s in ((e, i, d), (e, i, d), (e, d, i))]

    def aligned(x):
        out = aligned_empty(x.shape, x.dtype)
        out[...] = x
        return out

    return ExpertsParams(*[Fp8Tensor(w=aligned(t.w), scale_inv=aligned(t.scale_inv)) for t in q])


def _host_copy(a: jax.Array) -> np.ndarray:
    """The bytes of a device array, read through a copy on another device: np.asarray(a) of a
    CPU array would cache a zero-copy view on `a` itself (jax >= 0.11), which pins the buffer
    and makes XLA refuse the ring's next donation of it."""
    other = next(d for d in jax.devices("cpu") if d not in a.devices())
    return np.asarray(jax.device_put(a, other))


def _same_bytes(dev, experts, lo, hi) -> bool:
    got, want = jax.tree_util.tree_leaves(dev), jax.tree_util.tree_leaves(experts)
    return all(
        np.array_equal(_host_copy(g).view(np.uint8), w[lo:hi].view(np.uint8)) for g, w in zip(got, want)
    )


def test_device_ring_alias_is_the_slot_itself():
    experts = _aligned_experts()
    fields, nbytes = slot_layout(experts, 2)
    ring = StagingRing(2, nbytes, device_ring="alias")
    acc = jax.devices("cpu")[1]
    seen = []
    for lo in (0, 2, 4):
        ring.fill_experts(0, experts, lo, lo + 2, fields)
        ring.wait(0)
        dev = ring.to_device(0, fields, 2, experts, acc)
        # read through fresh numpy views: a jax array caches its first host copy
        assert np.array_equal(
            ring.views(0, fields, 2, experts).down.w.view(np.uint8),
            experts.down.w[lo : lo + 2].view(np.uint8),
        )
        seen.append(dev)
        ring.release(0)
    assert all(d is seen[0] for d in seen), "alias mode: the same device arrays every reuse"
    assert seen[0].gate.w.unsafe_buffer_pointer() == ring.slot_ptr(0) + fields[0].offset
    assert list(ring.device_buffers()) == [(0, 2, acc)]
    ring.close()


def test_device_ring_inplace_overwrites_fixed_buffers():
    """The GPU mode, run on a stand-in: per slot device buffers allocated once, then written in
    place (donated, FFI result aliased to its operand) by hmoe_staging_put: same addresses
    every reuse, the slot's bytes every time, and nothing new allocated."""
    experts = _aligned_experts()
    fields, nbytes = slot_layout(experts, 2)
    ring = StagingRing(2, nbytes, device_ring="inplace")
    acc = jax.devices("cpu")[1]
    with pytest.raises(StagingError, match="slot 1 is not filled"):
        ring.to_device(1, fields, 2, experts, acc)
    ring.fill_experts(1, experts, 0, 2, fields)
    ring.wait(1)
    views = jax.tree_util.tree_leaves(ring.views(1, fields, 2, experts))
    offsets = tuple(v.ctypes.data - ring.slot_ptr(1) for v in views)
    fresh = [jax.numpy.zeros(v.shape, v.dtype, device=acc) for v in views]  # not the ring's buffers
    with pytest.raises(Exception, match="not bound to a ring slot"):
        jax.block_until_ready(_inplace_put(ring.handle, offsets)(fresh))
    ring.release(1)
    ptrs = {}
    for _ in range(2):
        for slot, lo in ((0, 4), (1, 2), (0, 0), (1, 4)):
            ring.fill_experts(slot, experts, lo, lo + 2, fields)
            ring.wait(slot)
            dev = jax.block_until_ready(ring.to_device(slot, fields, 2, experts, acc))
            assert _same_bytes(dev, experts, lo, lo + 2)
            p = tuple(a.unsafe_buffer_pointer() for a in jax.tree_util.tree_leaves(dev))
            assert ptrs.setdefault(slot, p) == p, f"slot {slot}'s device buffers moved"
            assert p[0] != ring.slot_ptr(slot) + fields[0].offset  # a copy, unlike alias mode
            ring.release(slot)
    assert sorted(k[0] for k in ring.device_buffers()) == [0, 1]
    ring.close()
