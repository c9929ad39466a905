"""The paper's policy (technique 3): FCFS prefill, continuous batching of decode up to a cap.

- A short prompt (< long_prompt_tokens) is prefilled in chunks of chunk_tokens with the cpu
  schedule, one chunk per iteration right after the decode step, so it starts at once and
  every decoding request (the one whose prompt just finished too) waits at most one chunk
  and one step for its next token.
- A long prompt goes to SLP/DSLP: on two or more accelerators with no decode active within
  idle_window_s, DSLP on accelerators 0 and 1 (the whole node prefills); otherwise SLP on
  accelerator 1 in the background while accelerator 0 keeps decoding (one prefill at a time
  on that lane); with one accelerator, SLP there (decoding waits for it).
- Decode: every decoding request, up to decode_cap, in one step; dual_batch "on" splits it
  into two overlapped micro-batches, "auto" does so only where it measured overlap beating
  plain batching by dual_min_gain (one measured step of each arm per batch size: a
  published reproduction found no gain when attention << experts, and where the
  "accelerator" shares the CPU's cores, as the stand-ins here do, overlap loses even when
  per-layer times look balanced), "off" never.
"""

from __future__ import annotations

from hmoe_jax.policies.base import (
    Action,
    Chunk,
    Decode,
    Policy,
    PolicyError,
    Prefill,
    View,
)


class PaperPolicy(Policy):
    name = "paper"
    defaults = {
        "decode_cap": 6,
        "chunk_tokens": 512,
        "long_prompt_tokens": 2048,
        "idle_window_s": 300.0,
        "dual_batch": "auto",
        "dual_min_gain": 1.05,
    }

    def __init__(self, **options):
        super().__init__(**options)
        o = self.options
        if o["dual_batch"] not in ("auto", "on", "off"):
            raise PolicyError(
                f"policy {self.name!r}: dual_batch must be auto, on or off, got {o['dual_batch']!r}"
            )
        for k in ("decode_cap", "chunk_tokens", "long_prompt_tokens"):
            if int(o[k]) < 1:
                raise PolicyError(f"policy {self.name!r}: {k} must be >= 1, got {o[k]}")

    def decide(self, view: View) -> tuple[Action, ...]:
        o = self.options
        cap = int(o["decode_cap"])
        acts: list[Action] = []  # a background prefill (it only starts its lane), then decode
        after: list[Action] = []  # foreground work runs after the iteration's decode step
        if view.waiting:
            head = view.waiting[0]
            in_flight = len(view.decoding) + len(view.background)
            may_start = head.prefilled > 0 or (view.free_rows > 0 and in_flight < cap)
            if may_start:
                if head.prefilled == 0 and head.prompt_tokens >= int(o["long_prompt_tokens"]):
                    long = self._long_prefill(view, head.id)
                    if long is not None:
                        if not long.background and view.devices >= 2:
                            return (long,)  # dslp: the whole node prefills
                        (acts if long.background else after).append(long)
                else:
                    end = min(head.prefilled + int(o["chunk_tokens"]), head.prompt_tokens)
                    after.append(Chunk(head.id, end))
        if view.decoding:
            # Decode before the chunk (as vLLM's mixed step emits every row's token and a
            # finished prompt's first one together): chunk first emitted the new row's first
            # token mid-iteration, then the others' step ran without it, so that row waited
            # the step, the next chunk and its own step (e09's join: 1.09 s against a 0.93 s
            # chunk + one 87 ms step). Now every row waits at most one chunk and one step; a
            # chunked prompt's first token comes one decode step later.
            acts.append(self._decode(view, view.decoding[:cap]))
        return (*acts, *after)

    def _long_prefill(self, view: View, rid: int) -> Prefill | None:
        if view.devices < 2:
            return Prefill(rid, "slp", (0,))
        recent = view.last_decode_s is not None and view.now_s - view.last_decode_s < float(
            self.options["idle_window_s"]
        )
        if not view.decoding and not view.background and not recent:
            return Prefill(rid, "dslp", (0, 1))
        if view.background:  # the prefill lane is busy: FCFS, the head waits
            return None
        return Prefill(rid, "slp", (1,), background=True)

    def _decode(self, view: View, ids: tuple[int, ...]) -> Decode:
        mode = self.options["dual_batch"]
        if mode == "off" or len(ids) < 2:
            return Decode(ids)
        if mode == "on":
            return Decode(ids, micro_batches=2)
        b, times = len(ids), view.step_times
        if (b, 1) not in times:
            return Decode(ids, measure=True)
        if (b, 2) not in times:
            return Decode(ids, micro_batches=2, measure=True)
        gain = times[(b, 1)] / max(times[(b, 2)], 1e-12)  # > 1: the dual step was faster
        return Decode(ids, micro_batches=2 if gain >= float(self.options["dual_min_gain"]) else 1)


class DualBatchPolicy(PaperPolicy):
    """The paper's policy with dual-batch overlap always on (the ablation's other arm)."""

    name = "dual"
    defaults = {**PaperPolicy.defaults, "dual_batch": "on"}
