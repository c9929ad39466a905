"""Sensitivity bands: a projection's central value and the [low, high] span its unmeasured
inputs allow, and which input moves it most (the tornado).

Inputs varied (band_inputs):
- every profile value with a stated `range` (plan/profile.py): the "assumed:" values, and the
  values measured on another machine and carried over (their range spans the measurements
  there, e.g. the CPU expert kernel's read efficiency over every dev-VM run);
- every optional key the profile leaves out, whose default the simulator takes silently
  (plan/profile.ABSENT_DEFAULTS), over the span ABSENT_RANGES states: the default at one
  end (they are the optimistic end) and a stated pessimistic value at the other.
An "assumed:" value with no stated range is listed as not varied; a value set by hand
(`--set`) is held where it was set.

Method: one-at-a-time (each input at its low and at its high end, the others central), then
the two corners (every input at the end that lowered the projection in its one-at-a-time
run, and every input at the end that raised it); the band is the smallest and largest of all
those runs, so it holds the central value. An input whose ends price no op of the
projection's plans differently and leave the plans the engine builds unchanged cannot move
it (checked by pricing each distinct op of those plans at both ends) and is reported as
"no effect" without a run. Interactions beyond the two corners are not explored.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from hmoe_jax.config import ModelConfig
from hmoe_jax.plan.format import Plan
from hmoe_jax.plan.profile import COLLECTIVE_KINDS, Profile
from hmoe_jax.plan.system import SystemSpec, copy_threads_for
from hmoe_jax.sim import interference
from hmoe_jax.sim.pricing import Rates, price_op
from hmoe_jax.sim.reads import with_reads

METHOD = (
    "one-at-a-time over each varied input's stated range (the others central), plus the all-low and "
    "all-high corners (each input at the end that lowered / raised the projection); band = min / max "
    "of all runs; inputs that price no op of the projection's plans differently are 'no effect'"
)

# one memcpy thread's rate on the dev VM (local.toml copy_threads: 7.9-8.4 GB/s), the rate
# runtime/staging sizes copy threads with; the low end of that measurement (more threads)
ONE_THREAD_MEMCPY_GBPS = 7.9
# absent keys whose pessimistic end is the higher value (more busy cores, a lock), as for times
PESSIMISTIC_HIGH = frozenset({"cpu.copy_threads", "cpu.expert_op_serialised"})

# Absent optional keys: (the overrides at the pessimistic end, computed from the profile, and
# the source of that end). The default the key takes when absent is the other end.
ABSENT_RANGES: dict[str, tuple[Callable[[Profile], dict[str, Any]], str]] = {
    "accelerator.attn_expanded_tflops": (
        lambda p: {
            "accelerator.attn_expanded_tflops": 0.4
            * p["accelerator.bf16_tflops"]
            * p["accelerator.compute_efficiency"]
        },
        "assumed: range 0.4-1.0 of the bf16 GEMM rate (default 1.0): the engine's blocked MLA prefill attention "
        "has not run on a GPU; on the stand-in it reached 0.90 (expanded) and 1.00 (absorbed) of its GEMM rate "
        "(local.toml), while an unfused blocked softmax under XLA:GPU can fall well below GEMM peak; 0.4 is a "
        "stated pessimistic end, not a measurement",
    ),
    "accelerator.attn_absorbed_tflops": (
        lambda p: {
            "accelerator.attn_absorbed_tflops": 0.4
            * p["accelerator.bf16_tflops"]
            * p["accelerator.compute_efficiency"]
        },
        "assumed: as attn_expanded_tflops, range 0.4-1.0 of the bf16 GEMM rate",
    ),
    "accelerator.weight_convert_gbps": (
        lambda p: {
            "accelerator.weight_convert_gbps": p["accelerator.mem_gbps"] * p["accelerator.mem_efficiency"] / 3
        },
        "derived: from free (fused into the GEMM's reads, the default) to an unfused XLA convert pass that "
        "reads 1 B of FP8 and writes 2 B of bf16 per weight at the accelerator's effective memory rate "
        "(mem_gbps x mem_efficiency / 3 weight bytes/s)",
    ),
    "cpu.copy_gbps": (
        lambda p: {"cpu.copy_gbps": p["link.h2d_gbps"]},
        "assumed: from no cap (the default: copies bound by DRAM only) to the staging ring's copy threads "
        "just keeping pace with the link (copy_gbps = h2d_gbps; the dev VM's 2 threads copy at 13.8 GB/s, "
        "0.39 of its read rate, local.toml)",
    ),
    "cpu.expert_bw_efficiency_batched": (
        lambda p: {
            "cpu.expert_bw_efficiency_batched": p["cpu.expert_bw_efficiency"] * 0.5892 / 0.7709,
            "cpu.expert_batched_rows_per_expert": 2.909,
        },
        "measured: from flat (the default) to the dev VM's batched slowdown, hmoe calibrate 2026-12-05 "
        "(local.toml): 0.5892 at 2.909 rows per touched expert over 0.7709 at one row (x0.764); e02 measured "
        "x0.972 at M=4, inside this span",
    ),
    "cpu.expert_compute_efficiency_small": (
        lambda p: {
            "cpu.expert_compute_efficiency_small": p["cpu.expert_compute_efficiency"] * 0.7178 / 0.807,
            "cpu.expert_compute_small_rows_per_expert": 16.0,
            "cpu.expert_compute_rows_per_expert": 64.0,
        },
        "measured: from flat (the default) to the dev VM's small-M shape, hmoe calibrate 2026-12-05 "
        "(local.toml): 0.7178 at 16 rows per expert over 0.807 at 64 (x0.889), applied to this profile's value",
    ),
    **{
        f"collectives.{kind}_gbps": (
            lambda p, kind=kind: {
                f"collectives.{kind}_latency_s": 4 * p["overheads.collective_s"],
                f"collectives.{kind}_gbps": (
                    p["link.p2p_gbps"] / 2
                    if p["link.interconnect"] == "p2p"
                    else 1 / (1 / p["link.d2h_gbps"] + 1 / p["link.h2d_gbps"])
                ),
            },
            f"assumed: from the host-staged price (the default) to a {kind} whose D2H and H2D halves do "
            "not overlap (rate 1 / (1/d2h + 1/h2d); with P2P half its rate) after 4 x collective_s of latency "
            "(setup and synchronisation of a staged collective; the stand-ins here measured far slower, "
            "hmoe calibrate's [collectives] in local.toml, but they are in-process host copies, not a GPU's): "
            "a stated pessimistic end, not a measurement",
        )
        for kind in COLLECTIVE_KINDS
    },
    # the interference inputs (sim/interference.py; docs/simulator.md "Interference"): each
    # default is the optimistic end (no co-run loss, no lock, free copies and socket link)
    "cpu.copy_threads": (
        lambda p: {
            "cpu.copy_threads": copy_threads_for(
                p["link.h2d_gbps"], ONE_THREAD_MEMCPY_GBPS, p["cpu.numa_nodes"] * p["cpu.cores_per_node"]
            )
        },
        "measured: from no host cores (the default) to the threads Engine(copy_threads=None) sizes against "
        f"the link (plan/system.copy_threads_for, as runtime/staging sizes them: ceil(h2d_gbps / {ONE_THREAD_MEMCPY_GBPS} GB/s, one "
        "memcpy thread on the dev VM, local.toml's copy_threads src), within [1, min(cores, 8)]",
    ),
    "cpu.dram_corun_efficiency": (
        lambda p: {"cpu.dram_corun_efficiency": 0.75},
        "measured: from 1.0 (the default, no co-run loss) to 0.75, just under the co-run probe's spread on "
        "the dev VM (measure/probes.dram_corun: 0.803, 0.905, 0.969 over three runs, local.toml); a "
        "server part with more channels per core may lose less, so 1.0 stays the other end",
    ),
    "cpu.expert_op_serialised": (
        lambda p: {"cpu.expert_op_serialised": "process"},
        "spec: from fair sharing (the default) to the process-wide lock the CPU MoE op holds "
        "(xla_ffi/src/moe_exec.cc run_moe), which every in-process engine of this code base takes",
    ),
    "cpu.xsocket_gbps": (
        lambda p: {"cpu.xsocket_gbps": 0.4 * p["cpu.dram_gbps_per_node"] * p["cpu.dram_efficiency"]},
        "assumed: from free (the default) to 0.4 of one node's effective DRAM read rate for both "
        "directions together, about the paper box's stated low end (192 GB/s over its 491.5 GB/s node "
        "rate = 0.39, paper_epyc9355_rtx5090.toml); a stated pessimistic end, not a measurement",
    ),
    "overheads.step_s": (
        lambda p: {"overheads.step_s": 8.781e-05},
        "measured: from 0 (the default) to the dev VM's 88 us of host work per step outside the plan "
        "(hmoe calibrate 2026-12-05, local.toml), a pessimistic end for a faster host",
    ),
}


@dataclasses.dataclass(frozen=True)
class BandInput:
    key: str
    kind: str  # the value's source kind ("assumed", "measured", ...) or "absent"
    central: Any  # the profile's value (None: absent, the default applies)
    low: dict[str, Any]  # overrides at the low end of the input's range
    high: dict[str, Any]  # overrides at the high end ({}: the central profile)
    range_src: str

    def end_value(self, end: str) -> Any:
        return (self.low if end == "low" else self.high).get(self.key, self.central)


def band_inputs(profile: Profile) -> tuple[list[BandInput], dict[str, str]]:
    """(the inputs a band varies, {assumed key: why it is not varied})."""
    inputs, unvaried = [], {}
    for key, (lo, hi, why) in sorted(profile.ranges.items()):
        kind = profile.src[key.split(".")[0]][key.split(".")[1]].split(":", 1)[0]
        inputs.append(BandInput(key, kind, profile[key], {key: lo}, {key: hi}, why))
    absent = profile.absent()
    for key, (end, why) in ABSENT_RANGES.items():
        if key in absent:
            over = end(profile)
            # the pessimistic end is the low one for rates, the high one for a time, a count of
            # busy threads or a lock
            low, high = ({}, over) if key.endswith("_s") or key in PESSIMISTIC_HIGH else (over, {})
            inputs.append(BandInput(key, "absent", None, low, high, f"{why}; default: {absent[key]}"))
    for key, src in profile.assumptions().items():
        if not src.startswith("assumed: absent;") and key not in profile.ranges:
            unvaried[key] = "no range stated in the profile"
    return inputs, unvaried


def _signature(op) -> tuple:
    return (op.kind, op.resource, op.flops, op.bytes, json.dumps(op.args, sort_keys=True, default=str))


class PlanPrices:
    """The distinct ops of a projection's plans (reads added) priced on a base profile, to
    tell whether another profile could time them differently (moves)."""

    def __init__(self, base: Profile, plans: list[Plan], cfg: ModelConfig, expert_format: str):
        self.base, self.cfg = base, cfg
        self.devices = tuple(range(base.accelerators))
        self.ops: list[tuple[Plan, Any]] = []
        for plan in plans:
            p = with_reads(plan, cfg, expert_format)
            seen = set()
            for op in p.ops:
                sig = _signature(op)
                if sig not in seen:
                    seen.add(sig)
                    self.ops.append((p, op))
        rates = Rates(base)
        self.prices = [price_op(rates, p, op, self.devices, cfg) for p, op in self.ops]

    def moves(self, other: Profile) -> bool:
        """Whether `other` could time the plans differently: a different SystemSpec (the
        schedules would build other plans), another step_s, or any distinct op priced
        differently."""
        if SystemSpec.from_profile(self.base) != SystemSpec.from_profile(other):
            return True
        if self.base.get("overheads", "step_s", 0.0) != other.get("overheads", "step_s", 0.0):
            return True
        # DRAM co-run and the serialised expert op act in the event loop, not in an op's price
        # (sim_options is built from these inputs alone)
        if interference.from_profile(self.base) != interference.from_profile(other):
            return True
        rates = Rates(other)
        return any(
            price_op(rates, p, op, self.devices, self.cfg) != was
            for (p, op), was in zip(self.ops, self.prices, strict=True)
        )


def _snap(v: float, c: float) -> float:
    """v, or c when they differ only by float summation order (an op priced differently
    by a few ulps reorders the event loop's sums): such an input moved nothing."""
    return c if abs(v - c) <= 1e-9 * abs(c) else v


def band(
    evaluate: Callable[[Profile], dict[str, Any]],
    profile: Profile,
    metrics: list[str],
    *,
    plans: Callable[[Profile], list[Plan]] | None = None,
    cfg: ModelConfig | None = None,
    expert_format: str = "fp8",
    progress: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """metric -> the band of evaluate(profile)[metric] over band_inputs(profile) (see
    METHOD); the one-at-a-time runs are shared by the metrics, the corners are each
    metric's own. plans(profile): the plans the projection times, for the no-effect check
    (None: every input is run)."""
    inputs, unvaried = band_inputs(profile)
    central = evaluate(profile)
    priced = PlanPrices(profile, plans(profile), cfg, expert_format) if plans and cfg else None
    count = [1]

    def at(over: dict[str, Any], why: str) -> dict[str, Any] | None:
        """The evaluation with `over` applied, or None when it cannot differ from central."""
        if not over:
            return central
        prof = profile.with_values(over, why=f"band: {why}")
        if priced is not None and not priced.moves(prof):
            return None
        count[0] += 1
        return evaluate(prof)

    ends = []
    for inp in inputs:
        got = {
            end: at(inp.low if end == "low" else inp.high, f"{inp.key} at its {end} end")
            for end in ("low", "high")
        }
        ends.append(got)
        if progress is not None:
            shown = {e: (None if r is None else r[metrics[0]]) for e, r in got.items()}
            progress(f"{inp.key}: {metrics[0]} {shown['low']} .. {shown['high']}")
    out = {}
    for m in metrics:
        c = float(central[m])
        rows = []
        for inp, got in zip(inputs, ends, strict=True):
            lo_v, hi_v = (c if got[e] is None else _snap(float(got[e][m]), c) for e in ("low", "high"))
            rows.append(
                {
                    "key": inp.key,
                    "kind": inp.kind,
                    "central_value": inp.central,
                    "low_value": inp.end_value("low"),
                    "high_value": inp.end_value("high"),
                    "range_src": inp.range_src,
                    "at_low": lo_v,
                    "at_high": hi_v,
                    "swing": abs(hi_v - lo_v),
                    "effect": got["low"] is not None or got["high"] is not None,
                }
            )
        runs = [c] + [r[k] for r in rows for k in ("at_low", "at_high")]
        corners = {}
        for name, pick in (("all_low", min), ("all_high", max)):
            over: dict[str, Any] = {}
            for inp, r in zip(inputs, rows, strict=True):
                if r["at_low"] != r["at_high"]:
                    over.update(inp.low if pick(r["at_low"], r["at_high"]) == r["at_low"] else inp.high)
            res = at(over, f"{m} {name} corner")
            corners[name] = {"value": c if res is None else float(res[m]), "overrides": over}
            runs.append(corners[name]["value"])
        rows.sort(key=lambda r: -r["swing"])
        out[m] = {
            "metric": m,
            "central": c,
            "low": min(runs),
            "high": max(runs),
            "fits": bool(central.get("fits", True)),
            "memory_message": central.get("memory_message"),
            "method": METHOD,
            "inputs": rows,
            "corners": corners,
            "unvaried": unvaried,
        }
    for m in metrics:
        out[m]["simulations"] = count[0]
    return out
