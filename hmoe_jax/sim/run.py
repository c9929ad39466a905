"""Timing the engine's own plans on a profile: one plan, a request (prefill + decode), and
what bound it.

The plan is built by the same schedule code the engine calls (schedules/registry.py) with
the SystemSpec the profile implies (SystemSpec.from_profile), so what is timed is what the
engine would run on that box; sim/reads.py adds the bytes each compute op reads, and
sim/pricing.py + sim/events.py time it. Nothing here imports jax.

What-ifs (`hmoe simulate`'s flags, each labelled in the record): a ring size for the slp
plan (`ring_slots`, the schedule's own override), the GEMM dtype the accelerator's GEMMs are
priced at (`price_gemms_as`), and the decode plan's form and executor (DECODE_MODES).

Binding resources are read off the critical path: walking back from the op that finished
last, each op's predecessor is whichever held it up last (a dependency that ended last, or
the op before it on its queue); the seconds of the path are attributed to the resource
that bound each op while it ran ("overhead" for fixed per-op costs). So `binding` answers
"which input would move the total", where per-resource busy time would not (a link can be
busy all along and still not be what the prefill waits for).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hmoe_jax.config import ModelConfig
from hmoe_jax.plan import costs
from hmoe_jax.plan.format import Plan
from hmoe_jax.plan.profile import Profile
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.schedules.registry import get_schedule
from hmoe_jax.sim.events import Simulator
from hmoe_jax.sim.interference import sim_options
from hmoe_jax.sim.pricing import pricer
from hmoe_jax.sim.ranks import split_ranks
from hmoe_jax.sim.reads import with_reads

# --decode-mode: the cpu schedule's decode plan options and the executor mode the step is
# timed with. "fused" is what the engine runs by default: attention + gating as one
# attn_route op (with the shared expert inside it, fuse_shared_tokens) on the worker-thread
# executor ("pipelined"; the engine's default async decode is modelled by it, e03 reports the
# error against both). "separate": attn and route as two ops (CpuSchedule fused=False).
# "*-serial": every op one at a time in plan order (the executor's "serial" mode, the
# overlap-disabled baseline e03 measures beside async).
DECODE_MODES: dict[str, tuple[dict[str, Any], str]] = {
    "fused": ({"fused": True}, "pipelined"),
    "separate": ({"fused": False}, "pipelined"),
    "fused-serial": ({"fused": True}, "serial"),
    "separate-serial": ({"fused": False}, "serial"),
}
GEMM_DTYPES = ("fp32", "bf16", "fp8")


def price_gemms_as(plan: Plan, dtype: str) -> tuple[Plan, int]:
    """(the plan with every accelerator GEMM priced at `dtype`, the fp8_flops it moved): its
    meta gemm_dtype_whatif set to `dtype` (sim/pricing.py prices GEMMs at it instead of
    compute_dtype, which still sets the cache's value bytes) and each op's fp8_flops (the part of its flops the plan
    runs as FP8 GEMMs, sim/pricing.py) dropped, so those flops are priced at `dtype` too. The
    ops, their order and the ring stay the plan the engine builds; prefill attention pieces
    priced at a profile's measured attn_<form>_tflops keep that rate (a measured piece, not a
    GEMM)."""
    if dtype not in GEMM_DTYPES:
        raise ValueError(f"gemm dtype {dtype!r}, expected one of {list(GEMM_DTYPES)}")
    moved = sum(int(op.args.get("fp8_flops", 0)) for op in plan.ops)
    ops = tuple(
        dataclasses.replace(op, args={k: v for k, v in op.args.items() if k != "fp8_flops"})
        if "fp8_flops" in op.args
        else op
        for op in plan.ops
    )
    return Plan(plan.schedule, plan.num_tokens, ops, {**plan.meta, "gemm_dtype_whatif": dtype}), moved


@dataclasses.dataclass(frozen=True)
class PlanTime:
    total_s: float
    binding: dict[str, float]  # resource -> seconds of the critical path it bound
    busy_s: dict[str, float]  # physical resource -> seconds of full use
    by_kind: dict[str, dict[str, Any]]  # op kind -> count, seconds, dominant bound
    timeline: list[dict[str, Any]]

    @property
    def bound(self) -> str:
        return max(self.binding, key=self.binding.get) if self.binding else "none"

    def summary(self) -> dict[str, Any]:
        tot = sum(self.binding.values()) or 1.0
        return {
            "total_s": self.total_s,
            "bound": self.bound,
            "binding_share": {
                r: round(s / tot, 4) for r, s in sorted(self.binding.items(), key=lambda kv: -kv[1])
            },
            "by_kind": self.by_kind,
        }


def build_plan(
    cfg: ModelConfig,
    profile: Profile,
    schedule: str,
    num_tokens: int,
    *,
    start_pos: int = 0,
    **options: Any,
) -> tuple[Plan, str | None]:
    """(the plan the engine's schedule builds on this profile's box (auto resolved), None),
    or, when the engine would refuse it for accelerator memory (ScheduleError from the
    budget), (the same schedule's plan on a box with unlimited accelerator memory, the
    budget's message): a projection then says it does not fit instead of failing, and the
    timing is that of the plan as if it fitted (for slp the ring then holds a full layer)."""
    system = SystemSpec.from_profile(profile)
    devices = profile.accelerators
    if schedule == "auto":
        schedule = get_schedule("auto").choose(system, num_tokens, devices, start_pos)
    s = get_schedule(schedule, **options)
    n = s.uses_devices(devices)
    budget = s.budget(cfg, system, num_tokens, devices=n, start_pos=start_pos)
    if budget is None or budget.fits:
        return s.plan(cfg, system, num_tokens, devices=n, start_pos=start_pos), None
    roomy = dataclasses.replace(system, acc_mem_bytes=1 << 50)
    return s.plan(cfg, roomy, num_tokens, devices=n, start_pos=start_pos), budget.message


def critical_path(timeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ops that decided the end time, last first (see the module docstring)."""
    if not timeline:
        return []
    by_op = {(r["run"], r["op"]): r for r in timeline}
    prev_on_queue: dict[tuple[int, int], dict[str, Any]] = {}
    last: dict[Any, dict[str, Any]] = {}
    for r in sorted(timeline, key=lambda r: (r["start_s"], r["op"])):
        q = (r["run"], r["queue"])
        if q in last:
            prev_on_queue[(r["run"], r["op"])] = last[q]
        last[q] = r
    path, cur = [], max(timeline, key=lambda r: r["end_s"])
    while cur is not None:
        path.append(cur)
        cands = [by_op[(cur["run"], d)] for d in cur["deps"] if (cur["run"], d) in by_op]
        q = prev_on_queue.get((cur["run"], cur["op"]))
        if q is not None:
            cands.append(q)
        cands = [c for c in cands if c["end_s"] >= cur["start_s"] - 1e-12 * max(1.0, cur["start_s"])]
        cur = max(cands, key=lambda c: c["end_s"]) if cands else None
    return path


def time_plan(
    plan: Plan,
    cfg: ModelConfig,
    profile: Profile,
    *,
    mode: str = "pipelined",
    expert_format: str = "fp8",
    rank_scale: tuple[float, ...] | None = None,
) -> PlanTime:
    """Simulate one plan alone on the profile's machine; a dslp plan's ranks as separate
    timelines meeting at each collective (sim/ranks.split_ranks; rank_scale: a what-if,
    rank r's compute x rank_scale[r])."""
    p = split_ranks(with_reads(plan, cfg, expert_format), rank_scale)
    sim = Simulator(pricer(profile, cfg), mode=mode, **sim_options(profile))
    rid = sim.submit(p)
    # + the host work of the step outside the plan (inputs, sampling): once, after the plan
    total = sim.run_until(rid=rid) + float(profile.get("overheads", "step_s", 0.0))
    tl = sim.timeline(rid)
    deps = {op.id: op.deps for op in p.ops}
    for r in tl:
        r["deps"] = deps[r["op"]]
    binding: dict[str, float] = {}
    for r in critical_path(tl):
        for res, s in r["bound_s"].items():
            binding[res] = binding.get(res, 0.0) + s
    by_kind: dict[str, dict[str, Any]] = {}
    for r in tl:
        k = by_kind.setdefault(r["kind"], {"ops": 0, "op_s": 0.0, "bound_s": {}})
        k["ops"] += 1
        k["op_s"] += r["dur_s"]
        for res, s in r["bound_s"].items():
            k["bound_s"][res] = k["bound_s"].get(res, 0.0) + s
    for k in by_kind.values():
        k["bound"] = max(k["bound_s"], key=k["bound_s"].get) if k["bound_s"] else "none"
    return PlanTime(total, binding, dict(sim.busy_s), by_kind, tl)


def decode_positions(prompt_len: int, decode_tokens: int) -> list[tuple[int, int]]:
    """(position, steps) groups of a decode of `decode_tokens` tokens after the prompt: a
    step's attention reads decode_kv_len(pos + 1) slots (a power of two), so steps in one
    bucket cost the same up to the cache slots they attend, and one simulated step at the
    bucket's last position stands for all of them (an upper bound within the bucket)."""
    groups: dict[int, list[int]] = {}
    for pos in range(prompt_len, prompt_len + max(decode_tokens, 1)):
        groups.setdefault(costs.decode_kv_len(pos + 1), []).append(pos)
    return [(ps[-1], len(ps)) for _, ps in sorted(groups.items())]


def plan_options(batch: int, max_len: int, *, decode: bool = False, decode_mode: str = "fused") -> dict:
    """The options the simulator plans a request's pieces with: its KV pool (batch rows of
    max_len tokens, for the memory budget and the attention's cache slots) and, for a decode
    step, its batch and the DECODE_MODES form. The engine of a validation row plans with the
    same options (experiments/common/simval.py), so the engine runs the plan timed here."""
    if decode_mode not in DECODE_MODES:
        raise ValueError(f"decode mode {decode_mode!r}, expected one of {list(DECODE_MODES)}")
    opts: dict[str, Any] = {"kv_rows": batch, "max_len": max_len}
    if decode:
        opts.update(batch=batch, **DECODE_MODES[decode_mode][0])
    return opts


def request_plans(
    cfg: ModelConfig,
    profile: Profile,
    schedule: str,
    prompt_len: int,
    *,
    decode_tokens: int = 0,
    batch: int = 1,
    max_len: int | None = None,
    prefill_options: dict[str, Any] | None = None,
    decode_mode: str = "fused",
    gemm_dtype: str | None = None,
) -> list[dict[str, Any]]:
    """The plans a request runs, each {part: "prefill" | "decode", plan, no_fit (the budget's
    message or None), steps (decode steps it stands for), mode (executor mode it is timed
    with), fp8_flops_repriced}: the prefill by `schedule`, then one cpu decode plan per
    cache bucket (decode_positions). simulate_request times them; sim/bands.py prices them
    to see which inputs a projection reads."""
    if prompt_len < 1 or batch < 1 or decode_tokens < 0:
        raise ValueError(f"simulate: prompt_len={prompt_len}, batch={batch}, decode_tokens={decode_tokens}")
    length = max_len or min(cfg.max_position_embeddings, prompt_len + max(decode_tokens, 1))
    dec_opts = plan_options(batch, length, decode=True, decode_mode=decode_mode)
    opts = {**plan_options(batch, length), **(prefill_options or {})}
    out = [
        _part("prefill", *build_plan(cfg, profile, schedule, prompt_len, **opts), 1, "pipelined", gemm_dtype)
    ]
    mode = DECODE_MODES[decode_mode][1]
    for pos, n in decode_positions(prompt_len, decode_tokens) if decode_tokens else []:
        built = build_plan(cfg, profile, "cpu", 1, start_pos=pos, **dec_opts)
        out.append(_part("decode", *built, n, mode, gemm_dtype))
    return out


def _part(part: str, plan: Plan, no_fit: str | None, steps: int, mode: str, gemm_dtype: str | None) -> dict:
    moved = 0
    if gemm_dtype is not None:
        plan, moved = price_gemms_as(plan, gemm_dtype)
    return {
        "part": part,
        "plan": plan,
        "no_fit": no_fit,
        "steps": steps,
        "mode": mode,
        "fp8_flops_repriced": moved,
    }


def simulate_request(
    cfg: ModelConfig,
    profile: Profile,
    schedule: str,
    prompt_len: int,
    *,
    decode_tokens: int = 0,
    batch: int = 1,
    expert_format: str = "fp8",
    max_len: int | None = None,
    prefill_options: dict[str, Any] | None = None,
    decode_mode: str = "fused",
    gemm_dtype: str | None = None,
) -> dict[str, Any]:
    """A prompt of `prompt_len` tokens prefilled by `schedule`, then `decode_tokens` decode
    steps of `batch` rows (the engine's cpu decode plan, every row at the same position).
    TTFT is one prompt's prefill (the first token comes out of its final op); the decode
    rate is per request (batch rows share each step). decode_mode / gemm_dtype /
    prefill_options' ring_slots: what-ifs (request_plans, DECODE_MODES, price_gemms_as)."""
    parts = request_plans(
        cfg,
        profile,
        schedule,
        prompt_len,
        decode_tokens=decode_tokens,
        batch=batch,
        max_len=max_len,
        prefill_options=prefill_options,
        decode_mode=decode_mode,
        gemm_dtype=gemm_dtype,
    )
    first = parts[0]
    pre_plan, no_fit = first["plan"], first["no_fit"]
    pre = time_plan(pre_plan, cfg, profile, expert_format=expert_format)
    out: dict[str, Any] = {
        "schedule": pre_plan.schedule,
        "schedule_requested": schedule,
        "prompt_len": prompt_len,
        "decode_tokens": decode_tokens,
        "batch": batch,
        "expert_format": expert_format,
        "profile": profile.name,
        "accelerators": profile.accelerators,
        "fits": no_fit is None,
        "memory_message": no_fit,
        "ttft_s": pre.total_s,
        "prefill_s": pre.total_s,
        "prefill_tok_per_s": prompt_len / pre.total_s,
        "prefill": pre.summary(),
        "binding": {"prefill": pre.bound},
    }
    out["compute_dtype"] = pre_plan.meta.get("compute_dtype")
    if pre_plan.meta.get("ring_slots"):
        out["ring_slots"] = pre_plan.meta["ring_slots"]
    if gemm_dtype is not None:
        out["gemm_dtype_whatif"] = gemm_dtype
        out["fp8_flops_repriced"] = sum(d["fp8_flops_repriced"] for d in parts)
    if decode_tokens:
        steps_s, step_summary = 0.0, None
        for d in parts[1:]:
            if d["no_fit"]:
                out["fits"], out["memory_message"] = False, out["memory_message"] or d["no_fit"]
            t = time_plan(d["plan"], cfg, profile, mode=d["mode"], expert_format=expert_format)
            steps_s += d["steps"] * t.total_s
            step_summary = t.summary()
        step_s = steps_s / decode_tokens
        out.update(
            decode_step_s=step_s,
            decode_tok_per_s=1.0 / step_s,
            decode_agg_tok_per_s=batch / step_s,
            tpot_s=step_s,
            e2e_s=pre.total_s + steps_s,
            decode=step_summary,
        )
        out["binding"]["decode"] = step_summary["bound"] if step_summary else "none"
    return out


def decode_step_plan(
    cfg: ModelConfig,
    profile: Profile,
    context: int,
    *,
    batch: int = 1,
    max_len: int | None = None,
    decode_mode: str = "fused",
    gemm_dtype: str | None = None,
) -> dict[str, Any]:
    """The plan of one decode step of `batch` rows at position `context` (request_plans'
    part dict): what simulate_decode_step times."""
    length = max_len or min(cfg.max_position_embeddings, context + 64)
    opts = plan_options(batch, length, decode=True, decode_mode=decode_mode)
    built = build_plan(cfg, profile, "cpu", 1, start_pos=context, **opts)
    return _part("decode", *built, 1, DECODE_MODES[decode_mode][1], gemm_dtype)


def simulate_decode_step(
    cfg: ModelConfig,
    profile: Profile,
    context: int,
    *,
    batch: int = 1,
    expert_format: str = "fp8",
    max_len: int | None = None,
    decode_mode: str = "fused",
    gemm_dtype: str | None = None,
) -> dict[str, Any]:
    """One decode step of `batch` rows at position `context` (the engine's cpu decode plan):
    step seconds, per-request and aggregate tok/s, what bound it, whether the KV pool fits."""
    d = decode_step_plan(
        cfg, profile, context, batch=batch, max_len=max_len, decode_mode=decode_mode, gemm_dtype=gemm_dtype
    )
    t = time_plan(d["plan"], cfg, profile, mode=d["mode"], expert_format=expert_format)
    return {
        "context": context,
        "batch": batch,
        "expert_format": expert_format,
        "step_s": t.total_s,
        "decode_tok_per_s": 1.0 / t.total_s,
        "decode_agg_tok_per_s": batch / t.total_s,
        "fits": d["no_fit"] is None,
        "memory_message": d["no_fit"],
        **{k: v for k, v in t.summary().items() if k in ("bound", "binding_share")},
    }
