"""The in-process scheduler's warm-up (a mixin of serve/scheduler.py's Scheduler): before
serving, compile every decode batch size at every KV prefix bucket and every padded prefill
chunk shape the policy can run, and measure the decode arms the policy compares, so no
client pays for a compile or a measurement (docs/serve_http.md, warm-up)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from hmoe_jax.model.sampling import SamplingParams
from hmoe_jax.plan.buckets import prefill_buckets
from hmoe_jax.policies.base import Decode, View
from hmoe_jax.runtime.run import decode_kv_len
from hmoe_jax.serve.servetrace import SCHED, span

MAX_WARM_PREFILLS = 8  # padded chunk shapes warm_up prefills at most (prefill_warm_lengths)


class WarmUp:
    """Warm-up methods; the Scheduler supplies engine, core, policy, trace and _run_step."""

    engine: Any
    core: Any
    policy: Any
    trace: Any

    def warm_up(self, max_batch: int | None = None, *, rounds: int = 5, pos: int = 128) -> dict[str, Any]:
        """Before serving: compile the decode step of every batch size 1..max_batch (default
        the engine's rows), and where the policy's decode choice depends on measured steps
        (it asks to measure), time each arm it compares `rounds` times, interleaved in a
        rotating order, on scratch pool rows at position `pos`, and give the core their
        medians. Serving then neither compiles a decode shape nor measures on live requests.
        Returns what it did: seconds per phase and the arms' medians."""
        eng = self.engine
        cap = min(int(max_batch or eng.max_batch), len(eng.pool.free_rows))
        pos = min(int(pos), eng.max_len - rounds * 2 - 2)
        out: dict[str, Any] = {"batches": cap, "compile_s": 0.0, "measure_s": 0.0, "arms": {}}
        seqs = [
            eng.admit([1], SamplingParams(max_new_tokens=eng.max_len - 1, stop_ids=())) for _ in range(cap)
        ]
        try:
            for s in seqs:
                s.tokens, s.pos = [1], pos
            t0 = time.perf_counter()
            kv_buckets = decode_kv_buckets(eng.max_len)
            for b in range(1, cap + 1):
                with span(self.trace, SCHED, "warm_up", batch=b):
                    self._run_step(seqs[:b], 1, False)
                    self._run_step(seqs[:b], 1, True)  # the traced (measured) plain arm
                    # a decode step's attention compiles per batch and per KV prefix bucket
                    # (runtime/run.py decode_kv_len): every bucket up to max_len, once
                    for kv in kv_buckets:
                        for s in seqs[:b]:
                            s.tokens, s.pos = [1], kv - 1
                        self._run_step(seqs[:b], 1, False)
            out["kv_buckets"] = kv_buckets
            out["compile_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            arms = sorted({a for b in range(2, cap + 1) for a in self._arms_to_measure(b)})
            for arm in arms:  # compile each dual arm's traced halves once, untimed
                self._run_step(seqs[: arm[0]], arm[1], True)
            times: dict[tuple[int, int], list[float]] = {arm: [] for arm in arms}
            # the order rotates every round: with a fixed order the first arm of each round
            # read slow every time (e09, bench twin: plain 2 rows 200 ms at warm-up against
            # 168 ms steady, so the policy picked the 2-row dual arm at 190 ms, 211 ms steady)
            for r in range(rounds):
                for arm in arms[r % len(arms) :] + arms[: r % len(arms)]:
                    for s in seqs:  # rewind: every arm decodes the same positions
                        s.tokens, s.pos = [1], pos
                    t = time.perf_counter()
                    self._run_step(seqs[: arm[0]], arm[1], True)
                    times[arm].append(time.perf_counter() - t)
            for arm, ts in times.items():
                self.core.measured(arm, float(np.median(ts)))
                out["arms"][f"{arm[0]}x{arm[1]}"] = float(np.median(ts))
            out["measure_s"] = time.perf_counter() - t0
        finally:
            for s in seqs:
                eng.cancel(s)
        t0 = time.perf_counter()
        out["prefill_prompts"] = self._warm_prefill()
        out["prefill_s"] = time.perf_counter() - t0
        return out

    def prefill_warm_lengths(self) -> list[int]:
        """The prompt lengths whose prefill shapes warm_up compiles: one prompt per padded
        chunk shape the policy's chunks can run (plan/buckets.py prefill_buckets of its
        chunk_tokens, within long_prompt_tokens and max_len). Engine.prefill_seq pads every
        cpu chunk to one of these, and the prefill programs depend on the chunk's shape
        only (the start position and the real length are traced), so after warm-up no
        chunked prompt compiles. Not covered: a chunk whose padded tail does not fit its
        row (run at its exact length: only when chunk_tokens does not divide max_len) and
        the background (long-prompt) prefills of private caches."""
        o = self.policy.options
        chunk = int(o.get("chunk_tokens") or 0)
        if chunk < 1:
            return []
        limit = min(int(o.get("long_prompt_tokens") or self.engine.max_len), self.engine.max_len - 1)
        lengths = [b for b in prefill_buckets(min(chunk, limit)) if b < self.engine.max_len]
        # at most MAX_WARM_PREFILLS prompts (the paper policy's 512-token chunks need 4)
        return lengths[-MAX_WARM_PREFILLS:]

    def _warm_prefill(self) -> list[int]:
        """Run each prefill_warm_lengths() prompt on a scratch pool row as one cpu chunk
        (its padded shape, sampling the first token), so no client's chunk compiles."""
        eng = self.engine
        done = []
        for n in self.prefill_warm_lengths():
            if not eng.pool.free_rows:
                break
            seq = eng.admit([1] * n, SamplingParams(max_new_tokens=1, stop_ids=()))
            try:
                with span(self.trace, SCHED, "warm_up_prefill", tokens=n):
                    eng.prefill_seq(seq, "cpu")
            finally:
                eng.cancel(seq)  # a no-op once the first token ended it (its row is freed)
            done.append(n)
        return done

    def _arms_to_measure(self, batch: int) -> list[tuple[int, int]]:
        """The (batch, micro-batches) arms the policy would measure for `batch` decoding
        requests: ask it with a View of that many decoding requests until it stops asking."""
        arms: list[tuple[int, int]] = []
        times: dict[tuple[int, int], float] = {}
        ids = tuple(range(batch))
        for _ in range(4):
            view = View(
                now_s=0.0, devices=self.core.devices, free_rows=0, waiting=(), decoding=ids, step_times=times
            )
            acts = [a for a in self.policy.decide(view) if isinstance(a, Decode) and a.measure]
            if not acts:
                break
            arm = _arm(len(acts[0].requests), acts[0].micro_batches)
            if arm in times:
                break
            arms.append(arm)
            times[arm] = 1.0
        return arms


def decode_kv_buckets(max_len: int) -> list[int]:
    """Every KV prefix length a decode step of a max_len row can read (decode_kv_len of
    each position): powers of two from 64, capped at max_len."""
    return sorted(
        {decode_kv_len(t, max_len) for t in [1, max_len] + [1 << k for k in range(6, 31)] if t <= max_len}
    )


def _arm(batch: int, micro_batches: int) -> tuple[int, int]:
    return batch, 2 if micro_batches >= 2 and batch >= 2 else 1


__all__ = ["MAX_WARM_PREFILLS", "WarmUp", "decode_kv_buckets"]
