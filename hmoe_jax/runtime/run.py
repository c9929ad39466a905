"""The state of one plan execution (Run) and the typed state its op handlers hand to each
other: per chunk of new tokens its hidden states and, per MoE layer in flight, the routing,
the hop's operands and the expert outputs (Chunk, MoeLayer); per staging-ring slot what was
staged and what is loaded; for a dslp/ep plan its mesh, streamer and per-rank weights
(DslpState). Handlers live in runtime/ops.py and runtime/dist_exec.py, the table that maps
op kinds to them in runtime/executor.py.

Values an experiment or test reads from a run (experts touched, copy intervals) go to the
trace as slice args (Run.note), not into this state.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.moe import ExpertFn
from hmoe_jax.model.precision import F32, Precision
from hmoe_jax.plan import costs
from hmoe_jax.plan.buckets import cache_len
from hmoe_jax.plan.dist import ZigzagLayout
from hmoe_jax.plan.format import Op
from hmoe_jax.plan.trace import TraceRecorder
from hmoe_jax.runtime import hops
from hmoe_jax.runtime.dist_stream import RankStreamer
from hmoe_jax.runtime.kvpool import KVPool
from hmoe_jax.runtime.staging import StagingRing
from hmoe_jax.runtime.state import PlacedWeights


@dataclasses.dataclass
class MoeLayer:
    """One MoE layer of one chunk, from its routing to its combine (which drops it). Arrays
    on the accelerator unless named host_*."""

    x: Any = None  # [B, t, D] normed hidden states the experts take
    ids: Any = None  # [B, t, k] routed expert ids (None after attn_route: they are in `packed`)
    weights: Any = None  # [B, t, k] routing weights (likewise)
    packed: Any = None  # [B t, W] words: x | ids | weights of attn_route (pieces.pack_hop), taken by d2h
    shared: Any = None  # [B, t, D] the shared experts' output
    host_in: list | None = None  # the route operands on the host (d2h), taken by experts_cpu
    host_out: Any = None  # [B t, D] the routed experts' output on the host (act dtype), taken by h2d
    routed: Any = None  # [B, t, D] the routed experts' output (h2d; experts_acc's f32 accumulator)
    # experts_acc: (token, weights, offsets [E + 1] numpy) of the layer's assignments sorted
    # by expert, computed by its first group
    sorted: tuple | None = None


@dataclasses.dataclass
class Chunk:
    """The new tokens [t0, t1) of a run (a decode step: the one chunk, t = 1)."""

    h: Any = None  # [B, t, D] hidden states
    moe: dict[int, MoeLayer] = dataclasses.field(default_factory=dict)  # layer -> in flight

    def layer(self, i: int) -> MoeLayer:
        m = self.moe.get(i)
        return m if m is not None else self.moe.setdefault(i, MoeLayer())


@dataclasses.dataclass
class DslpState:
    """One dslp/ep prefill (runtime/dist_exec.py), created by its dslp_embed op."""

    mesh: Mesh
    layout: ZigzagLayout
    streamer: RankStreamer  # its log: every per-rank copy (tests prove what each rank received)
    scheme: str
    capacity: int | None
    expert_fn: ExpertFn  # the accelerator's routed-expert function (grouped GEMMs by default)
    comm: list[dict] = dataclasses.field(default_factory=list)  # per MoE layer: bytes moved
    h: Any = None  # [B, S_pad, D] zig-zag hidden states sharded over the ranks
    rest: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)  # (layer, rank) -> copy
    experts: dict[tuple[int, int], Any] = dataclasses.field(default_factory=dict)  # (layer, rank) -> share
    layer_rest: dict[int, Any] = dataclasses.field(default_factory=dict)  # layer -> replicated over the mesh


@dataclasses.dataclass
class Run:
    """State of one plan execution: inputs, the cache, per-chunk values, resources."""

    cfg: ModelConfig
    weights: PlacedWeights
    cache: KVPool
    tokens: np.ndarray  # [B, T] int32, the plan's new tokens: B rows decoding (T == 1) or one prefill chunk
    start_pos: int | np.ndarray  # position of tokens[:, 0]: an int (all rows) or [B]
    host_expert_fn: Callable  # jitted ExpertFn on host-device arrays
    rows: np.ndarray | None = None  # [B] pool rows of the sequences (None: rows 0..B-1)
    prec: Precision = F32
    attn: dict[str, Any] = dataclasses.field(default_factory=dict)  # form, q_block, k_block (prefill)
    ring: StagingRing | None = None
    trace: TraceRecorder | None = None
    link_gbps: float | None = None  # cap for activation hops too (weights: the ring's cap)
    acc_tflops_cap: float | None = None  # stand-in compute-rate emulation
    chunks: dict[int, Chunk] = dataclasses.field(default_factory=dict)  # by first token t0
    staged: dict[int, tuple[int, int, int]] = dataclasses.field(
        default_factory=dict
    )  # slot -> (layer, lo, hi)
    loaded: dict[int, Any] = dataclasses.field(default_factory=dict)  # slot -> its experts on the accelerator
    dslp: DslpState | None = None
    # op id -> extra args of its trace slice (traced runs only), added by the op's handler
    notes: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    logits: list[Any] = dataclasses.field(default_factory=list)  # chunks of [B, t, V]
    streamed_bytes: dict[int, int] = dataclasses.field(default_factory=dict)  # layer -> bytes loaded
    plan_index: int = 0  # which of the trace's plans this run is (slice arg "plan")
    # Runs executed at the same time (dual-batch decode, a chunk beside a decode step) share
    # one lock per resource: a resource then runs one op at a time across all of them, so
    # the runs alternate on the accelerator and the CPU experts instead of contending, and
    # the KV pool arrays (replaced by each attention op) see one writer at a time.
    locks: dict[str, threading.Lock] | None = None
    label: str | None = None  # trace slice arg "batch" (which micro-batch)
    # a padded prefill chunk (Engine.prefill_seq): tokens [0, real_tokens) are the prompt's,
    # the rest padding; a last-only final op takes position real_tokens - 1's logits
    real_tokens: int | None = None

    def __post_init__(self) -> None:
        b = self.tokens.shape[0]
        self.rows = np.arange(b, dtype=np.int32) if self.rows is None else np.asarray(self.rows, np.int32)
        self.positions = np.broadcast_to(np.asarray(self.start_pos, np.int32), (b,)).copy()

    @property
    def acc(self) -> jax.Device:
        return self.weights.placement.acc

    @property
    def hop_mode(self) -> str:
        """Where decode hops land on the host side: "direct" or "pinned" (runtime/hops.py;
        resolved once per device pair)."""
        return hops.hop_memory(self.acc, self.weights.placement.host)[0]

    def chunk(self, op: Op) -> Chunk:
        """The state of the chunk `op` works on (created by its first op)."""
        t0 = self.span(op)[0]
        c = self.chunks.get(t0)
        return c if c is not None else self.chunks.setdefault(t0, Chunk())

    def note(self, op: Op, **args: Any) -> None:
        """Add args to `op`'s trace slice (nothing when the run is not traced)."""
        if self.trace is not None:
            self.notes.setdefault(op.id, {}).update(args)

    def attn_args(self, t0: int, t1: int) -> tuple[tuple, dict]:
        """(rows, positions) operands and the static options of an attention piece for the
        new tokens [t0, t1): decode steps attend over the rows' first kv_len slots."""
        pos = self.positions + t0
        kw = dict(prec=self.prec, **self.attn)
        if t1 - t0 == 1:
            kw["kv_len"] = decode_kv_len(int(pos.max()) + 1, self.cache.max_len)
        else:
            kw["k_block"] = prefill_key_block(kw.get("k_block", K_BLOCK), t1 - t0, int(pos.max()) + t1 - t0)
        return (self.rows, pos), kw

    def span(self, op: Op) -> tuple[int, int]:
        t0, t1 = op.args.get("tokens", (0, self.tokens.shape[1]))
        return int(t0), int(t1)


K_BLOCK = 512  # the key block option's default (pieces.attention, plan.costs.attn_flops)


def prefill_key_block(k_block: int, tokens: int, end: int) -> int:
    """The key block of a prefill chunk of `tokens` (padded) tokens ending at position `end`
    (exclusive). The plan prices whole blocks of b = key_block(k_block, cache_len(end))
    (plan.costs.attn_flops); this is b, or the power of two >= tokens when that divides b
    (a divisor of cache_len(end) too), so the walk visits at most the keys priced, exactly
    them when `end` is a multiple of b (a first chunk: end = its padded length = b).
    Left to itself the walk would take gcd(k_block, pool row length), 512 on a 4K row: a
    128-token first chunk then attends over 512 key slots, 384 of them masked, 1.26x the
    priced FLOPs (210 vs 146 ms a layer at DeepSeek-V3 dims on 2 Zen 5 cores). The block
    depends on the padded length alone for a chunk that starts at a multiple of it (a prompt
    cut into power-of-two chunks), so warm-up's chunks at position 0 cover serving's."""
    b = costs.key_block(k_block, cache_len(end))
    cap = 1 << max(int(tokens) - 1, 0).bit_length()
    return cap if b % cap == 0 else b


def decode_kv_len(tokens: int, max_len: int) -> int:
    """Static prefix a decode step reads: `tokens` (max position + 1) rounded up to a power
    of two >= 64 (a few compiled shapes per batch size), capped at the row length."""
    return min(max_len, max(64, 1 << (max(tokens, 1) - 1).bit_length()))
