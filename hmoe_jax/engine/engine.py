"""The hybrid engine: prefill with a registered schedule, decode many sequences in one step
with the paper's placement (attention, shared experts, dense layers, embeddings, lm_head
on the accelerator; routed experts on the host CPU, the whole batch as M = B rows of the
fused MoE op; hidden states hop per layer). Sequences own rows of a KV pool
(runtime/kvpool.py); each decode step takes the rows and their own positions.

    eng = Engine(params, cfg, devices=1)                       # bf16 policy by default
    res = eng.generate(prompt_ids, max_new_tokens=16, schedule="slp", trace=TraceRecorder())
    seqs = [eng.start(p, SamplingParams(max_new_tokens=8)) for p in prompts]   # admit
    while any(not s.done for s in seqs):
        eng.step([s for s in seqs if not s.done])                # one batched decode step
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
from hmoe_jax.engine import gpu
from hmoe_jax.engine.kernel_choice import (  # noqa: F401 (ffi_moe_available: re-exported)
    expert_fn_named,
    ffi_moe_available,
    precision_for,
)
from hmoe_jax.model.generate import check_prompt
from hmoe_jax.model.moe import ExpertFn
from hmoe_jax.model.params import ModelParams
from hmoe_jax.model.sampling import (
    RowHistory,
    SamplingParams,
    TokenLogprob,
    check_logit_bias,
    sample_batch,
    token_logprobs,
)
from hmoe_jax.model.structured import Grammar, GrammarCompiler
from hmoe_jax.plan.buckets import cache_len, padded_chunk_plan
from hmoe_jax.plan.format import Plan
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.plan.trace import TraceRecorder
from hmoe_jax.runtime import executor as X
from hmoe_jax.runtime import placement as P
from hmoe_jax.runtime.kvpool import KVPool, PoolExhausted
from hmoe_jax.runtime.run import Run
from hmoe_jax.runtime.staging import StagingRing
from hmoe_jax.runtime.state import PlacedWeights
from hmoe_jax.schedules.registry import get_schedule, schedule_class


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


@dataclasses.dataclass
class SeqState:
    """One request in the engine: its pool row, sampling parameters and progress."""

    prompt: np.ndarray  # [T] int32
    params: SamplingParams
    row: int
    pos: int  # prompt tokens prefilled so far; after prefill, the position of the next token to feed
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated (a stop id included)
    done: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "cancelled"
    schedule: str = ""
    ttft_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: list[float] = dataclasses.field(default_factory=list)
    prefill_logits: np.ndarray | None = None
    plan_meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    streamed_bytes: int = 0
    stops: frozenset[int] = frozenset()
    # with params.logprobs set: one per generated token; with params.prompt_logprobs set: one
    # per prompt token (the first None: nothing predicts it), filled chunk by chunk
    logprobs: list[TokenLogprob] = dataclasses.field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    grammar: Grammar | None = None  # params.structured's matcher, advanced with every token


class Engine:
    """Options: devices (accelerators), system (SystemSpec), precision ('bf16' default:
    bf16 activations and cache, f32 accumulation; 'f32' for parity), max_batch / max_len
    (the KV pool: rows and tokens per row; or kv_budget_bytes for the rows), link_gbps
    (cap host->acc copies; emulation, never for performance claims), acc_tflops_cap
    (stand-in compute cap), expert_fn ('auto' | 'ref' | 'ffi' | an ExpertFn) for the host
    experts, mode (executor mode of the prefill), decode_mode, copy_threads (the staging ring's
    host memcpy threads; None: sized from this host's measured memcpy rate against link_gbps,
    else the system's h2d_gbps: runtime/staging.py size_copy_threads),
    attn (prefill attention options: form, q_block, k_block), require_gpu (refuse to run on
    stand-in CPU devices when JAX found no GPU: a broken CUDA install falls back silently).

    On a GPU (engine/gpu.py): JAX_PLATFORMS must keep the cpu backend (`cuda,cpu`); when
    JAX's backend is not up yet, the constructor sets XLA_PYTHON_CLIENT_MEM_FRACTION from an
    `auto` plan of a max_len-token prompt on the real card. To size it for another schedule
    or prompt, call hmoe_jax.engine.gpu.set_gpu_mem_fraction before the first jax call."""

    def __init__(
        self,
        params: ModelParams,
        cfg: ModelConfig,
        *,
        devices: int = 1,
        system: SystemSpec | None = None,
        precision: str = "bf16",
        max_batch: int = 8,
        max_len: int | None = None,
        kv_budget_bytes: int | None = None,
        link_gbps: float | None = None,
        acc_tflops_cap: float | None = None,
        expert_fn: str | ExpertFn = "auto",
        mode: str = "pipelined",
        decode_mode: str = "async",
        copy_threads: int | None = None,
        attn: dict[str, Any] | None = None,
        require_gpu: bool = False,
    ):
        self.cfg = cfg
        # structured output (SamplingParams.structured) needs the tokenizer's grammar side;
        # the server sets it (GrammarCompiler.for_tokenizer), None refuses such requests
        self.grammars: GrammarCompiler | None = None
        gpu.check_platforms()
        if not gpu.backend_started():  # else too late: the fraction is read at backend start
            tokens = min(max_len or 4096, cfg.max_position_embeddings)
            gpu.set_gpu_mem_fraction(cfg, "auto", tokens, devices, system)
        else:
            gpu.warn_if_fraction_unset()
        self.placement = P.make_placement(devices)
        if require_gpu and self.placement.stand_in:
            gpu.check_gpu(required=True)
        self.system = system or SystemSpec(num_accelerators=devices)
        self.prec = precision_for(precision, self.placement)
        self.weights = PlacedWeights.place(params, cfg, self.placement, self.prec)
        self.link_gbps, self.acc_tflops_cap = link_gbps, acc_tflops_cap
        fn = expert_fn_named(expert_fn, cfg) if isinstance(expert_fn, str) else expert_fn
        self.expert_fn_name = expert_fn if isinstance(expert_fn, str) else getattr(fn, "__name__", "custom")
        self.host_expert_fn = X.jit_host_expert_fn(fn)
        self.mode, self.decode_mode = mode, decode_mode
        self.copy_threads = copy_threads
        self.attn = dict(attn or {})
        self._rings: dict[tuple[int, int], StagingRing] = {}
        self._decode_plans: dict[int, Plan] = {}
        self.max_len = cache_len(min(max_len or 4096, cfg.max_position_embeddings))
        if kv_budget_bytes is not None:
            from hmoe_jax.runtime.kvpool import rows_for_budget

            max_batch = rows_for_budget(cfg, kv_budget_bytes, self.max_len, self.prec.cache_dtype)
        self.max_batch = int(max_batch)
        if self.max_batch < 1:
            raise PoolExhausted(
                f"KV pool: rows={self.max_batch} must be >= 1 (kv_budget_bytes={kv_budget_bytes} holds no "
                f"{self.max_len}-token row)"
            )
        self._pool: KVPool | None = None

    @property
    def devices(self) -> int:
        return len(self.placement.accelerators)

    @property
    def pool(self) -> KVPool:
        """The engine's KV pool (max_batch rows of max_len tokens), created on first use."""
        if self._pool is None:
            self._pool = KVPool.create(
                self.cfg, self.max_batch, self.max_len, self.placement.acc, self.prec.cache_dtype
            )
        return self._pool

    def ring_for(self, plan: Plan) -> StagingRing | None:
        """The staging ring a plan needs, created once per (slots, slot_bytes) and reused."""
        slots = plan.meta.get("ring_slots")
        if not slots:
            return None
        key = (int(slots), int(plan.meta["slot_bytes"]))
        if key not in self._rings:
            # One host ring feeds every rank's link (dslp: N accelerators, N links), so its
            # memcpy threads are sized against their sum.
            links = int(plan.meta.get("devices", 1))
            self._rings[key] = StagingRing(
                key[0],
                key[1],
                copy_threads=self.copy_threads,
                link_gbps=self.link_gbps,
                h2d_gbps=self.system.h2d_gbps * links,
            )
        return self._rings[key]

    def plan(self, schedule: str, num_tokens: int, start_pos: int = 0, **options: Any) -> Plan:
        # a schedule that prices by precision (hop bytes, activation memory) gets the policy
        # this engine runs, so the plan's bytes are the bytes the executor moves
        if "precision" in schedule_class(schedule).known_options:
            options.setdefault("precision", self.prec.name)
        s = get_schedule(schedule, **options)
        return s.plan(
            self.cfg, self.system, num_tokens, devices=s.uses_devices(self.devices), start_pos=start_pos
        )

    def new_cache(self, max_len: int, rows: int = 1) -> KVPool:
        """A private pool (default one row) for driving prefill/decode by hand."""
        return KVPool.create(self.cfg, rows, max_len, self.placement.acc, self.prec.cache_dtype)

    def run_plan(
        self,
        plan: Plan,
        tokens: np.ndarray,
        cache: KVPool,
        start_pos: int | np.ndarray = 0,
        *,
        rows: np.ndarray | None = None,
        mode: str | None = None,
        trace: TraceRecorder | None = None,
        locks: dict | None = None,
        label: str | None = None,
        real_tokens: int | None = None,
    ) -> tuple[Run, float]:
        tokens = np.asarray(tokens, np.int32)
        run = Run(
            self.cfg,
            self.weights,
            cache,
            tokens.reshape(1, -1) if tokens.ndim == 1 else tokens,
            start_pos,
            self.host_expert_fn,
            rows=rows,
            prec=self.prec,
            attn=self.attn,
            ring=self.ring_for(plan),
            trace=trace,
            link_gbps=self.link_gbps,
            acc_tflops_cap=self.acc_tflops_cap,
            locks=locks,
            label=label,
            real_tokens=real_tokens,
        )
        if trace is not None:
            ring = {}
            if run.ring is not None:  # what the copies ran with (sized per host: not plan data)
                ring = {"copy_threads": run.ring.copy_threads, "copy_threads_why": run.ring.copy_threads_why}
            run.plan_index = trace.add_plan(
                {"schedule": plan.schedule, "num_tokens": plan.num_tokens, **plan.meta, **ring}
            )
        return run, X.execute(plan, run, mode or self.mode)

    def prefill(
        self,
        ids: np.ndarray,
        cache: KVPool,
        schedule: str = "auto",
        *,
        row: int = 0,
        all_logits: bool = False,
        mode: str | None = None,
        trace: TraceRecorder | None = None,
        **options: Any,
    ):
        """ids [T] into pool row `row` -> (logits [T or 1, V] on the accelerator, Run, seconds, plan)."""
        plan = self.plan(schedule, len(ids), 0, all_logits=all_logits, **options)
        rows = np.array([row], np.int32)
        run, secs = self.run_plan(plan, ids, cache, 0, rows=rows, mode=mode, trace=trace)
        logits = jnp.concatenate([lg[0] for lg in run.logits], axis=0)
        return logits, run, secs, plan

    def decode_plan(self, batch: int, trace: TraceRecorder | None = None, pos: int = 0) -> Plan:
        # The decode plan's structure does not depend on positions (only attention FLOPs do):
        # build it once per batch size; with a trace, the exact one for the recorded meta.
        if trace is not None:
            return self.plan("cpu", 1, pos, batch=batch)
        if batch not in self._decode_plans:
            self._decode_plans[batch] = self.plan("cpu", 1, 0, batch=batch)
        return self._decode_plans[batch]

    def decode_rows(
        self,
        toks: np.ndarray,
        rows: np.ndarray,
        pos: np.ndarray,
        cache: KVPool,
        trace: TraceRecorder | None = None,
        *,
        mode: str | None = None,
        locks: dict | None = None,
        label: str | None = None,
    ) -> jax.Array:
        """One batched decode step: token toks[b] of pool row rows[b] at position pos[b] -> logits [B, V].
        mode (default decode_mode) / locks / label: for runs executed concurrently (engine/dual.py).
        What a traced step measured (experts touched per layer, op intervals) is in `trace`."""
        b = len(rows)
        plan = self.decode_plan(b, trace, int(np.max(pos)))
        run, _ = self.run_plan(
            plan,
            np.asarray(toks, np.int32).reshape(b, 1),
            cache,
            np.asarray(pos, np.int32),
            rows=np.asarray(rows, np.int32),
            mode=mode or self.decode_mode,
            trace=trace,
            locks=locks,
            label=label,
        )
        return run.logits[-1][:, -1]

    def decode_step(
        self, tok: int, pos: int, cache: KVPool, trace: TraceRecorder | None = None, row: int = 0
    ) -> jax.Array:
        """One token of one sequence at position `pos` -> logits [V]."""
        return self.decode_rows(np.array([tok]), np.array([row]), np.array([pos]), cache, trace)[0]

    # ------------------------------------------------------------ sequences

    def start(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        schedule: str = "auto",
        trace: TraceRecorder | None = None,
        all_logits: bool = False,
        **options: Any,
    ) -> SeqState:
        """Admit a request: take a pool row, prefill the prompt with `schedule`, sample the
        first token. Raises PoolExhausted (nothing allocated) when the pool is full."""
        seq = self.admit(prompt_ids, params)
        try:
            self.prefill_seq(seq, schedule, trace=trace, all_logits=all_logits, **options)
        except BaseException:
            self.pool.free(seq.row)
            raise
        return seq

    def admit(self, prompt_ids: Sequence[int], params: SamplingParams | None = None) -> SeqState:
        """Validate a request and take its pool row, without running anything (the request
        scheduler then prefills it, whole or in chunks). Raises ValueError for bad input and
        PoolExhausted (nothing allocated) when no row is free."""
        params = (params or SamplingParams()).validate()
        ids = check_prompt(self.cfg, prompt_ids, params.max_new_tokens)
        check_logit_bias(params, self.cfg.vocab_size)
        stops = frozenset(self.cfg.eos_ids if params.stop_ids is None else params.stop_ids)
        grammar = None
        if params.structured is not None:
            self.check_structured(params)
            grammar = self.grammars.start(*params.structured, stops)
        row = self.pool.alloc(ids.size + params.max_new_tokens)
        return SeqState(ids, params, row, 0, stops=stops, grammar=grammar)

    def check_structured(self, params: SamplingParams) -> None:
        """ValueError when params.structured cannot run here (no grammar side, bad schema)."""
        if params.structured is None:
            return
        if self.grammars is None:
            raise ValueError(
                "structured output (response_format json_object / json_schema) is not available: "
                "it needs llguidance (the serve extra) and the engine's tokenizer (Engine.grammars)"
            )
        self.grammars.check(*params.structured)

    def prefill_seq(
        self,
        seq: SeqState,
        schedule: str = "auto",
        t1: int | None = None,
        *,
        trace: TraceRecorder | None = None,
        all_logits: bool = False,
        **options: Any,
    ) -> bool:
        """Prefill prompt tokens [seq.pos, t1) of an admitted sequence into its row (a chunk
        when t1 < prompt length: only the cpu schedule takes a start position). After the
        last chunk, sample the first token. Returns True when the prompt is done. With
        params.prompt_logprobs set, every chunk runs with all_logits and its prompt logprobs
        are computed on the device as it ends (only the top-k reach the host).

        A cpu chunk is padded to its bucket (plan/buckets.py padded_chunk_plan), so a
        few programs serve every chunk length: the padding follows the real tokens (causal
        attention: no real position sees it), its KV slots lie past the prompt (decode
        overwrites each before it attends to it), and only the real positions' logits are
        kept."""
        n = seq.prompt.size
        t0, t1 = seq.pos, n if t1 is None else min(int(t1), n)
        if not 0 <= t0 < t1:
            raise ValueError(f"prefill_seq: empty chunk [{t0}, {t1}) of a {n}-token prompt")
        start = time.perf_counter()
        want_all = all_logits or seq.params.prompt_logprobs is not None
        real = t1 - t0
        plan, tp = padded_chunk_plan(
            lambda n: self.plan(schedule, n, t0, all_logits=want_all, **options),
            schedule,
            real,
            t0,
            self.pool.max_len,
        )
        toks = seq.prompt[t0:t1]
        if tp > real:
            toks = np.concatenate([toks, np.zeros(tp - real, np.int32)])
        rows = np.array([seq.row], np.int32)
        run, secs = self.run_plan(
            plan, toks, self.pool, t0, rows=rows, trace=trace, real_tokens=real if schedule == "cpu" else None
        )
        seq.pos = t1
        seq.prefill_s += secs
        seq.streamed_bytes += sum(run.streamed_bytes.values())
        seq.schedule, seq.plan_meta = plan.schedule, dict(plan.meta, padded_tokens=tp - real)
        logits = jnp.concatenate([lg[0] for lg in run.logits], axis=0)
        if want_all and tp > real:
            logits = logits[:real]  # the padding's logits are no prompt position's
        if seq.params.prompt_logprobs is not None:
            self.record_prompt_logprobs(seq, logits, t0, t1)
        if t1 < n:
            return False
        logits = logits if all_logits else logits[-1:]
        self.first_token(seq, logits, seq.prefill_s - secs + time.perf_counter() - start)
        return True

    @staticmethod
    def record_prompt_logprobs(seq: SeqState, logits: jax.Array, t0: int, t1: int) -> None:
        """Prompt logprobs from the logits [t1 - t0, V] of prompt positions [t0, t1) (a
        prefill run with all_logits): position t's logits give entry t + 1,
        log_softmax(logits[t])[prompt[t + 1]], and its top-k."""
        n, tc = seq.prompt.size, logits.shape[0]
        if tc != t1 - t0 or t1 > n:
            raise ValueError(f"prompt logprobs: {tc} logits rows for prompt positions [{t0}, {t1}) of {n}")
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        if len(seq.prompt_logprobs) != t0 + 1:
            raise ValueError(f"prompt logprobs: chunk from {t0} after {len(seq.prompt_logprobs)} entries")
        m = min(tc, n - 1 - t0)  # the last prompt position predicts the first generated token
        k = seq.params.prompt_logprobs
        seq.prompt_logprobs += token_logprobs(
            logits, range(m), seq.prompt[t0 + 1 : t0 + 1 + m].tolist(), [k] * m
        )

    def first_token(self, seq: SeqState, logits: jax.Array, ttft_s: float) -> None:
        """Sample a prefilled sequence's first token from its prompt's logits [T or 1, V]."""
        (tok,) = self._sample([seq], logits[-1:])
        seq.pos = seq.prompt.size
        seq.ttft_s = ttft_s
        seq.prefill_logits = np.asarray(logits)
        self._append(seq, tok)

    def _sample(self, seqs: list[SeqState], logits: jax.Array) -> list[int]:
        """Each sequence's next token from logits [B, V] (its processors applied), recording
        its logprob (of the raw logits) when it asked. Returns the tokens, not yet appended."""
        params = [s.params for s in seqs]
        # structured rows: the grammar's mask, computed on the host (results/bench_grammar_*.json)
        history = [
            RowHistory(s.prompt, s.tokens, s.stops, None if s.grammar is None else s.grammar.allowed())
            for s in seqs
        ]
        new = sample_batch(logits, params, [len(s.tokens) for s in seqs], history).tolist()
        asked = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        ks = [seqs[i].params.logprobs for i in asked]
        for i, lp in zip(asked, token_logprobs(logits, asked, [new[i] for i in asked], ks)):
            seqs[i].logprobs.append(lp)
        return new

    def _append(self, seq: SeqState, tok: int) -> None:
        seq.tokens.append(tok)
        if seq.grammar is not None and tok not in seq.stops:
            seq.grammar.advance(tok)
        if tok in seq.stops or (seq.grammar is not None and seq.grammar.complete):
            # a complete document ends the sequence at once: only a stop id could follow
            seq.done, seq.finish_reason = True, "stop"
        elif len(seq.tokens) >= seq.params.max_new_tokens:
            seq.done, seq.finish_reason = True, "length"
        if seq.done:
            self.pool.free(seq.row)

    def step(self, seqs: list[SeqState], trace: TraceRecorder | None = None) -> list[int]:
        """One decode step for every sequence in `seqs` (not done) as one batch -> their new tokens."""
        if not seqs:
            return []
        if any(s.done for s in seqs):
            raise ValueError("engine.step: a finished sequence was passed")
        t0 = time.perf_counter()
        toks, rows, pos = self.step_inputs(seqs)
        logits = self.decode_rows(toks, rows, pos, self.pool, trace)
        return self.take_step(seqs, logits, time.perf_counter() - t0)

    @staticmethod
    def step_inputs(seqs: list[SeqState]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(last tokens, pool rows, positions) [B] of a decode step over `seqs`."""
        toks = np.array([s.tokens[-1] for s in seqs], np.int32)
        rows = np.array([s.row for s in seqs], np.int32)
        pos = np.array([s.pos for s in seqs], np.int32)
        return toks, rows, pos

    def take_step(self, seqs: list[SeqState], logits: jax.Array, dt_s: float) -> list[int]:
        """Sample each sequence's next token from a decode step's logits [B, V] and append it
        (a stop id or max_new_tokens finishes the sequence and frees its row)."""
        new = self._sample(seqs, logits)
        for s, tok in zip(seqs, new):
            s.pos += 1
            s.decode_s.append(dt_s)
            self._append(s, int(tok))
        return new

    def cancel(self, seq: SeqState) -> None:
        """Stop a sequence now and free its row."""
        if not seq.done:
            seq.done, seq.finish_reason = True, "cancelled"
            self.pool.free(seq.row)

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        schedule: str = "auto",
        stop_ids: Sequence[int] | None = None,
        trace: TraceRecorder | None = None,
        all_logits: bool = False,
        sampling: SamplingParams | None = None,
        **options: Any,
    ) -> EngineResult:
        """One sequence, the one generate loop: `hmoe generate` runs it for every --schedule
        (without one, the embedded model's plain path is schedule="reference"). Greedy unless
        `sampling` says otherwise; token n is drawn by model/sampling.py with key
        fold_in(key(seed), n) whatever the schedule, so one seed gives one stream on every
        path. A stop id is returned and ends generation."""
        params = dataclasses.replace(
            sampling or SamplingParams(),
            max_new_tokens=max_new_tokens,
            stop_ids=None if stop_ids is None else tuple(stop_ids),
        )
        seq = self.start(prompt_ids, params, schedule=schedule, trace=trace, all_logits=all_logits, **options)
        while not seq.done:
            self.step([seq], trace)
        return EngineResult(
            seq.tokens,
            seq.ttft_s,
            seq.decode_s,
            seq.schedule,
            seq.prefill_s,
            seq.prefill_logits,
            seq.plan_meta,
            seq.streamed_bytes,
        )

    def view(self, accelerators: Sequence[int]) -> Engine:
        """An engine on a subset of this one's accelerators (by index), sharing its host
        weights (the same numpy buffers: routed experts are never copied; non-expert weights
        are placed on the view's first accelerator, zero-copy on stand-ins) and options,
        with its own pool, staging rings and compiled plans. The scheduler prefills on
        accelerator 1 through a view while accelerator 0 keeps decoding."""
        accs = tuple(self.placement.accelerators[int(i)] for i in accelerators)
        if not accs:
            raise ValueError("Engine.view: no accelerators given")
        v = object.__new__(Engine)
        v.__dict__.update(self.__dict__)
        v.placement = P.Placement(self.placement.host, accs)
        v.system = dataclasses.replace(self.system, num_accelerators=len(accs))
        v.weights = PlacedWeights.place(self.weights.host, self.cfg, v.placement, self.prec)
        v._rings, v._decode_plans, v._pool = {}, {}, None
        return v

    def close(self) -> None:
        for r in self._rings.values():
            r.close()
        self._rings.clear()


__all__ = ["Engine", "EngineResult", "PoolExhausted", "SamplingParams", "SeqState", "precision_for"]
