"""Dual-batch attention/MoE overlap (the paper's technique 3, decode side): the decoding
sequences split into two micro-batches whose decode steps run at the same time, each as its
own plan on its own thread, with one lock per resource shared by both (executor.shared_locks).
The accelerator and the CPU experts each run one op at a time, so while micro-batch A's routed
experts run on the CPU, B's attention runs on the accelerator, then they swap: per layer the
step costs ~max(A, M) instead of A + M per micro-batch, the bound (A + M) / max(A, M) on the
gain over running them one after the other.

Against plain batching of both (one step with B = |A| + |B| rows) the trade is different: a
plain step reads the union of both micro-batches' experts once, the dual step reads each
micro-batch's experts separately (nearly twice the CPU bytes when routing is spread), so
where M >> A plain batching wins; `dual_gain_estimate` prices both from measured per-layer
times (hmoe_jax.policies.base) and the policy picks.

Exact: each micro-batch is a normal decode step of its rows (the pool rows are disjoint, and
the attention op that replaces a layer's cache arrays holds the accelerator's lock), so
every sequence gets the tokens it gets alone.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from hmoe_jax.engine.engine import Engine, SeqState
from hmoe_jax.plan.trace import TraceRecorder, attention_moe_split
from hmoe_jax.policies.base import dual_gain_estimate, overlap_bound  # noqa: F401  (re-exported)
from hmoe_jax.runtime import executor as X


def split_micro_batches(seqs: list[SeqState]) -> tuple[list[SeqState], list[SeqState]]:
    """Two halves of a decode batch (the first gets the extra one when odd)."""
    h = (len(seqs) + 1) // 2
    return seqs[:h], seqs[h:]


def dual_step(eng: Engine, groups: list[list[SeqState]], trace: TraceRecorder | None = None) -> list[int]:
    """One decode step of each micro-batch in `groups`, run concurrently -> new tokens in
    groups order. An empty group is skipped (one group: a plain pipelined step)."""
    groups = [g for g in groups if g]
    if not groups:
        return []
    if any(s.done for g in groups for s in g):
        raise ValueError("dual_step: a finished sequence was passed")
    inputs = [eng.step_inputs(g) for g in groups]
    plans = [eng.decode_plan(len(g), trace, int(np.max(i[2]))) for g, i in zip(groups, inputs)]
    locks = X.shared_locks(*plans)
    logits: list = [None] * len(groups)
    errors: list[BaseException] = []

    def work(k: int) -> None:
        toks, rows, pos = inputs[k]
        try:
            logits[k] = eng.decode_rows(
                toks, rows, pos, eng.pool, trace, mode="pipelined", locks=locks, label=f"mb{k}"
            )
        except BaseException as e:  # surfaced below, after both finish
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(k,), name=f"hmoe-mb{k}") for k in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    dt = time.perf_counter() - t0
    out: list[int] = []
    for g, lg in zip(groups, logits):
        out += eng.take_step(g, lg, dt)
    return out


def layer_times(trace: TraceRecorder, plan_index: int | None = None) -> tuple[float, float]:
    """(A, M): per-MoE-layer accelerator time (attention and the rest of the layer) and CPU
    routed-expert time, medians over layers, from a traced pipelined step (slices are real
    execution intervals there)."""
    split = attention_moe_split(
        (s["resource"], int(s["args"].get("layer", -1)), (s["end_ns"] - s["start_ns"]) / 1e9)
        for s in trace.slices
        if plan_index is None or s["args"].get("plan") == plan_index
    )
    if split is None:
        raise ValueError(
            "layer_times: the trace has no CPU expert slices (not a decode step of a MoE model?)"
        )
    return split
