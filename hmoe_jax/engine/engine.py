"""The hybrid engine: prefill with a registered schedule, decode with the paper's placement
(attention, shared experts, dense layers, embeddings, lm_head on the accelerator; routed
experts on the host CPU; hidden states hop per layer).

    eng = Engine(params, cfg, devices=1)
    res = eng.generate(prompt_ids, max_new_tokens=16, schedule="slp", trace=TraceRecorder())
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.generate import CACHE_BUCKET, _check_prompt
from hmoe_jax.model.moe import ExpertFn, experts_ref
from hmoe_jax.model.params import ModelParams
from hmoe_jax.plan.format import Plan
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.plan.trace import TraceRecorder
from hmoe_jax.runtime import dist_exec as _dist_ops  # noqa: F401  (registers the dslp/ep op kinds)
from hmoe_jax.runtime import executor as X
from hmoe_jax.runtime import placement as P
from hmoe_jax.runtime.staging import StagingRing
from hmoe_jax.runtime.state import LayerCache, PlacedWeights
from hmoe_jax.schedules.registry import get_schedule


def ffi_moe_available() -> bool:
    try:
        from hmoe_jax.kernels import ffi

        return "hmoe_moe_experts" in ffi.register_all()
    except ImportError:
        return False


def expert_fn_named(name: str, cfg: ModelConfig | None = None) -> ExpertFn:
    """'ref': plain-JAX experts_ref; 'ffi': the fused CPU MoE op (hmoe_jax.kernels.moe, FP8 /
    INT4 weights); 'auto': ffi for quantized weights when the extension is built, else ref."""
    if name == "auto":
        quantized = cfg is not None and cfg.quant is not None
        name = "ffi" if quantized and ffi_moe_available() else "ref"
    if name == "ref":
        return experts_ref
    if name == "ffi":
        from hmoe_jax.kernels.moe import moe_experts

        return moe_experts
    raise ValueError(f"expert_fn {name!r}: expected 'auto', 'ref' or 'ffi'")


@dataclasses.dataclass
class EngineResult:
    tokens: list[int]
    ttft_s: float
    decode_s: list[float]
    schedule: str  # the schedule that ran the prefill (auto resolves to cpu/slp/dslp)
    prefill_s: float
    prefill_logits: np.ndarray  # [T or 1, V] f32
    plan_meta: dict[str, Any]
    streamed_bytes: int  # expert bytes the prefill streamed host -> accelerator


class Engine:
    """Options: devices (accelerators), system (SystemSpec), link_gbps (cap host->acc copies;
    emulation, never for performance claims), acc_tflops_cap (stand-in compute cap),
    expert_fn ('auto' | 'ref' | 'ffi' | an ExpertFn) for the host experts, mode (executor mode of the
    prefill), decode_mode, copy_threads (staging ring)."""

    def __init__(
        self,
        params: ModelParams,
        cfg: ModelConfig,
        *,
        devices: int = 1,
        system: SystemSpec | None = None,
        link_gbps: float | None = None,
        acc_tflops_cap: float | None = None,
        expert_fn: str | ExpertFn = "auto",
        mode: str = "pipelined",
        decode_mode: str = "async",
        copy_threads: int = 2,
    ):
        self.cfg = cfg
        self.placement = P.make_placement(devices)
        self.system = system or SystemSpec(num_accelerators=devices)
        self.weights = PlacedWeights.place(params, cfg, self.placement)
        self.link_gbps, self.acc_tflops_cap = link_gbps, acc_tflops_cap
        fn = expert_fn_named(expert_fn, cfg) if isinstance(expert_fn, str) else expert_fn
        self.expert_fn_name = expert_fn if isinstance(expert_fn, str) else getattr(fn, "__name__", "custom")
        self.host_expert_fn = X.jit_host_expert_fn(fn)
        self.mode, self.decode_mode = mode, decode_mode
        self.copy_threads = copy_threads
        self._rings: dict[tuple[int, int], StagingRing] = {}
        self._decode_plans: dict[int, Plan] = {}

    @property
    def devices(self) -> int:
        return len(self.placement.accelerators)

    def ring_for(self, plan: Plan) -> StagingRing | None:
        """The staging ring a plan needs, created once per (slots, slot_bytes) and reused."""
        slots = plan.meta.get("ring_slots")
        if not slots:
            return None
        key = (int(slots), int(plan.meta["slot_bytes"]))
        if key not in self._rings:
            self._rings[key] = StagingRing(
                key[0], key[1], copy_threads=self.copy_threads, link_gbps=self.link_gbps
            )
        return self._rings[key]

    def plan(self, schedule: str, num_tokens: int, start_pos: int = 0, **options: Any) -> Plan:
        s = get_schedule(schedule, **options)
        return s.plan(
            self.cfg, self.system, num_tokens, devices=s.uses_devices(self.devices), start_pos=start_pos
        )

    def new_cache(self, max_len: int) -> LayerCache:
        return LayerCache.zeros(self.cfg, 1, max_len, self.placement.acc)

    def run_plan(
        self,
        plan: Plan,
        tokens: np.ndarray,
        cache: LayerCache,
        start_pos: int = 0,
        *,
        mode: str | None = None,
        trace: TraceRecorder | None = None,
    ) -> tuple[X.Run, float]:
        run = X.Run(
            self.cfg,
            self.weights,
            cache,
            np.asarray(tokens, np.int32).reshape(1, -1),
            start_pos,
            self.host_expert_fn,
            ring=self.ring_for(plan),
            trace=trace,
            link_gbps=self.link_gbps,
            acc_tflops_cap=self.acc_tflops_cap,
        )
        if trace is not None:
            plans = trace.meta.setdefault("plans", [])
            run.plan_index = len(plans)
            plans.append({"schedule": plan.schedule, "num_tokens": plan.num_tokens, **plan.meta})
        return run, X.execute(plan, run, mode or self.mode)

    def prefill(
        self,
        ids: np.ndarray,
        cache: LayerCache,
        schedule: str = "auto",
        *,
        all_logits: bool = False,
        mode: str | None = None,
        trace: TraceRecorder | None = None,
        **options: Any,
    ):
        """ids [T] -> (logits [T or 1, V] on the accelerator, Run, seconds, plan)."""
        plan = self.plan(schedule, len(ids), 0, all_logits=all_logits, **options)
        run, secs = self.run_plan(plan, ids, cache, 0, mode=mode, trace=trace)
        logits = jnp.concatenate([lg[0] for lg in run.logits], axis=0)
        return logits, run, secs, plan

    def decode_step(
        self, tok: int, pos: int, cache: LayerCache, trace: TraceRecorder | None = None
    ) -> jax.Array:
        """One token at position `pos` with the decode placement -> logits [V]."""
        # The decode plan's structure does not depend on pos (only attention FLOPs do): build
        # it once; with a trace, build the exact one so the recorded plan meta is right.
        if trace is not None:
            plan = self.plan("cpu", 1, pos)
        else:
            if 1 not in self._decode_plans:
                self._decode_plans[1] = self.plan("cpu", 1, 0)
            plan = self._decode_plans[1]
        run, _ = self.run_plan(
            plan, np.array([[tok]], np.int32), cache, pos, mode=self.decode_mode, trace=trace
        )
        return run.logits[-1][0, -1]

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        schedule: str = "auto",
        stop_ids: Sequence[int] | None = None,
        trace: TraceRecorder | None = None,
        all_logits: bool = False,
        **options: Any,
    ) -> EngineResult:
        """Greedy batch-1 generation (the reference rollout's contract: a stop id is
        returned and ends generation)."""
        ids = _check_prompt(self.cfg, prompt_ids, max_new_tokens)
        stops = set(self.cfg.eos_ids if stop_ids is None else stop_ids)
        max_len = -(-(ids.size + max_new_tokens) // CACHE_BUCKET) * CACHE_BUCKET
        cache = self.new_cache(max_len)
        t0 = time.perf_counter()
        logits, run, prefill_s, plan = self.prefill(
            ids, cache, schedule, all_logits=all_logits, trace=trace, **options
        )
        tok = int(jnp.argmax(logits[-1]))
        ttft_s = time.perf_counter() - t0
        tokens, decode_s, pos = [tok], [], ids.size
        while len(tokens) < max_new_tokens and tok not in stops:
            t1 = time.perf_counter()
            tok = int(jnp.argmax(self.decode_step(tok, pos, cache, trace)))
            decode_s.append(time.perf_counter() - t1)
            tokens.append(tok)
            pos += 1
        return EngineResult(
            tokens,
            ttft_s,
            decode_s,
            plan.schedule,
            prefill_s,
            np.asarray(logits),
            dict(plan.meta),
            sum(run.streamed_bytes.values()),
        )

    def close(self) -> None:
        for r in self._rings.values():
            r.close()
        self._rings.clear()
