"""A plan's time from the system's rates (docs/engine.md "Plans"): each resource runs its ops
in plan order, each op once its deps are done, for bytes / rate or flops / rate. Plain
arithmetic (no jax): the time budget `hmoe plan` prints next to the memory budget.

Rates: acc:* compute ops at the dense rate of the dtype the plan says its GEMMs run in
(plan.meta["compute_dtype"], plan.costs.POLICY_GEMM_DTYPE), or at the accelerator's memory
bandwidth for the weight bytes they read if that is slower; h2d / d2h at h2d_gbps; the
stager's host memcpy and the CPU experts at cpu_mem_gbps (bandwidth-bound lower bounds);
unloads free. Collectives between ranks (args.comm) and dispatch overheads are not priced,
so this is an estimate of the ideal pipelined run, not a prediction of a measured one.
"""

from __future__ import annotations

from hmoe_jax.plan import costs
from hmoe_jax.plan.format import Op, Plan
from hmoe_jax.plan.system import SystemSpec


def op_seconds(op: Op, system: SystemSpec, compute_dtype: str = "bf16") -> float:
    res = op.resource.split(":")[0]
    if res == "acc":
        t = op.flops / costs.acc_flops_per_s(system, compute_dtype)
        return max(t, op.bytes / (system.acc_mem_gbps * 1e9))
    if res in ("h2d", "d2h"):
        return op.bytes / (system.h2d_gbps * 1e9)
    if res in ("stage", "cpu_experts"):
        return op.bytes / (system.cpu_mem_gbps * 1e9)
    return 0.0


def simulate(plan: Plan, system: SystemSpec) -> dict[str, float]:
    """{"total_s": makespan, "<resource>_busy_s": time each resource is busy}."""
    dtype = str(plan.meta.get("compute_dtype", "bf16"))
    end = [0.0] * len(plan.ops)
    free: dict[str, float] = {}
    busy: dict[str, float] = {}
    for op in plan.ops:  # list order is a valid order, and each resource's order
        dur = op_seconds(op, system, dtype)
        start = max([free.get(op.resource, 0.0), *(end[d] for d in op.deps)])
        end[op.id] = start + dur
        free[op.resource] = end[op.id]
        busy[op.resource] = busy.get(op.resource, 0.0) + dur
    out = {"total_s": max(end, default=0.0)}
    out.update({f"{r}_busy_s": s for r, s in sorted(busy.items())})
    return out
