"""The discrete-event core: plans' ops on queues, sharing physical resources fairly.

Two layers of contention, as in runtime/executor.py:

- Queues. The executor runs one worker thread per plan resource ("acc:0", "h2d:0", "stage:0",
  "cpu_experts", ...); a worker takes its ops in plan order, each once its deps are done, and
  runs one op at a time. A queue here is exactly that: (queue group, plan resource). Runs
  in one lock group share their queues (executor.shared_locks: dual-batch micro-batches on
  one accelerator); a shared queue serves the ready head op that became ready first
  (ties: the run submitted first). Serial mode puts every op of a run on one queue.
- Resources. An op's work is a list of phases run one after the other; each phase is a
  fixed overhead (dispatch, launch, a copy call: it holds the queue but no resource) then
  its demand: seconds it would take ALONE on each physical resource it uses ("dram0",
  "cpu1", "acc0", "accmem0", "h2d1", ...). Alone, a phase takes max over its resources
  (the roofline). Concurrent phases share each resource by dominant-resource fairness
  (progressive filling): every active phase's dominant share grows at the same pace until a
  resource is full; the phases using it freeze there, the others keep growing. Two equal
  streams on one link each get half of it; a phase bound elsewhere takes only what it can
  use, and the rest goes to the others (work-conserving).

Interference beyond fair sharing (sim/interference.py, each off unless its profile input is
set): `capacity(resource, users)` is the fraction of a resource left while `users` phases use
it at once (DRAM co-run loss); a plan resource in `shared_resources` is one queue for every
run (a process-wide lock: the CPU MoE op's mutex), not one per queue group.

Each op records the resource that bound it over time (its own dominant resource while it ran
at full speed, the contended resource while it was held back, "overhead" during overheads),
so a projection error can be traced to an input. Everything is plain floats; no jax.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from hmoe_jax.plan.format import Plan


class SimError(ValueError):
    pass


def _tol(t_s: float) -> float:
    """Two event times closer than this are one event (float resolution at t_s)."""
    return 1e-12 * max(1.0, abs(t_s))


@dataclasses.dataclass(frozen=True)
class Phase:
    label: str
    demand_s: Mapping[str, float]  # physical resource -> seconds alone at its effective rate
    overhead_s: float = 0.0

    @property
    def alone_s(self) -> float:
        return self.overhead_s + max(self.demand_s.values(), default=0.0)


@dataclasses.dataclass
class _Op:
    run: int
    op: int
    queue: tuple[Any, str]
    phases: tuple[Phase, ...]
    deps_left: int
    dependents: list[int] = dataclasses.field(default_factory=list)  # global op indices
    ready_s: float = 0.0
    start_s: float | None = None
    end_s: float | None = None
    phase: int = 0
    overhead_until: float | None = None
    remaining: float = 1.0  # fraction of the current phase's demand left
    bound_s: dict[str, float] = dataclasses.field(default_factory=dict)

    def demand(self) -> Mapping[str, float]:
        return self.phases[self.phase].demand_s


@dataclasses.dataclass
class _Run:
    plan: Plan
    label: str
    start_s: float
    group: Any
    first: int  # global index of op 0
    left: int  # ops not finished
    started: bool = False
    end_s: float | None = None
    devices: tuple[int, ...] = ()


PriceFn = Callable[[Plan, int, tuple[int, ...]], tuple[Phase, ...]]
CapacityFn = Callable[[str, int], float]
# the queue group of a resource every run shares (a process-wide lock): no caller's group
_PROCESS = ("process-wide lock",)


class Simulator:
    """Submit plans (now or later), advance the clock, read the timeline.

    price(plan, op_index, devices) -> phases of that op (sim/pricing.py binds a profile);
    capacity, shared_resources: interference (module docstring; sim/interference.sim_options
    builds them from a profile)."""

    def __init__(
        self,
        price: PriceFn,
        *,
        mode: str = "pipelined",
        capacity: CapacityFn | None = None,
        shared_resources: frozenset[str] = frozenset(),
    ):
        if mode not in ("pipelined", "serial"):
            raise SimError(f"simulator: mode {mode!r}, expected 'pipelined' or 'serial'")
        self.price, self.mode = price, mode
        self.capacity = capacity
        self.shared_resources = frozenset(shared_resources)
        self.now_s = 0.0
        self.runs: list[_Run] = []
        self.ops: list[_Op] = []
        self._queues: dict[tuple[Any, str], dict[int, deque[int]]] = {}
        self._busy: dict[tuple[Any, str], int | None] = {}
        self._active: set[int] = set()
        self._pending: list[tuple[float, int]] = []  # (start_s, run) not yet started
        self._dirty: set[tuple[Any, str]] = set()  # queues that may have an op to start
        self.busy_s: dict[str, float] = {}  # resource -> integral of its used fraction
        self._open = 0  # runs submitted and not finished

    @property
    def idle(self) -> bool:
        """No run is in flight or waiting to start: what runs next runs alone."""
        return self._open == 0

    # ------------------------------------------------------------ building

    def submit(
        self,
        plan: Plan,
        *,
        at_s: float | None = None,
        devices: tuple[int, ...] | None = None,
        label: str = "",
        group: Any = None,
    ) -> int:
        """Add a plan run starting at at_s (default now) on physical accelerators `devices`
        (plan accelerator k -> devices[k]; default 0..n-1). group: runs with the same group
        share their queues (one lock per resource); None: a private group."""
        start = self.now_s if at_s is None else float(at_s)
        if start < self.now_s - _tol(self.now_s):
            raise SimError(f"simulator: run {label!r} submitted at {start} s, before now ({self.now_s} s)")
        start = max(start, self.now_s)
        rid = len(self.runs)
        n_dev = int(plan.meta.get("devices", 1))
        devs = tuple(devices) if devices is not None else tuple(range(n_dev))
        run = _Run(
            plan, label or f"run{rid}", start, rid if group is None else group, len(self.ops), 0, devices=devs
        )
        self.runs.append(run)
        for op in plan.ops:
            queue = (run.group, "serial" if self.mode == "serial" else op.resource)
            if self.mode == "pipelined" and op.resource in self.shared_resources:
                queue = (_PROCESS, op.resource)  # one lock for the whole process
            phases = self.price(plan, op.id, devs)
            g = len(self.ops)
            self.ops.append(_Op(rid, op.id, queue, phases, len(op.deps)))
            for d in op.deps:
                self.ops[run.first + d].dependents.append(g)
            self._queues.setdefault(queue, {}).setdefault(rid, deque()).append(g)
            self._busy.setdefault(queue, None)
        run.left = len(plan.ops)
        self._open += run.left > 0
        if run.left == 0:
            run.started, run.end_s = True, start
        else:
            heapq.heappush(self._pending, (start, rid))
        return rid

    # ------------------------------------------------------------ the clock

    def done(self, rid: int) -> bool:
        return self.runs[rid].end_s is not None

    def run_until(self, *, rid: int | None = None, t_s: float | None = None) -> float:
        """Advance until run `rid` is finished (its end time is returned), or to time t_s,
        or (neither) until every submitted run is finished."""
        while True:
            if rid is not None and self.done(rid):
                return float(self.runs[rid].end_s)
            if t_s is not None and self.now_s >= t_s - _tol(t_s):
                self.now_s = max(self.now_s, t_s)
                return self.now_s
            if not self._step(t_s):
                if rid is not None:
                    raise SimError(f"simulator: run {rid} cannot finish (a dependency cycle or a lost op)")
                if t_s is not None:
                    self.now_s = max(self.now_s, t_s)
                return self.now_s

    def run_until_any(self, rids: list[int], *, t_s: float | None = None) -> float:
        """Advance until one of the runs `rids` is finished, or to time t_s (whichever comes
        first); returns the clock. A serving loop waits like this on its background runs."""
        while not any(self.done(r) for r in rids):
            if t_s is not None and self.now_s >= t_s - _tol(t_s):
                self.now_s = max(self.now_s, t_s)
                break
            if not self._step(t_s):
                if t_s is None:
                    raise SimError(f"simulator: none of runs {rids} can finish")
                self.now_s = max(self.now_s, t_s)
                break
        return self.now_s

    def _start_runs(self) -> None:
        while self._pending and self._pending[0][0] <= self.now_s + _tol(self.now_s):
            _, rid = heapq.heappop(self._pending)
            run = self.runs[rid]
            run.started = True
            for g in range(run.first, run.first + len(run.plan.ops)):
                self._dirty.add(self.ops[g].queue)
                if self.ops[g].deps_left == 0:
                    self.ops[g].ready_s = run.start_s

    def _startable(self, queue: tuple[Any, str]) -> int | None:
        best = None
        for rid, dq in self._queues[queue].items():
            if not dq or not self.runs[rid].started:
                continue
            g = dq[0]
            if self.ops[g].deps_left:
                continue
            key = (self.ops[g].ready_s, rid)
            if best is None or key < best[0]:
                best = (key, g)
        return None if best is None else best[1]

    def _start_ops(self) -> None:
        dirty, self._dirty = self._dirty, set()
        for queue in dirty:
            if self._busy[queue] is not None:
                continue
            g = self._startable(queue)
            if g is None:
                continue
            o = self.ops[g]
            dq = self._queues[queue][o.run]
            dq.popleft()
            if not dq:  # a finished run leaves its queues (serving submits thousands of runs)
                del self._queues[queue][o.run]
            self._busy[queue] = g
            o.start_s = self.now_s
            self._enter_phase(g)

    def _enter_phase(self, g: int) -> None:
        o = self.ops[g]
        ph = o.phases[o.phase]
        o.remaining = 1.0
        o.overhead_until = self.now_s + ph.overhead_s if ph.overhead_s > 0 else None
        self._active.add(g)

    def _rates(self) -> dict[int, tuple[float, str]]:
        """Progress rate (phase fraction per second) and binding resource of every active
        op past its overhead: dominant-resource fair shares by progressive filling."""
        work = {g: self.ops[g].demand() for g in self._active if self.ops[g].overhead_until is None}
        dom = {g: max(d.values(), default=0.0) for g, d in work.items()}
        out: dict[int, tuple[float, str]] = {}
        used: dict[str, float] = {}
        free = {g for g in work if dom[g] > 0}
        for g in work:
            if dom[g] <= 0:
                out[g] = (float("inf"), "none")
        cap = self._capacities(work) if self.capacity is not None else {}
        while free:
            load: dict[str, float] = {}
            for g in free:
                for r, t in work[g].items():
                    if t > 0:
                        load[r] = load.get(r, 0.0) + t / dom[g]
            level, hot = 1.0, None
            for r, ld in load.items():
                lv = (cap.get(r, 1.0) - used.get(r, 0.0)) / ld
                if lv < level - 1e-12:
                    level, hot = max(lv, 0.0), r
            if hot is None:
                for g in free:
                    out[g] = (1.0 / dom[g], max(work[g], key=work[g].get))
                break
            frozen = [g for g in free if work[g].get(hot, 0.0) > 0]
            for g in frozen:
                out[g] = (level / dom[g], hot)
                for r, t in work[g].items():
                    used[r] = used.get(r, 0.0) + level * t / dom[g]
            free.difference_update(frozen)
        return out

    def _capacities(self, work: Mapping[int, Mapping[str, float]]) -> dict[str, float]:
        """resource -> the fraction of it left with this many phases using it at once."""
        users: dict[str, int] = {}
        for d in work.values():
            for r, t in d.items():
                if t > 0:
                    users[r] = users.get(r, 0) + 1
        assert self.capacity is not None
        out = {r: float(self.capacity(r, n)) for r, n in users.items()}
        for r, c in out.items():
            if not 0 < c <= 1:
                raise SimError(f"simulator: capacity of {r!r} with {users[r]} users is {c}, expected (0, 1]")
        return out

    def _step(self, until_s: float | None) -> bool:
        """One event: start what can start, advance to the next change, finish what ends."""
        self._start_runs()
        self._start_ops()
        rates = self._rates()
        nxt = float("inf")
        for g in self._active:
            o = self.ops[g]
            if o.overhead_until is not None:
                nxt = min(nxt, o.overhead_until)
            else:
                x = rates[g][0]
                nxt = min(nxt, self.now_s + (o.remaining / x if x != float("inf") else 0.0))
        if self._pending:
            nxt = min(nxt, self._pending[0][0])
        if nxt == float("inf"):
            return False
        if until_s is not None and nxt > until_s:
            nxt = until_s
        dt = max(nxt - self.now_s, 0.0)
        ending: list[int] = []
        for g in list(self._active):
            o = self.ops[g]
            if o.overhead_until is not None:
                o.bound_s["overhead"] = o.bound_s.get("overhead", 0.0) + dt
                if o.overhead_until <= nxt + _tol(nxt):
                    o.overhead_until = None
                    if max(o.demand().values(), default=0.0) <= 0:
                        ending.append(g)
                continue
            x, hot = rates[g]
            if x == float("inf"):
                ending.append(g)
                continue
            finish_s = self.now_s + o.remaining / x
            step = min(x * dt, o.remaining)
            o.remaining -= step
            o.bound_s[hot] = o.bound_s.get(hot, 0.0) + dt
            for r, t in o.demand().items():
                self.busy_s[r] = self.busy_s.get(r, 0.0) + step * t
            if o.remaining <= 1e-12 or finish_s <= nxt + _tol(nxt):
                ending.append(g)
        self.now_s = nxt
        for g in ending:
            self._phase_done(g)
        return True

    def _phase_done(self, g: int) -> None:
        o = self.ops[g]
        self._active.discard(g)
        o.phase += 1
        if o.phase < len(o.phases):
            self._enter_phase(g)
            return
        o.end_s = self.now_s
        self._busy[o.queue] = None
        self._dirty.add(o.queue)
        for d in o.dependents:
            dep = self.ops[d]
            dep.deps_left -= 1
            dep.ready_s = max(dep.ready_s, self.now_s, self.runs[dep.run].start_s)
            if dep.deps_left == 0:
                self._dirty.add(dep.queue)
        run = self.runs[o.run]
        run.left -= 1
        if run.left == 0:
            run.end_s = self.now_s
            self._open -= 1

    # ------------------------------------------------------------ reading

    def timeline(self, rid: int | None = None) -> list[dict[str, Any]]:
        """One record per finished op (of run rid, or all): times, queue, bound."""
        out = []
        for o in self.ops:
            if o.end_s is None or (rid is not None and o.run != rid):
                continue
            run = self.runs[o.run]
            op = run.plan.ops[o.op]
            bound = max(o.bound_s, key=o.bound_s.get) if o.bound_s else "none"
            out.append(
                {
                    "run": o.run,
                    "label": run.label,
                    "op": o.op,
                    "kind": op.kind,
                    "layer": op.layer,
                    "queue": op.resource if self.mode == "pipelined" else "serial",
                    "ready_s": o.ready_s,
                    "start_s": o.start_s,
                    "end_s": o.end_s,
                    "dur_s": o.end_s - o.start_s,
                    "wait_s": o.start_s - o.ready_s,
                    "alone_s": sum(p.alone_s for p in o.phases),
                    "bound": bound,
                    "bound_s": dict(o.bound_s),
                    "phases": [p.label for p in o.phases],
                    "bytes": op.bytes,
                    "flops": op.flops,
                }
            )
        return out
