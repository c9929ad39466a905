"""The C++ staging ring: copies land byte-exact, slots are fixed and reused, the slot
life cycle is enforced, the rate cap holds as a lower bound, and the FFI wait agrees."""

from __future__ import annotations

import ctypes
import threading
import time

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


def test_device_ring_inplace_names_a_refused_donation():
    """A host view of an inplace result keeps its buffer alive, so XLA refuses the next
    donation (it would copy into a fresh buffer): the ring says so instead of writing
    anywhere else."""
    experts = _aligned_experts()
    fields, nbytes = slot_layout(experts, 2)
    ring = StagingRing(1, nbytes, device_ring="inplace")
    acc = jax.devices("cpu")[1]
    ring.fill_experts(0, experts, 0, 2, fields)
    ring.wait(0)
    dev = jax.block_until_ready(ring.to_device(0, fields, 2, experts, acc))
    held = np.asarray(dev.gate.w)  # a zero-copy view of the device buffer, kept alive
    ring.release(0)
    ring.fill_experts(0, experts, 2, 4, fields)
    ring.wait(0)
    with pytest.raises(StagingError, match="refused to donate slot 0"):
        ring.to_device(0, fields, 2, experts, acc)
    assert np.array_equal(held.view(np.uint8), experts.gate.w[0:2].view(np.uint8)), (
        "the held view kept its bytes"
    )


# ---------------------------------------------------------------- the extension's ring class


def test_ring_class_errors_carry_the_cpp_message():
    ext = pytest.importorskip("_hmoe_ffi")
    with pytest.raises(ext.StagingRingError, match="need n_slots >= 1.*got n_slots=0"):
        ext.StagingRing(0, 4096, 1)
    with pytest.raises(StagingError, match="staging ring create: .*copy_threads=0"):
        _ext_ring(2, 4096, 0)
    with pytest.raises(StagingError, match="copy_threads must be >= 1"):
        StagingRing(2, 4096, copy_threads=0)
    with pytest.raises(StagingError, match="link_gbps must be > 0"):
        StagingRing(2, 4096, link_gbps=-1.0)
    ring = StagingRing(2, 4096, copy_threads=3)
    assert ring.copy_threads == 3 and ring.copy_threads_why == "given"
    with pytest.raises(StagingError, match=r"slot_ptr 2: .*out of range \[0, 2\)"):
        ring.slot_ptr(2)
    with pytest.raises(StagingError, match="bind_device: slot 5 out of range"):
        _bind(ring, 4096, 5)
    ring.close()
    with pytest.raises(StagingError, match="closed"):
        ring.fill(0, [(np.zeros(8, np.uint8), 0)])
    ring.close()  # closing twice is fine


def _ext_ring(n_slots, slot_bytes, threads):
    from hmoe_jax.runtime import staging

    return staging._call("create", staging._ext().StagingRing, n_slots, slot_bytes, threads, 0.0)


def _bind(ring, ptr, slot):
    from hmoe_jax.runtime import staging

    return staging._call("bind_device", ring._ring.bind_device, ptr, slot)


def test_wait_releases_the_gil():
    """A Python thread blocked in wait() on a slow (rate-capped) fill lets another Python
    thread run: the loader waiting on a copy does not stall the compute thread."""
    nbytes, gbps = 8 * 2**20, 0.1  # ~84 ms at the cap
    ring = StagingRing(1, nbytes, copy_threads=1, link_gbps=gbps)
    ring.fill(0, [(np.ones(nbytes, np.uint8), 0)])
    entered, finished = threading.Event(), threading.Event()

    def loader():
        entered.set()
        ring.wait(0)
        finished.set()

    t = threading.Thread(target=loader)
    t.start()
    entered.wait()
    resumed_ns = time.perf_counter_ns()  # CLOCK_MONOTONIC, the C++ copy's clock
    steps = 0
    while not finished.is_set():  # pure Python: runs only while the loader does not hold the GIL
        steps += 1
    t.join()
    t0, t1 = ring.wait(0)
    assert (t1 - t0) / 1e9 >= nbytes / (gbps * 1e9) * 0.999
    # With the GIL held through the wait, this thread resumes only after the copy ended.
    assert resumed_ns < t1 - (t1 - t0) // 2 and steps > 1000, (resumed_ns - t1, steps)


def test_copy_threads_follow_the_measured_memcpy_rate(monkeypatch):
    from hmoe_jax.runtime import staging

    # ceil(link / one thread), within [1, min(cores, max)]; by hand:
    assert staging.copy_threads_for(56.0, 10.0, cores=16) == 6  # 5.6 -> 6
    assert staging.copy_threads_for(50.0, 25.0, cores=16) == 2  # exactly 2
    assert staging.copy_threads_for(56.0, 10.0, cores=4) == 4  # core bound
    assert staging.copy_threads_for(64.0, 5.0, cores=32) == 8  # 12.8 -> max 8
    assert staging.copy_threads_for(1.0, 12.0, cores=2) == 1
    with pytest.raises(StagingError, match="must be > 0"):
        staging.copy_threads_for(0.0, 10.0, cores=4)
    with pytest.raises(StagingError, match="cores"):
        staging.copy_threads_for(10.0, 10.0, cores=0)
    assert staging.memcpy_gbps_one_thread() > 0.05  # the real probe measures something
    monkeypatch.setattr(staging, "memcpy_gbps_one_thread", lambda: 7.0)
    monkeypatch.setattr(staging, "available_cores", lambda: 16)
    ring = StagingRing(1, 4096, h2d_gbps=56.0)
    assert ring.copy_threads == 8 and "56 GB/s link / 7 GB/s" in ring.copy_threads_why  # 56 / 7 = 8
    ring = StagingRing(1, 4096, link_gbps=20.0, h2d_gbps=56.0)  # the emulated cap is what the copies meet
    assert ring.copy_threads == 3  # ceil(20 / 7)
    assert StagingRing(1, 4096).copy_threads == staging.DEFAULT_COPY_THREADS
    assert StagingRing(1, 4096, copy_threads=5, h2d_gbps=56.0).copy_threads == 5


# ---------------------------------------------------------------- the GPU side, on a fake driver


def _choreography(n_slots, steps):
    ext = pytest.importorskip("_hmoe_ffi")
    log = ext._fake_cuda_choreography(n_slots, steps)
    calls = [c for c in log if not c.startswith(("cuCtxPushCurrent", "cuCtxPopCurrent", "cuStreamGetCtx"))]
    return log, calls


def test_h2d_runs_on_its_own_stream_ordered_by_events():
    """The staging put's driver calls (staging_cuda.h): DMAs on one non-blocking copy stream,
    never on XLA's stream; XLA's stream never waits on the copy (the loader blocks on the
    copied event instead); a slot's next DMA waits for the freed event recorded on XLA's
    stream when the slot was released, and the other slot's DMA does not."""
    log, calls = _choreography(
        2, [("put", 0), ("wait", 0), ("put", 1), ("release", 0), ("put", 0), ("wait", 0)]
    )
    creates = [c for c in calls if c.startswith("cuStreamCreate")]
    assert creates == ["cuStreamCreate s1 flags=1"], "one copy stream, CU_STREAM_NON_BLOCKING"
    dmas = [c for c in calls if c.startswith("cuMemcpyHtoDAsync")]
    assert len(dmas) == 6 and all(c.endswith(" on s1") for c in dmas)
    assert not any(c.startswith("cuStreamWaitEvent xla") for c in calls), "the compute stream never waits"

    def step(name):  # the calls of the step `name` ("put 0" ...), in order; occurrences joined
        out, cur = [], None
        for c in calls:
            cur = c[2:] if c.startswith("# ") else cur
            if cur == name and not c.startswith("# "):
                out.append(c)
        return out

    first_put0 = calls[calls.index("# put 0") + 1 : calls.index("# wait 0")]
    assert not any("cuStreamWaitEvent" in c for c in first_put0), "a slot's first DMA waits for nothing"
    copied0 = next(c.split()[1] for c in first_put0 if c.startswith("cuEventRecord"))
    assert f"cuEventSynchronize {copied0}" in step("wait 0")
    (freed_record,) = step("release 0")
    assert freed_record.endswith(" on xla"), "freed: recorded on XLA's stream at the release"
    freed0 = freed_record.split()[1]
    second = calls[calls.index("# release 0") + 2 :]
    i_wait = second.index(f"cuStreamWaitEvent s1 waits {freed0}")
    i_dma = next(i for i, c in enumerate(second) if c.startswith("cuMemcpyHtoDAsync"))
    assert i_wait < i_dma, "the refill of slot 0 waits for its release"
    assert not any("waits" in c for c in step("put 1")), "slot 1's DMA does not wait for slot 0's readers"
    created = {c.split()[1] for c in calls if c.startswith(("cuEventCreate", "cuStreamCreate"))}
    destroyed = {c.split()[1] for c in step("close")}
    assert created == destroyed == {"s1", "e2", "e3", "e4", "e5"}, (
        "the ring's close frees its stream and events"
    )


def test_h2d_choreography_refuses_a_refill_without_release():
    def outcome(steps):  # the "not issued" / "error: ..." lines, in order
        _, calls = _choreography(1, steps)
        return [c for c in calls if c == "not issued" or c.startswith("error")]

    assert outcome([("wait", 0), ("put", 0), ("wait", 0)]) == ["not issued"], (
        "a wait before its put was issued returns without blocking"
    )
    assert outcome([("put", 0), ("wait", 0), ("put", 0)]) == [
        "error: slot 0 was not released since its last copy"
    ]
    assert outcome([("put", 0), ("put", 0)]) == ["error: slot 0: the previous copy was not waited for"]


def test_cuda_driver_is_optional():
    """The extension links no CUDA library: it loads here, and says what it did not find."""
    ext = pytest.importorskip("_hmoe_ffi")
    missing = ext.cuda_driver_missing()
    if missing:
        assert "libcuda.so.1" in missing or "cu" in missing
    ring = StagingRing(1, 4096)  # a ring works without a driver; its GPU side is never touched
    ring.fill(0, [(np.ones(64, np.uint8), 0)])
    ring.wait(0)
    ring.release(0)


@pytest.mark.parametrize("copy_threads", [None, 3])
def test_engine_ring_copy_threads_reach_the_trace(copy_threads):
    """The engine's ring is sized like StagingRing sizes it (None: against the link cap, here
    0.2 GB/s, which one thread of any host outruns: 1 thread), and a traced prefill states the
    count and why in its plan entry."""
    from hmoe_jax.config import named_model_config
    from hmoe_jax.engine.engine import Engine
    from hmoe_jax.plan.system import SystemSpec
    from hmoe_jax.plan.trace import TraceRecorder
    from hmoe_jax.runtime import staging
    from hmoe_jax.runtime.synthetic import random_params

    cfg = named_model_config("deepseek_v3_tiny")
    eng = Engine(
        random_params(cfg, seed=5),
        cfg,
        system=SystemSpec(slp_experts_per_slot=4),
        link_gbps=0.2,
        copy_threads=copy_threads,
        expert_fn="ref",
        precision="f32",
    )
    tr = TraceRecorder()
    _, run, _, _ = eng.prefill(np.arange(2, 10), eng.new_cache(32), "slp", trace=tr)
    want = 3 if copy_threads else staging.copy_threads_for(0.2, staging.memcpy_gbps_one_thread(), 1)
    assert run.ring.copy_threads == want
    entry = tr.meta["plans"][-1]
    assert entry["copy_threads"] == want
    assert entry["copy_threads_why"] == ("given" if copy_threads else run.ring.copy_threads_why)
    assert copy_threads or "0.2 GB/s link" in entry["copy_threads_why"]
    eng.close()


def test_engine_sizes_a_dslp_ring_for_every_ranks_link(monkeypatch):
    """One host ring feeds N ranks' links in dslp: its threads are sized against N x h2d."""
    from hmoe_jax.config import named_model_config
    from hmoe_jax.engine.engine import Engine
    from hmoe_jax.plan.system import SystemSpec
    from hmoe_jax.runtime import staging
    from hmoe_jax.runtime.synthetic import random_params

    monkeypatch.setattr(staging, "memcpy_gbps_one_thread", lambda: 20.0)
    monkeypatch.setattr(staging, "available_cores", lambda: 16)
    cfg = named_model_config("deepseek_v3_tiny")
    eng = Engine(
        random_params(cfg, seed=5), cfg, devices=2, system=SystemSpec(num_accelerators=2, h2d_gbps=56.0)
    )
    slp, dslp = eng.plan("slp", 16), eng.plan("dslp", 16)
    assert dslp.meta["devices"] == 2 and "ring_slots" in dslp.meta
    assert eng.ring_for(slp).copy_threads == 3  # ceil(56 / 20)
    assert eng.ring_for(dslp).copy_threads == 6  # ceil(2 x 56 / 20)
    eng.close()


def test_cli_copy_threads_flag_is_checked(capsys):
    from hmoe_jax import cli

    base = ["generate", "--tokens", "5,6", "--quiet", "--no-warmup", "--schedule", "slp"]
    assert cli.main([*base, "--copy-threads", "0"]) == 1
    assert "--copy-threads must be >= 1, got 0" in capsys.readouterr().err
