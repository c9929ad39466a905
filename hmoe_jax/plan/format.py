"""Plans are data: the ops a schedule wants run, with their resource, bytes, FLOPs and deps.

A Plan is what a schedule returns and what the executor (runtime/executor.py) runs; the
simulator can time the same JSON on other hardware. Format (docs/engine.md):

    {"format": "hmoe-plan/1", "schedule": "slp", "num_tokens": 8192, "meta": {...},
     "ops": [{"id": 0, "kind": "embed", "resource": "acc:0", "layer": -1,
              "bytes": 0, "flops": 0, "deps": [], "args": {}}, ...]}

Ops are listed in a valid execution order: every dep refers to an earlier op, so a plan is
a DAG by construction and one pass in list order is a legal serial schedule. `bytes` is
what the op moves over its resource (a link's copy size, or the weight bytes a compute op
reads); `flops` counts multiply-adds twice.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from typing import Any

PLAN_FORMAT = "hmoe-plan/1"

# Kinds of the single-device schedules; a schedule may add its own kinds (dslp/ep: dslp_*),
# each with a handler in the executor's table (runtime/executor.HANDLERS).
OP_KINDS = (
    "embed",  # tokens -> h on the accelerator
    "attn",  # input norm + MLA + residual; writes the layer's latent cache
    "dense_ffn",  # post-attention norm + dense SwiGLU + residual (layers < first_k_dense_replace)
    "route",  # post-attention norm + gating: x, ids, weights
    "attn_route",  # attn + route of a MoE layer as one computation (cpu schedule, fused=True)
    "shared",  # shared expert(s) on x
    "d2h",  # hidden states (x, ids, weights) accelerator -> host
    "experts_cpu",  # routed experts on the host CPU (ExpertFn)
    "h2d",  # routed-expert output host -> accelerator
    "stage",  # queue the host memcpy of a group of experts into its staging slot (slp)
    "load",  # stream a group of a layer's experts host -> a ring slot on the accelerator
    "experts_acc",  # grouped GEMM of the experts held in one ring slot
    "unload",  # release a ring slot (the loader may refill it)
    "combine",  # h + routed + shared
    "final",  # final norm + lm_head
    "forward",  # the whole plain model forward (reference schedule)
)


class PlanError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Op:
    id: int
    kind: str
    resource: str  # "acc:0", "h2d:0", "d2h:0", "cpu_experts", "unload:0", ...
    layer: int = -1  # -1: not tied to a layer (embed, final)
    bytes: int = 0
    flops: int = 0
    deps: tuple[int, ...] = ()
    args: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["deps"] = list(self.deps)
        return d


@dataclasses.dataclass(frozen=True)
class Plan:
    schedule: str
    num_tokens: int
    ops: tuple[Op, ...]
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)

    def validate(self) -> Plan:
        seen: set[int] = set()
        for i, op in enumerate(self.ops):
            if op.id != i:
                raise PlanError(
                    f"plan {self.schedule!r}: op at index {i} has id {op.id} (ids must be 0..n-1 in order)"
                )
            for d in op.deps:
                if d not in seen:
                    raise PlanError(
                        f"plan {self.schedule!r}: op {op.id} ({op.kind}) depends on {d}, which is not an earlier op"
                    )
            if op.bytes < 0 or op.flops < 0:
                raise PlanError(f"plan {self.schedule!r}: op {op.id} has negative bytes/flops")
            seen.add(op.id)
        return self

    def resources(self) -> list[str]:
        return sorted({op.resource for op in self.ops})

    def kind_counts(self) -> Counter:
        return Counter(op.kind for op in self.ops)

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "schedule": self.schedule,
            "num_tokens": self.num_tokens,
            "meta": self.meta,
            "ops": [op.to_dict() for op in self.ops],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Plan:
        if d.get("format") != PLAN_FORMAT:
            raise PlanError(f"plan: format {d.get('format')!r}, expected {PLAN_FORMAT!r}")
        ops = tuple(
            Op(
                id=int(o["id"]),
                kind=str(o["kind"]),
                resource=str(o["resource"]),
                layer=int(o.get("layer", -1)),
                bytes=int(o.get("bytes", 0)),
                flops=int(o.get("flops", 0)),
                deps=tuple(int(x) for x in o.get("deps", ())),
                args=dict(o.get("args", {})),
            )
            for o in d["ops"]
        )
        return Plan(
            schedule=str(d["schedule"]),
            num_tokens=int(d["num_tokens"]),
            ops=ops,
            meta=dict(d.get("meta", {})),
        ).validate()

    @staticmethod
    def from_json(s: str) -> Plan:
        return Plan.from_dict(json.loads(s))


class PlanBuilder:
    """Appends ops with consecutive ids; `add` returns the new op's id for later deps."""

    def __init__(self, schedule: str, num_tokens: int):
        self.schedule = schedule
        self.num_tokens = num_tokens
        self.ops: list[Op] = []

    def add(
        self,
        kind: str,
        resource: str,
        *,
        layer: int = -1,
        bytes: int = 0,
        flops: int = 0,
        deps: tuple[int, ...] | list[int] = (),
        **args: Any,
    ) -> int:
        i = len(self.ops)
        clean = tuple(sorted({int(d) for d in deps if d is not None}))
        self.ops.append(Op(i, kind, resource, layer, int(bytes), int(flops), clean, args))
        return i

    def build(self, **meta: Any) -> Plan:
        return Plan(self.schedule, self.num_tokens, tuple(self.ops), meta).validate()
