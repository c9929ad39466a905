"""SLP on stand-in accelerators: every expert byte streamed exactly once per prefill, the
ring's slots reused at fixed addresses (the accelerator reads the staging arena without a
copy), no second host copy of the weights (RSS bound), and with link emulation the trace
shows layer i+1's copies overlapping layer i's compute (absent when overlap is disabled)."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import jax
import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.engine.engine import Engine
from hmoe_jax.model.generate import greedy_rollout, teacher_forced_logits
from hmoe_jax.model.params import MoEParams
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.plan.trace import TraceRecorder
from hmoe_jax.quant.fp8 import FP8_DTYPE, Fp8Tensor
from hmoe_jax.quant.hostmem import aligned_empty
from hmoe_jax.runtime import executor as X
from hmoe_jax.runtime.staging import StagingRing, slot_layout
from hmoe_jax.runtime.synthetic import random_params
from tests.helpers import wide_moe_config

pytest.importorskip("_hmoe_ffi", reason="the compiled extension is needed (tools/build_ffi.sh)")

SYS = SystemSpec(slp_experts_per_slot=4)


@functools.cache
def tiny():
    cfg = named_model_config("deepseek_v3_tiny")  # FP8
    return cfg, random_params(cfg, seed=5)


def expert_leaves(experts):
    return [
        a
        for t in (experts.gate, experts.up, experts.down)
        for a in ((t.w, t.scale_inv) if isinstance(t, Fp8Tensor) else (t,))
    ]


def test_slp_streams_every_expert_byte_exactly_once():
    cfg, params = tiny()
    eng = Engine(params, cfg, system=SYS, expert_fn="ref", precision="f32")
    ids = np.arange(2, 18)
    for _ in range(2):  # also on a reused ring
        cache = eng.new_cache(64)
        _, run, _, plan = eng.prefill(ids, cache, "slp")
        before = run.ring.bytes_copied
        _, run, _, plan = eng.prefill(ids, eng.new_cache(64), "slp")
        per_layer = {
            i: sum(a.nbytes for a in expert_leaves(e))
            for i, e in enumerate(eng.weights.host_experts)
            if e is not None
        }
        assert run.streamed_bytes == per_layer
        assert run.ring.bytes_copied - before == sum(per_layer.values())
    eng.close()


def test_ring_slots_reused_at_fixed_addresses_zero_copy(monkeypatch):
    cfg, params = tiny()
    eng = Engine(params, cfg, system=SYS, expert_fn="ref", precision="f32")
    seen: dict[int, set] = {}
    load = X.HANDLERS["load"]

    def spy(run, op):
        outs = load(run, op)
        seen.setdefault(op.args["slot"], set()).add(
            (op.layer, tuple(a.unsafe_buffer_pointer() for a in outs))
        )
        return outs

    monkeypatch.setitem(X.HANDLERS, "load", spy)
    _, run, _, plan = eng.prefill(np.arange(2, 14), eng.new_cache(64), "slp", ring_slots=2)
    assert plan.meta["ring_slots"] == 2 and sorted(seen) == [0, 1]
    for slot, uses in seen.items():
        layers = {layer for layer, _ in uses}
        addrs = {ptrs for _, ptrs in uses}
        assert len(layers) == cfg.num_hidden_layers - cfg.first_k_dense_replace
        assert len(addrs) == 1, f"slot {slot} moved between uses: {addrs}"
        base = run.ring.slot_ptr(slot)
        assert all(base <= p < base + run.ring.slot_bytes for p in next(iter(addrs)))
    eng.close()


def _rss_anon_bytes() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("RssAnon not in /proc/self/status")


def big_model(num_hidden_layers: int):
    """64 experts of 3 x 512 x 512 FP8 per MoE layer (~50 MB), written straight into aligned
    host arrays (random e4m3 bytes, fixed scales): the one host copy."""
    cfg = wide_moe_config(num_hidden_layers)
    params = random_params(dataclasses.replace(cfg, n_routed_experts=4, n_group=1, topk_group=1), seed=1)
    rng = np.random.default_rng(2)
    e, i, d = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size

    def fp8(shape):
        w = aligned_empty(shape, FP8_DTYPE)
        w.view(np.uint8)[...] = rng.integers(0, 0x38, shape, dtype=np.uint8) | (
            rng.integers(0, 2, shape, dtype=np.uint8) << 7
        )
        s = aligned_empty((shape[0], shape[1] // 128, shape[2] // 128), np.float32)
        s[...] = 0.01
        return Fp8Tensor(w=w, scale_inv=s)

    layers = []
    for lp in params.layers:
        if isinstance(lp.ffn, MoEParams):
            ex = lp.ffn.experts.replace(gate=fp8((e, i, d)), up=fp8((e, i, d)), down=fp8((e, d, i)))
            router = rng.normal(0, 0.05, (e, d)).astype(np.float32)
            lp = lp.replace(
                ffn=lp.ffn.replace(experts=ex, router=router, router_bias=np.zeros(e, np.float32))
            )
        layers.append(lp)
    params = params.replace(layers=tuple(layers))
    weight_bytes = sum(
        a.nbytes for lp in layers if isinstance(lp.ffn, MoEParams) for a in expert_leaves(lp.ffn.experts)
    )
    return cfg, params, weight_bytes


def test_no_second_host_copy_during_slp():
    """Experts of 4 MoE layers, ~200 MB of FP8, in one aligned host copy; an SLP prefill
    (ring of 2 slots of 2 experts) may not grow anonymous memory by anything near their size.

    A 2-layer twin with the same shapes runs first, so XLA's compilations (shape-keyed,
    ~130 MB here) and the worker threads' malloc arenas are not counted."""
    sys = dataclasses.replace(SYS, slp_experts_per_slot=2)
    ids = np.arange(2, 34)
    twin_cfg, twin_params, _ = big_model(2)
    twin = Engine(twin_params, twin_cfg, system=sys, expert_fn="ref", precision="f32")
    for _ in range(2):
        twin.prefill(ids, twin.new_cache(64), "slp", ring_slots=2)
    twin.close()
    cfg, params, weight_bytes = big_model(5)
    assert weight_bytes > 150e6
    eng = Engine(params, cfg, system=sys, expert_fn="ref", precision="f32")
    assert eng.weights.host_copied_bytes < 0.05 * weight_bytes  # the aligned experts were taken as they are
    peak, stop = [0], threading.Event()
    r0 = _rss_anon_bytes()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_anon_bytes() - r0)
            stop.wait(0.001)

    t = threading.Thread(target=sample)
    t.start()
    try:
        _, run, _, plan = eng.prefill(ids, eng.new_cache(64), "slp", ring_slots=2)
    finally:
        stop.set()
        t.join()
    peak[0] = max(peak[0], _rss_anon_bytes() - r0)
    assert sum(run.streamed_bytes.values()) == weight_bytes
    # expected: the ring (2 slots x 2 experts, ~3 MB) + one group's f32 dequantization inside
    # the grouped GEMM (~6 MB, transient); a second copy of one layer's experts adds 50 MB
    print(f"SLP RssAnon peak delta {peak[0] / 1e6:.1f} MB for {weight_bytes / 1e6:.0f} MB of experts")
    assert peak[0] < 0.25 * weight_bytes, (
        f"RssAnon grew by {peak[0] / 1e6:.0f} MB during SLP ({weight_bytes / 1e6:.0f} MB of experts)"
    )
    eng.close()


def _intersects(a, b) -> bool:
    return a["ts_us"] < b["ts_us"] + b["dur_us"] and b["ts_us"] < a["ts_us"] + a["dur_us"]


def _slices(trace: TraceRecorder):
    return [
        {
            "resource": s["resource"],
            "kind": s["name"].split()[0],
            "layer": s["args"]["layer"],
            "ts_us": s["start_ns"] / 1e3,
            "dur_us": (s["end_ns"] - s["start_ns"]) / 1e3,
        }
        for s in trace.slices
    ]


def overlapping_layers(trace: TraceRecorder) -> set[int]:
    """Layers i such that some copy (load) slice of layer i+1 intersects a compute slice of layer i."""
    sl = _slices(trace)
    loads = [s for s in sl if s["kind"] == "load"]
    comp = [s for s in sl if s["resource"].startswith("acc") and s["layer"] >= 0]
    return {c["layer"] for c in comp for ld in loads if ld["layer"] == c["layer"] + 1 and _intersects(ld, c)}


@pytest.mark.parametrize("mode", ["pipelined", "serial"])
def test_trace_shows_next_layer_copy_overlapping_compute(mode):
    cfg, params = tiny()
    # ~1.6 MB of experts per layer at 0.2 GB/s: ~8 ms of copies per layer; compute capped
    # so that a slice is long enough to be seen (emulation only).
    eng = Engine(
        params, cfg, system=SYS, link_gbps=0.2, acc_tflops_cap=1e-4, expert_fn="ref", precision="f32"
    )
    ids = np.arange(2, 18)
    eng.prefill(ids, eng.new_cache(64), "slp", mode=mode)  # compile
    tr = TraceRecorder()
    eng.prefill(ids, eng.new_cache(64), "slp", mode=mode, trace=tr)
    got = overlapping_layers(tr)
    if mode == "pipelined":
        assert got, "no copy of layer i+1 overlaps compute of layer i"
    else:
        assert not got, f"serial mode overlapped at layers {got}"
    tracks = {s["resource"] for s in tr.slices}
    assert {"h2d:0", "acc:0", "unload:0"} <= tracks
    eng.close()


def _op_slices(trace: TraceRecorder, kind: str) -> list[dict]:
    return sorted((s for s in trace.slices if s["name"].split()[0] == kind), key=lambda s: s["args"]["op"])


@pytest.mark.parametrize("mode", ["pipelined", "serial"])
def test_copy_of_next_group_starts_before_the_load_of_this_one_ends(mode, monkeypatch):
    """Double buffering, from the C++ copy clock in the load slices' args: with a capped link
    and a free slot for every group, the memcpy of group g+1 is already running when the
    load of group g ends (pipelined); serial mode (the baseline) starts it only after."""
    # Each hand-off to the accelerator takes handoff_s more. Without it a load ends within
    # ~0.1 ms of its copy, and whether the link thread has started the next copy by then is
    # a race a busy 2-core CI box lost (3/11 pairs ahead): the property under test is that
    # the next copy does not wait for the load, which the margin shows and serial mode's
    # ordering (it waits by construction) does not depend on.
    handoff_s = 0.02
    to_device = StagingRing.to_device

    def slow_to_device(self, *a, **kw):
        out = to_device(self, *a, **kw)
        time.sleep(handoff_s)
        return out

    monkeypatch.setattr(StagingRing, "to_device", slow_to_device)
    cfg, params = tiny()
    eng = Engine(params, cfg, system=SYS, link_gbps=0.5, expert_fn="ref")
    groups = (
        (cfg.num_hidden_layers - cfg.first_k_dense_replace) * cfg.n_routed_experts // SYS.slp_experts_per_slot
    )
    ids = np.arange(2, 18)
    eng.prefill(ids, eng.new_cache(64), "slp", mode=mode, ring_slots=groups)  # compile
    tr = TraceRecorder()
    _, _, _, plan = eng.prefill(ids, eng.new_cache(64), "slp", mode=mode, trace=tr, ring_slots=groups)
    assert plan.kind_counts()["stage"] == groups and plan.meta["double_buffer"]
    loads = _op_slices(tr, "load")
    assert len(loads) == groups
    pairs = list(zip(loads, loads[1:]))
    for a, b in pairs:
        assert a["args"]["copy_end_ns"] <= b["args"]["copy_start_ns"], "the link copies one group at a time"
    ahead = [b["args"]["copy_start_ns"] < a["end_ns"] for a, b in pairs]
    if mode == "pipelined":
        # The C++ link thread starts the next queued copy within microseconds of the last one,
        # ~20 ms before the load ends; a link thread descheduled for longer than that now and
        # then on a busy 2-core machine should not fail the test: ask for most pairs, not all.
        assert sum(ahead) >= 2 * len(pairs) / 3, (
            f"copy of g+1 ahead of the end of load g in {sum(ahead)}/{len(pairs)}"
        )
    else:
        assert not any(ahead), "serial mode overlapped a copy with the previous load"
    copies = [s for s in tr.slices if s["resource"] == "copy:0"]
    assert [(s["start_ns"], s["end_ns"]) for s in copies] == [
        (s["args"]["copy_start_ns"], s["args"]["copy_end_ns"]) for s in loads
    ]
    eng.close()


def test_no_slot_is_overwritten_while_its_gemm_runs(monkeypatch):
    """A tight ring (2 slots) and a stager that always runs ahead: every grouped GEMM finds its
    slot holding its own experts before it starts and still after it finished (on the
    stand-in the device arrays are the slot's memory, so a premature refill would show)."""
    cfg, params = tiny()
    eng = Engine(params, cfg, system=SYS, link_gbps=2.0, acc_tflops_cap=1e-3, expert_fn="ref")
    gemm = X.HANDLERS["experts_acc"]
    checked = []

    def holds_own_experts(run, op):
        lo, hi = op.args["experts"]
        host = run.weights.host_experts[op.layer]
        fields, _ = slot_layout(host, hi - lo)
        view = run.ring.views(int(op.args["slot"]), fields, hi - lo, host)
        return all(
            np.array_equal(v.view(np.uint8), h[lo:hi].view(np.uint8))
            for v, h in zip(expert_leaves(view), expert_leaves(host))
        )

    def spy(run, op):
        assert holds_own_experts(run, op), f"op {op.id}: slot {op.args['slot']} overwritten before its GEMM"
        outs = gemm(run, op)
        jax.block_until_ready(outs)
        time.sleep(0.002)  # give a premature refill time to land
        assert holds_own_experts(run, op), f"op {op.id}: slot {op.args['slot']} overwritten during its GEMM"
        checked.append(op.id)
        return outs

    monkeypatch.setitem(X.HANDLERS, "experts_acc", spy)
    _, run, _, plan = eng.prefill(np.arange(2, 18), eng.new_cache(64), "slp", ring_slots=2)
    assert len(checked) == plan.kind_counts()["experts_acc"]
    assert all(run.ring.state(s) == "free" for s in range(2))
    eng.close()


@pytest.mark.parametrize("device_ring", ["alias", "inplace"])
def test_device_ring_does_not_grow_across_prefills(device_ring, monkeypatch):
    """The device side of the ring: one fixed set of buffers per slot, reused by every layer and
    every prefill (alias: the slot's own memory; inplace, the GPU mode: buffers written in
    place), and the device arrays the GEMMs get are those buffers."""
    monkeypatch.setenv("HMOE_DEVICE_RING", device_ring)
    cfg, params = tiny()
    eng = Engine(params, cfg, system=SYS, expert_fn="ref")
    got: set = set()
    load = X.HANDLERS["load"]

    def spy(run, op):
        outs = load(run, op)
        got.add((op.args["slot"], tuple(a.unsafe_buffer_pointer() for a in outs)))
        return outs

    monkeypatch.setitem(X.HANDLERS, "load", spy)
    ids = np.arange(2, 14)
    _, run, _, _ = eng.prefill(ids, eng.new_cache(64), "slp", ring_slots=3)
    ring = run.ring
    first = ring.device_buffers()
    for _ in range(2):
        eng.prefill(ids, eng.new_cache(64), "slp", ring_slots=3)
        assert ring.device_buffers() == first
    assert sorted(k[0] for k in first) == [0, 1, 2]  # one buffer set per slot (4 experts each)
    assert {slot for slot, _ in got} == {0, 1, 2} and len(got) == 3, "a slot's device buffers moved"
    for (slot, _, _), ptrs in first.items():
        base = ring.slot_ptr(slot)
        inside = all(base <= p < base + ring.slot_bytes for p in ptrs)
        assert inside == (device_ring == "alias")
    eng.close()


@functools.cache
def _reference():
    cfg, params = tiny()
    prompt = [int(t) for t in np.random.default_rng(7).integers(2, cfg.vocab_size, 12)]
    return (
        prompt,
        greedy_rollout(params, cfg, prompt, 4),
        teacher_forced_logits(params, cfg, prompt),
    )


@pytest.mark.parametrize(
    "double_buffer,device_ring",
    [(True, "alias"), (True, "inplace"), (False, "put")],
    ids=["staged-alias", "staged-inplace", "before-put"],
)
def test_slp_loader_variants_give_the_reference_rollout(double_buffer, device_ring, monkeypatch):
    """Same tokens and prefill logits as the reference rollout (tolerance: that of
    tests/test_schedules_invariant.py, f32 rounding of a different association)."""
    monkeypatch.setenv("HMOE_DEVICE_RING", device_ring)
    cfg, params = tiny()
    prompt, ref_tokens, ref_logits = _reference()
    eng = Engine(params, cfg, system=SYS, expert_fn="ref", precision="f32")
    res = eng.generate(prompt, 4, schedule="slp", stop_ids=(), all_logits=True, double_buffer=double_buffer)
    assert res.tokens == ref_tokens
    np.testing.assert_allclose(res.prefill_logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert res.plan_meta["double_buffer"] is double_buffer
    eng.close()
