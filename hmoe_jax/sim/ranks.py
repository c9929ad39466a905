"""dslp ranks as separate timelines that meet at each collective.

A dslp plan (schedules/dslp.py) writes each compute op once, on "acc:all", with its per-rank
flops and its collectives in args.comm: every rank in lock-step. `split_ranks` rewrites it
for the simulator (sim/run.time_plan, sim/serve.py): each such op becomes
  - one "collective" op per collective before the compute (cp attention's all_gather of the
    latent cache, SmallEP's all_gather, EP's dispatch all_to_all), on "acc:all", depending on
    every rank's previous work: it starts only when the last rank arrives (a barrier), and
    moves every rank's share at once (sim/pricing.py prices it);
  - one compute op per rank r on "acc:r" (the same kind, args.rank = r, no comm), depending
    on the collective before it or, without one, on rank r's own previous op (and rank r's own
    loads: an op of another rank, args.rank != r, is not waited for);
  - one "collective" op per collective after the compute (SmallEP's reduce_scatter, EP's
    combine all_to_all), again a barrier over the ranks' compute ops.
A later op waits for rank r's end of an earlier split op (its own rank's, when it has
args.rank; every rank's otherwise).

Per-rank work: op.flops (what every rank does, the lock-step plan's figure), or
args.rank_flops (a list of N ints: an uneven split), times `rank_scale` (a what-if: a rank
that is slower or has more work). With equal ranks and no rank_scale the split plan times
exactly as the lock-step op (tests/test_sim_collectives.py): the ranks finish their compute
together, so no barrier waits.
"""

from __future__ import annotations

from collections.abc import Sequence

from hmoe_jax.plan.format import Op, Plan
from hmoe_jax.sim.events import SimError
from hmoe_jax.sim.pricing import DSLP_COMPUTE, comm_split


def _rank_flops(plan: Plan, op: Op, n: int, scale: Sequence[float]) -> list[tuple[int, int]]:
    """(flops, fp8_flops) of each rank of a dslp compute op."""
    per = op.args.get("rank_flops")
    if per is None:
        per = [op.flops] * n
    elif not (
        isinstance(per, (list, tuple)) and len(per) == n and all(isinstance(f, int) and f >= 0 for f in per)
    ):
        raise SimError(
            f"plan {plan.schedule!r}: op {op.id} ({op.kind}) has rank_flops={per!r}; expected {n} ints >= 0"
        )
    fp8 = int(op.args.get("fp8_flops", 0))
    out = []
    for r in range(n):
        f = round(per[r] * scale[r])
        out.append((f, min(f, round(fp8 * f / op.flops)) if op.flops else 0))
    return out


def split_ranks(plan: Plan, rank_scale: Sequence[float] | None = None) -> Plan:
    """The plan with each dslp compute op split into per-rank ops and barrier collectives
    (the module docstring); a plan without dslp compute ops is returned as it is."""
    if not any(op.kind in DSLP_COMPUTE and "rank" not in op.args for op in plan.ops):
        if rank_scale is not None:
            raise SimError(
                f"plan {plan.schedule!r}: rank_scale given, but it has no dslp compute ops to split"
            )
        return plan
    n = int(plan.meta.get("devices", 1))
    scale = [1.0] * n if rank_scale is None else [float(s) for s in rank_scale]
    if len(scale) != n or not all(s > 0 for s in scale):
        raise SimError(f"split_ranks: rank_scale {rank_scale!r}; expected {n} numbers > 0 (one per rank)")
    ops: list[Op] = []
    ends: dict[int, tuple[int, ...]] = {}  # old op id -> rank r's last new op

    def add(kind: str, resource: str, deps: set[int], **kw) -> int:
        i = len(ops)
        ops.append(Op(i, kind, resource, deps=tuple(sorted(deps)), **kw))
        return i

    def rank_of(old: int) -> int | None:
        r = plan.ops[old].args.get("rank")
        return r if isinstance(r, int) and 0 <= r < n else None

    for op in plan.ops:
        if op.kind not in DSLP_COMPUTE:
            mine = rank_of(op.id)
            deps = (
                {ends[d][mine] for d in op.deps}
                if mine is not None
                else {e for d in op.deps for e in ends[d]}
            )
            ends[op.id] = (
                add(op.kind, op.resource, deps, layer=op.layer, bytes=op.bytes, flops=op.flops, args=op.args),
            ) * n
            continue
        cur = [{ends[d][r] for d in op.deps if rank_of(d) in (None, r)} for r in range(n)]
        before, after = comm_split(op.args.get("comm"), n)
        tag = {"of": op.kind, "lockstep_op": op.id}
        for label, nbytes in before:  # barrier: waits for every rank
            c = add("collective", "acc:all", set().union(*cur), layer=op.layer,
                    args={"collective": label, "per_rank_bytes": nbytes, **tag})  # fmt: skip
            cur = [{c} for _ in range(n)]
        args = {k: v for k, v in op.args.items() if k not in ("comm", "rank_flops", "fp8_flops")}
        for r, (f, f8) in enumerate(_rank_flops(plan, op, n, scale)):
            c = add(op.kind, f"acc:{r}", cur[r], layer=op.layer, bytes=op.bytes, flops=f,
                    args={**args, "fp8_flops": f8, "rank": r, "lockstep_op": op.id})  # fmt: skip
            cur[r] = {c}
        for label, nbytes in after:
            c = add("collective", "acc:all", set().union(*cur), layer=op.layer,
                    args={"collective": label, "per_rank_bytes": nbytes, **tag})  # fmt: skip
            cur = [{c} for _ in range(n)]
        ends[op.id] = tuple(next(iter(c)) for c in cur)
    return Plan(plan.schedule, plan.num_tokens, tuple(ops), {**plan.meta, "ranks": "separate"}).validate()
