"""Dual-batch attention/MoE overlap (engine/dual.py): two decode micro-batches run as two
plans on two threads that share one lock per resource. Exact: every sequence gets the
tokens of the independent reference rollout (hmoe_jax.model.generate.greedy_rollout: plain model, one
sequence). Concurrent: in the trace, accelerator slices of one micro-batch overlap CPU
expert slices of the other (absent when the micro-batches run one after the other)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.engine.dual import dual_step, layer_times, split_micro_batches
from hmoe_jax.model.generate import greedy_rollout
from hmoe_jax.model.sampling import SamplingParams
from hmoe_jax.plan.trace import TraceRecorder
from hmoe_jax.policies.base import overlap_bound
from hmoe_jax.runtime.synthetic import random_params
from tests.helpers import reference_engine

LENGTHS = [5, 9, 7, 12]
NEW = 5


@functools.cache
def model():
    cfg = named_model_config("deepseek_v3_tiny")
    params = random_params(cfg, seed=21)
    rng = np.random.default_rng(4)
    prompts = [[int(t) for t in rng.integers(2, cfg.vocab_size, n)] for n in LENGTHS]
    refs = [greedy_rollout(params, cfg, p, NEW) for p in prompts]
    return cfg, params, prompts, refs


@functools.cache
def engine():
    cfg, params, *_ = model()
    return reference_engine(params, cfg, 1, max_batch=len(LENGTHS), max_len=64)


def start_all(eng):
    _, _, prompts, _ = model()
    return [eng.start(p, SamplingParams(max_new_tokens=NEW, stop_ids=()), schedule="cpu") for p in prompts]


def overlaps(trace: TraceRecorder) -> int:
    """How many (accelerator slice of one micro-batch, CPU expert slice of the other) pairs
    intersect in time."""
    acc = {"mb0": [], "mb1": []}
    cpu = {"mb0": [], "mb1": []}
    for s in trace.slices:
        b = s["args"].get("batch")
        if b not in acc:
            continue
        if s["resource"] == "cpu_experts":
            cpu[b].append((s["start_ns"], s["end_ns"]))
        elif s["resource"].startswith("acc"):
            acc[b].append((s["start_ns"], s["end_ns"]))
    n = 0
    for a, c in (("mb0", "mb1"), ("mb1", "mb0")):
        for s0, e0 in acc[a]:
            n += sum(1 for s1, e1 in cpu[c] if s0 < e1 and s1 < e0)
    return n


def test_dual_batch_gets_every_sequence_its_solo_tokens():
    *_, refs = model()
    eng = engine()
    seqs = start_all(eng)
    groups = list(split_micro_batches(seqs))
    assert [len(g) for g in groups] == [2, 2]
    while not all(s.done for s in seqs):
        dual_step(eng, [[s for s in g if not s.done] for g in groups])
    assert [s.tokens for s in seqs] == refs
    assert eng.pool.in_use == 0


def test_trace_shows_attention_of_one_micro_batch_overlapping_experts_of_the_other():
    eng = engine()
    seqs = start_all(eng)
    groups = list(split_micro_batches(seqs))
    dual_step(eng, groups)  # compile both micro-batch shapes
    tr = TraceRecorder()
    for _ in range(NEW - 2):
        dual_step(eng, groups, tr)
    labels = {s["args"].get("batch") for s in tr.slices}
    assert {"mb0", "mb1"} <= labels
    assert overlaps(tr) > 0, "no accelerator slice of one micro-batch overlaps CPU experts of the other"
    # one after the other (each micro-batch alone): no such overlap can exist
    serial = TraceRecorder()
    for g in groups:
        if not any(s.done for s in g):
            dual_step(eng, [g], serial)
    assert overlaps(serial) == 0
    for s in seqs:
        if not s.done:
            eng.cancel(s)
    assert eng.pool.in_use == 0


def test_layer_times_and_bound_from_a_traced_step():
    eng = engine()
    seqs = start_all(eng)
    tr = TraceRecorder()
    toks, rows, pos = eng.step_inputs(seqs)
    lg = eng.decode_rows(toks, rows, pos, eng.pool, tr, mode="pipelined")
    eng.take_step(seqs, lg, 0.0)
    a_s, m_s = layer_times(tr, 0)
    assert a_s > 0 and m_s > 0  # a real step has both accelerator and CPU expert work
    for s in seqs:
        eng.cancel(s)


def _slice(resource: str, layer: int, ms: float, plan: int = 0, start_ms: float = 0.0) -> dict:
    start_ns = int(start_ms * 1e6)
    return {
        "resource": resource,
        "start_ns": start_ns,
        "end_ns": start_ns + int(ms * 1e6),
        "args": {"layer": layer, "plan": plan},
    }


def test_layer_times_and_bound_on_a_hand_made_trace():
    """(A, M) by hand: per MoE layer, the accelerator's seconds (all its pieces) and the CPU
    experts' seconds, medians over the layers with CPU expert work; slices of no layer
    (embed, final), copies and another plan's slices do not count."""
    trace = SimpleNamespace(
        slices=[
            _slice("acc0", 0, 2.0), _slice("acc0", 0, 1.0), _slice("cpu_experts", 0, 4.0),
            _slice("acc0", 1, 3.0), _slice("cpu_experts", 1, 2.0),
            _slice("acc0", 2, 5.0), _slice("cpu_experts", 2, 6.0),
            _slice("acc0", -1, 10.0),  # embed / final: no layer
            _slice("h2d", 1, 7.0),  # a copy, neither A nor M
            _slice("acc0", 1, 50.0, plan=1), _slice("cpu_experts", 1, 50.0, plan=1),  # another plan
        ]
    )  # fmt: skip
    # A per layer: 3, 3, 5 ms -> median 3 ms; M per layer: 4, 2, 6 ms -> median 4 ms
    a_s, m_s = layer_times(trace, 0)
    assert a_s == pytest.approx(3e-3) and m_s == pytest.approx(4e-3)
    # (A + M) / max(A, M): overlapping two micro-batches can at best hide the shorter side
    assert overlap_bound(a_s, m_s) == pytest.approx(7 / 4)
    assert overlap_bound(2.0, 2.0) == pytest.approx(2.0)  # equal sides: at best twice as fast
    assert overlap_bound(9.0, 1.0) == pytest.approx(10 / 9)


def test_both_micro_batches_runs_are_in_the_trace_each_under_its_own_plan():
    """The engine keeps no `last_run` that the two micro-batch threads would both write: what
    a traced step measured is in the trace, per micro-batch. Oracle: the same two groups
    stepped one after the other on a second engine in the same state (plain async steps, no
    threads) touch the same experts per layer and get the same tokens."""
    from hmoe_jax.plan.trace import experts_touched

    cfg, params, *_ = model()
    a = reference_engine(params, cfg, 1, max_batch=len(LENGTHS), max_len=64)
    b = reference_engine(params, cfg, 1, max_batch=len(LENGTHS), max_len=64)
    assert not hasattr(a, "last_run")
    ga = list(split_micro_batches(start_all(a)))
    gb = list(split_micro_batches(start_all(b)))
    tr = TraceRecorder()
    dual_step(a, ga, tr)
    alone = []
    for g in gb:
        t = TraceRecorder()
        b.step(g, t)
        alone.append(t)
    assert [s.tokens for g in ga for s in g] == [s.tokens for g in gb for s in g]
    # two plans recorded, each slice's plan index belongs to exactly one micro-batch
    assert len(tr.meta["plans"]) == 2
    label_of: dict[int, set] = {}
    for s in tr.slices:
        label_of.setdefault(s["args"]["plan"], set()).add(s["args"]["batch"])
    assert sorted(label_of) == [0, 1] and sorted(map(tuple, label_of.values())) == [("mb0",), ("mb1",)]
    k = cfg.num_experts_per_tok
    for m, t in enumerate(alone):
        want = experts_touched(t.slices)
        got = experts_touched(tr.slices, batch=f"mb{m}")
        assert got == want and sorted(got) == [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        assert all(k <= n <= min(cfg.n_routed_experts, k * len(ga[m])) for n in got.values())
    for eng, groups in ((a, ga), (b, gb)):
        for s in (s for g in groups for s in g):
            eng.cancel(s)
        eng.close()
