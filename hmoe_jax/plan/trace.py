"""Chrome trace-event JSON (opens in Perfetto / chrome://tracing): one track per resource
(each host->accelerator link, each accelerator, the CPU expert workers), one complete
("X") slice per executed op, from time.perf_counter_ns() taken around blocking points."""

from __future__ import annotations

import json
import statistics
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class TraceRecorder:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.slices: list[dict[str, Any]] = []
        self.meta: dict[str, Any] = {}

    def add(self, resource: str, name: str, start_ns: int, end_ns: int, **args: Any) -> None:
        with self._lock:
            self.slices.append(
                {
                    "resource": resource,
                    "name": name,
                    "start_ns": int(start_ns),
                    "end_ns": int(max(end_ns, start_ns)),
                    "args": args,
                }
            )

    def add_plan(self, meta: dict[str, Any]) -> int:
        """Record a plan about to run (meta["plans"]) -> its index, the slices' "plan" arg.
        Under the lock: the two micro-batches of a dual step add theirs from two threads."""
        with self._lock:
            plans = self.meta.setdefault("plans", [])
            plans.append(meta)
            return len(plans) - 1

    def to_chrome(self) -> dict[str, Any]:
        resources = sorted({s["resource"] for s in self.slices}, key=_track_order)
        tid = {r: i for i, r in enumerate(resources)}
        t0 = min((s["start_ns"] for s in self.slices), default=0)
        events: list[dict[str, Any]] = [
            {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "hmoe engine"}}
        ]
        for r, i in tid.items():
            events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": i, "args": {"name": r}})
            events.append(
                {"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": i, "args": {"sort_index": i}}
            )
        for s in sorted(self.slices, key=lambda s: s["start_ns"]):
            events.append(
                {
                    "ph": "X",
                    "name": s["name"],
                    "pid": 0,
                    "tid": tid[s["resource"]],
                    "ts": (s["start_ns"] - t0) / 1e3,
                    "dur": (s["end_ns"] - s["start_ns"]) / 1e3,
                    "args": {"resource": s["resource"], **s["args"]},
                }
            )
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": self.meta}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_chrome()))


def _track_order(resource: str) -> tuple[int, str]:
    kind = resource.split(":")[0]
    rank = {"stage": 0, "copy": 0, "h2d": 0, "acc": 1, "unload": 2, "d2h": 3, "cpu_experts": 4}.get(kind, 5)
    return rank, resource


def load_slices(path: str | Path) -> list[dict[str, Any]]:
    """The X slices of a trace file as dicts with resource, name, ts_us, dur_us, args."""
    d = json.loads(Path(path).read_text())
    return [
        {
            "resource": e["args"]["resource"],
            "name": e["name"],
            "ts_us": e["ts"],
            "dur_us": e["dur"],
            "args": e["args"],
        }
        for e in d["traceEvents"]
        if e.get("ph") == "X"
    ]


def experts_touched(slices: Iterable[dict[str, Any]], batch: str | None = None) -> dict[int, int]:
    """Distinct routed experts the host read per MoE layer, summed over the traced
    experts_cpu ops of `slices` (TraceRecorder.slices; batch: only that micro-batch's). The
    executor counts them from the routing ids that hop to the host (slice arg
    experts_touched), in traced runs only."""
    out: dict[int, int] = {}
    for s in slices:
        a = s["args"]
        if "experts_touched" in a and (batch is None or a.get("batch") == batch):
            out[a["layer"]] = out.get(a["layer"], 0) + int(a["experts_touched"])
    return out


def attention_moe_split(items: Iterable[tuple[str, int, float]]) -> tuple[float, float] | None:
    """(A, M) of one decode step from (resource, layer, seconds) items: per MoE layer (a layer
    with CPU routed-expert work), the accelerator's seconds and the CPU experts' seconds,
    medians over those layers; None without CPU expert work (a dense model). engine/dual.py
    reads the items off a trace, sim/serve.py off a simulated timeline."""
    acc: dict[int, float] = {}
    cpu: dict[int, float] = {}
    for resource, layer, dur in items:
        if resource == "cpu_experts":
            cpu[layer] = cpu.get(layer, 0.0) + dur
        elif resource.startswith("acc") and layer >= 0:
            acc[layer] = acc.get(layer, 0.0) + dur
    moe = sorted(cpu)
    if not moe:
        return None
    return float(statistics.median(acc.get(i, 0.0) for i in moe)), float(
        statistics.median(cpu[i] for i in moe)
    )
