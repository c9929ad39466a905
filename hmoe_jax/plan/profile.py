"""Hardware profiles: configs/systems/<name>.toml, the one machine description, every value
with its provenance. The simulator prices plans with the rates (hmoe_jax/sim/); the engine,
`hmoe plan` and `hmoe generate/serve --system` plan with the [schedule] thresholds and the
accelerator's and link's numbers through plan/system.SystemSpec.from_profile. Strict like
model configs: an unknown section or key is a ConfigError naming it and listing the known
ones, a value without a source is an error, every value is type- and range-checked, and an
unknown profile name lists the known ones. This is the one validator of machine numbers:
SystemSpec built in code is checked by check_value too.

    format = "hmoe-sim-profile/1"
    name = "paper_epyc9355_rtx5090"
    comment = "..."
    [cpu]
    dram_gbps_per_node = { value = 614.4, src = "spec: 12 ch x DDR5-6400 x 8 B per socket" }
    ...

`src` starts with what kind of number it is: "spec:" (a datasheet), "measured:" (measured,
saying where and how), "published:" (a published measurement or kernel-efficiency figure,
naming it), "derived:" (arithmetic from other sourced numbers, shown), "paper:" (PAPER.md),
or "assumed:" (no source: a neutral choice, listed by Profile.assumptions() so a projection
can say which inputs were not measured). No number may be chosen to make a headline come out.

A value may carry a stated range, the span a band varies it over (sim/bands.py):

    dram_efficiency = { value = 0.8, src = "assumed: ...", range = [0.65, 0.9], range_src = "assumed: range ..." }

`range` needs `range_src` (what the span rests on, with a source kind like `src`), holds the
value, and passes the key's own rule at both ends; Profile.ranges holds them. An optional
key a profile leaves out takes the simulator's default (ABSENT_DEFAULTS says which), and
Profile.assumptions() lists it, with that default, beside the "assumed:" values.

Effective rates are peak x efficiency (both sourced): the simulator prices an op at
bytes / effective bandwidth and flops / effective rate of the resource that runs it.
Plain data (tomllib, no jax): it sits in plan/, below the schedules, the engine and the
simulator, which all read it.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from pathlib import Path
from typing import Any

from hmoe_jax.config import ConfigError, configs_dir

PROFILE_FORMAT = "hmoe-sim-profile/1"
SOURCE_KINDS = ("spec", "measured", "published", "derived", "paper", "assumed")
# the collectives dslp / ep run, each priced from its own measured model ([collectives])
COLLECTIVE_KINDS = ("all_gather", "reduce_scatter", "all_to_all")

# section -> key -> (type, required, rule); rule: "pos" (> 0), "frac" (0 < x <= 1), "share" (0 <= x <= 1),
# "nonneg" (>= 0), "count" (int >= 1), a tuple of allowed strings, or "str".
_R = tuple[type, bool, Any]
SCHEMA: dict[str, dict[str, _R]] = {
    "cpu": {
        "numa_nodes": (int, True, "count"),
        "cores_per_node": (int, True, "count"),
        "dram_gbps_per_node": (float, True, "pos"),  # peak read bandwidth of one node
        "dram_efficiency": (float, True, "frac"),  # sustained streaming read / peak
        "bf16_tflops_per_node": (float, True, "pos"),  # peak of the instructions our kernels use
        # the side-by-side compute probe's reading (all cores) when the profile was measured
        # (measure/probes.ReadProbe.tflops): a validation run re-bases the host-core rates on
        # its own probe over this one (with_host_state); absent: on the read probe alone
        "compute_probe_tflops": (float, False, "pos"),
        # the stream probe's reading (our FP8 GEMV through ~1 GiB, measure/probes.ReadProbe.
        # stream_gbps) when the profile was measured: a validation run re-bases the host read
        # rate on its own stream probe over this one (with_host_state); absent: on the read probe
        "stream_probe_gbps": (float, False, "pos"),
        # the share of a streaming kernel's time per byte that does not scale with DRAM (our
        # FP8 GEMV's DRAM rate over its L3-resident rate): with_host_state re-bases the read
        # rate as 1 / ((1 - u) / probe + u / calibrated read); absent: in proportion (u = 0)
        "read_fixed_share": (float, False, "frac"),
        "expert_bw_efficiency": (float, True, "frac"),  # expert kernel bytes/s / sustained read
        "expert_compute_efficiency": (float, True, "frac"),  # expert kernel flops/s / peak (large M)
        # prefill M is not one point: the kernel unpacks each expert's weights once per call,
        # so its flops/s grows with rows per expert. expert_compute_efficiency was measured at
        # expert_compute_rows_per_expert rows per expert, the _small one at
        # expert_compute_small_rows_per_expert; between them the time per flop is linear in
        # 1 / rows (a fixed cost per expert shared by its rows), held beyond; absent: flat
        "expert_compute_rows_per_expert": (float, False, "pos"),
        "expert_compute_efficiency_small": (float, False, "frac"),
        "expert_compute_small_rows_per_expert": (float, False, "pos"),
        # the same with several rows per touched expert (batched decode), measured at
        # expert_batched_rows_per_expert rows per expert; between 1 row and that, the kernel's
        # time per expert is interpolated linearly (each extra row adds the same compute);
        # absent: expert_bw_efficiency at every row count
        "expert_bw_efficiency_batched": (float, False, "frac"),
        "expert_batched_rows_per_expert": (float, False, "pos"),
        # the INT4 expert kernel's bytes/s / sustained read (absent: INT4 is not projected)
        "int4_expert_bw_efficiency": (float, False, "frac"),
        "copy_gbps": (float, False, "pos"),  # the staging ring's copy threads (absent: no own cap)
        # interference beyond fair sharing (sim/interference.py): the staging ring's memcpy
        # threads, each a busy core while it copies (absent: copies take no cores)
        "copy_threads": (int, False, "count"),
        # total read rate of two concurrent DRAM streams / one stream alone, the capacity of a
        # dram<n> resource while more than one phase uses it (absent: 1, no co-run loss)
        "dram_corun_efficiency": (float, False, "frac"),
        # "process": the CPU MoE op holds a process-wide mutex (xla_ffi/src/moe_exec.cc
        # run_moe), so experts_cpu ops of different engines queue; "none": they share cores
        "expert_op_serialised": (str, False, ("process", "none")),
        # the inter-socket links' bandwidth, both directions together, that the far-node share
        # of host bytes a copy or DMA touches crosses (absent: free; not used with 1 node)
        "xsocket_gbps": (float, False, "pos"),
    },
    "accelerator": {
        "count": (int, True, "count"),
        "kind": (str, True, "str"),
        # "device": its own compute and memory; "host": a stand-in XLA CPU device whose GEMMs
        # run on the host's cores and read host DRAM (this machine without a GPU), so its
        # ops share cpu<n> / dram<n> with the CPU experts and the staging copies
        "placement": (str, True, ("device", "host")),
        "fp32_tflops": (float, True, "pos"),
        "bf16_tflops": (float, True, "pos"),
        "fp8_tflops": (float, True, "pos"),
        "compute_efficiency": (float, True, "frac"),  # a piece's GEMMs / dense peak
        # the engine's prefill attention piece as a whole (projections, absorbed per-head
        # matmuls or per-block kv_b expansion, scores, softmax), flops by plan.costs.attn_flops
        # per second, per form (absorbed: chunks below 256 new tokens; expanded: from 256):
        # effective rates, not scaled by compute_efficiency; absent: the GEMM rate
        "attn_absorbed_tflops": (float, False, "pos"),
        "attn_expanded_tflops": (float, False, "pos"),
        # a form's rate is not one number: per flop the piece slows as the chunk grows (its
        # f32 softmax over a [tokens, heads, key block] score block leaves the caches, work
        # plan.costs does not count). attn_<form>_tflops was measured at attn_<form>_tokens
        # new tokens, the _small rate at attn_<form>_small_tokens; between them the time per
        # flop is linear in tokens, held beyond; absent: one rate at every chunk size
        "attn_absorbed_tokens": (float, False, "pos"),
        "attn_absorbed_tflops_small": (float, False, "pos"),
        "attn_absorbed_small_tokens": (float, False, "pos"),
        "attn_expanded_tokens": (float, False, "pos"),
        "attn_expanded_tflops_small": (float, False, "pos"),
        "attn_expanded_small_tokens": (float, False, "pos"),
        "mem_gbps": (float, True, "pos"),
        "mem_efficiency": (float, True, "frac"),
        "mem_bytes": (int, True, "count"),
        # weight bytes/s at which a piece that dequantises FP8 weights inside XLA converts
        # them (experts_acc's dense_weight: on XLA:CPU a slow elementwise pass, on a GPU fused
        # into the GEMM's reads); absent: no cost beyond the reads
        "weight_convert_gbps": (float, False, "pos"),
        # a stand-in's (placement "host") pieces run their GEMMs on the cores that stream
        # their weights: decode_attn_mem_efficiency is a decode attention piece's own read
        # rate over the DRAM rate (its small XLA ops ride along; mem_efficiency is the bare
        # FP8 GEMV's), gemm_read_slack the share of a piece's read time in which its cores do
        # its flops for free (busy = max(read, flops + (1 - slack) x read)); both measured
        # on the engine's decode attention (measure/standin.decode_attention)
        "decode_attn_mem_efficiency": (float, False, "frac"),
        "gemm_read_slack": (float, False, "share"),  # 0 is a measured end: they add up
    },
    "link": {
        "h2d_gbps": (float, True, "pos"),  # each accelerator's own host link, effective
        "d2h_gbps": (float, True, "pos"),
        "interconnect": (str, True, ("host", "p2p")),  # host: collectives staged through host memory
        "p2p_gbps": (float, False, "pos"),  # per accelerator, with interconnect = "p2p"
    },
    "overheads": {  # seconds per op, on top of its bytes / flops time
        "acc_op_s": (float, True, "nonneg"),  # dispatch + completion of one accelerator piece
        "cpu_op_s": (float, True, "nonneg"),  # one call of the CPU expert op
        "hop_s": (float, True, "nonneg"),  # one activation copy (d2h / h2d)
        "stage_s": (float, True, "nonneg"),  # queue one staging memcpy
        "load_s": (float, True, "nonneg"),  # hand one ring slot to the accelerator
        "unload_s": (float, True, "nonneg"),  # release one slot
        "collective_s": (float, True, "nonneg"),  # one collective between accelerators
        # host work of one engine step outside its plan (step inputs, sampling the token);
        # absent: 0
        "step_s": (float, False, "nonneg"),
    },
    # a collective between accelerators (sim/pricing.py), per kind: latency_s + per-rank
    # bytes / rate, as measured by `hmoe calibrate` / tools/gpu_check.py
    # (measure/collectives.py); a kind's two keys go together; absent: the host-staged
    # price (D2H + H2D + 2 x host DRAM bytes + overheads.collective_s, or P2P)
    "collectives": {
        f"{kind}_{what}": (float, False, rule)
        for kind in COLLECTIVE_KINDS
        for what, rule in (("latency_s", "nonneg"), ("gbps", "pos"))
    },
    # the plan knobs of plan.system.SystemSpec (what the engine's schedules read: the auto
    # policy's thresholds, the cpu schedule's chunk, the slp ring's experts per slot)
    "schedule": {
        "auto_slp_min_tokens": (int, True, "count"),
        "auto_dslp_min_tokens": (int, True, "count"),
        "cpu_prefill_chunk_tokens": (int, True, "count"),
        "slp_experts_per_slot": (int, True, "count"),
    },
}
_TOP = {"format", "name", "comment"}

# What the simulator (sim/pricing.py, sim/run.py) takes for an optional key a profile leaves
# out. Each is a choice, mostly the optimistic end, so Profile.assumptions() lists the
# absent ones with these words and sim/bands.py varies them (its ABSENT_RANGES). A key whose
# absence is not a default (int4: INT4 is then not projected; p2p_gbps: used only with
# interconnect = "p2p", which requires it) is not listed here.
ABSENT_DEFAULTS: dict[str, str] = {
    "cpu.expert_compute_rows_per_expert": "one expert compute efficiency at every rows per expert",
    "cpu.expert_compute_efficiency_small": "expert_compute_efficiency at every rows per expert (no small-M slowdown)",
    "cpu.expert_compute_small_rows_per_expert": "one expert compute efficiency at every rows per expert",
    "cpu.expert_bw_efficiency_batched": "expert_bw_efficiency at every batch size (no batched-decode slowdown)",
    "cpu.expert_batched_rows_per_expert": "expert_bw_efficiency at every batch size",
    "cpu.copy_gbps": "no copy-rate cap of its own: a staging copy is bound only by host DRAM (2 x bytes)",
    "accelerator.attn_absorbed_tflops": "absorbed-form prefill attention at the GEMM rate (compute dtype x compute_efficiency)",
    "accelerator.attn_expanded_tflops": "expanded-form prefill attention at the GEMM rate (compute dtype x compute_efficiency)",
    **{
        f"accelerator.attn_{form}_{key}": f"attn_{form}_tflops at every chunk size (no slowdown per flop as chunks grow)"
        for form in ("absorbed", "expanded")
        for key in ("tokens", "tflops_small", "small_tokens")
    },
    "accelerator.weight_convert_gbps": "free FP8 dequantisation in experts_acc (no cost beyond the weight reads)",
    "accelerator.decode_attn_mem_efficiency": "mem_efficiency (the FP8 GEMV's) for a stand-in's decode attention pieces",
    "accelerator.gemm_read_slack": "0: a stand-in piece's flops and weight reads add up (none hidden in its read pass)",
    "overheads.step_s": "0 s of host work per engine step outside its plan",
    "cpu.copy_threads": "staging copies take no host cores (a memcpy thread is not counted as a busy core)",
    "cpu.dram_corun_efficiency": "1.0: concurrent DRAM streams share the full read rate (no co-run loss)",
    "cpu.expert_op_serialised": "none: experts_cpu ops of different engines share the cores fairly (no process-wide lock)",
    "cpu.xsocket_gbps": "free inter-socket traffic (the far-node share of copy / DMA bytes costs nothing extra)",
    **{
        f"collectives.{kind}_{what}": f"the host-staged price of a {kind}: per-rank bytes over D2H and H2D "
        "+ 2 x host DRAM bytes + overheads.collective_s (or over p2p_gbps), no measured latency or rate"
        for kind in COLLECTIVE_KINDS
        for what in ("latency_s", "gbps")
    },
}


def _without_attn_rate(form: str) -> Any:
    return lambda values: f"attn_{form}_tflops" not in values["accelerator"]


# an absent key that is no default on some profiles: it is then not listed as assumed
_UNUSED_WHEN: dict[str, Any] = {
    # one NUMA node has no far node: no byte crosses a socket, absent or not
    "cpu.xsocket_gbps": lambda values: int(values["cpu"]["numa_nodes"]) < 2,
    # a device accelerator's pieces do not share cores with their reads: stand-in inputs only
    "accelerator.decode_attn_mem_efficiency": lambda values: values["accelerator"]["placement"] != "host",
    "accelerator.gemm_read_slack": lambda values: values["accelerator"]["placement"] != "host",
    # a form's chunk-size points matter only where the form has a measured rate
    **{
        f"accelerator.attn_{form}_{key}": _without_attn_rate(form)
        for form in ("absorbed", "expanded")
        for key in ("tokens", "tflops_small", "small_tokens")
    },
}
WHATIF_SRC = "what-if: --set"  # the source of a value a caller overrides (Profile.with_values)


@dataclasses.dataclass(frozen=True)
class Profile:
    """A checked profile: values[section][key] and src[section][key]."""

    name: str
    values: dict[str, dict[str, Any]]
    src: dict[str, dict[str, str]]
    comment: str = ""
    path: str = ""
    # dotted key -> (low, high, range_src): the stated span a band varies the value over
    ranges: dict[str, tuple[float, float, str]] = dataclasses.field(default_factory=dict)
    # the engine's link emulation (with_link): a pacing cap on the staging copies in GB/s.
    # Not a profile key: it is a property of the run being timed, not of the machine
    link_cap_gbps: float | None = None

    def get(self, section: str, key: str, default: Any = None) -> Any:
        return self.values.get(section, {}).get(key, default)

    def __getitem__(self, dotted: str) -> Any:
        section, key = dotted.split(".")
        if key not in self.values.get(section, {}):
            raise KeyError(f"profile {self.name!r}: no {dotted}")
        return self.values[section][key]

    @property
    def accelerators(self) -> int:
        return int(self.values["accelerator"]["count"])

    @property
    def numa_nodes(self) -> int:
        return int(self.values["cpu"]["numa_nodes"])

    def assumptions(self) -> dict[str, str]:
        """Every value whose source is 'assumed:' (dotted key -> source), and every optional
        key the profile leaves out, with the default the simulator takes for it
        (ABSENT_DEFAULTS): "assumed: absent; default: ..."."""
        out = {f"{s}.{k}": v for s, kv in self.src.items() for k, v in kv.items() if v.startswith("assumed:")}
        for dotted, default in self.absent().items():
            out[dotted] = f"assumed: absent; default: {default}"
        return out

    def absent(self) -> dict[str, str]:
        """The optional keys this profile leaves out -> the default each took (ABSENT_DEFAULTS)."""
        return {
            d: why
            for d, why in ABSENT_DEFAULTS.items()
            if d.split(".")[1] not in self.values[d.split(".")[0]]
            and not (d in _UNUSED_WHEN and _UNUSED_WHEN[d](self.values))
        }

    def with_values(self, overrides: dict[str, Any], why: str = WHATIF_SRC) -> Profile:
        """The same box with `overrides` (dotted key -> value; None removes an optional key,
        so the simulator's default applies) checked by the key's own rule and sourced `why`.
        An unknown section or key is a ConfigError listing the valid ones; a string value
        is parsed as the key's type (what `hmoe simulate --set` passes)."""
        values = {s: dict(kv) for s, kv in self.values.items()}
        src = {s: dict(kv) for s, kv in self.src.items()}
        ranges = dict(self.ranges)
        for dotted, v in overrides.items():
            section, key = split_key(dotted)
            ranges.pop(f"{section}.{key}", None)  # a value set by hand is not varied around
            want, required, rule = SCHEMA[section][key]
            at = f"profile {self.name!r}: {dotted}"
            if v is None:
                if required:
                    raise ConfigError(f"{at}: required, it cannot be removed")
                values[section].pop(key, None)
                src[section].pop(key, None)
                continue
            if isinstance(v, str) and want is not str:
                try:
                    v = want(float(v)) if want is float else int(v)
                except ValueError:
                    raise ConfigError(
                        f"{at}: {v!r} is not a{'n int' if want is int else ' number'}"
                    ) from None
            values[section][key] = check_value(at, want, rule, v)
            src[section][key] = why
        link = values["link"]
        if link["interconnect"] == "p2p" and "p2p_gbps" not in link:
            raise ConfigError(f"profile {self.name!r}: link.interconnect = 'p2p' needs link.p2p_gbps")
        check_collectives(f"profile {self.name!r}", values["collectives"])
        return dataclasses.replace(self, values=values, src=src, ranges=ranges)

    def provenance(self) -> dict[str, dict[str, Any]]:
        """dotted key -> {value, src[, range, range_src]}: what a record carries so a
        projection names its inputs; an absent optional key is {value: None, src: "assumed:
        absent; default: ..."} (the default the simulator took)."""
        out: dict[str, dict[str, Any]] = {}
        for s in self.values:
            for k in self.values[s]:
                out[f"{s}.{k}"] = {"value": self.values[s][k], "src": self.src[s][k]}
                if f"{s}.{k}" in self.ranges:
                    lo, hi, why = self.ranges[f"{s}.{k}"]
                    out[f"{s}.{k}"].update(range=[lo, hi], range_src=why)
        for dotted, default in self.absent().items():
            out[dotted] = {"value": None, "src": f"assumed: absent; default: {default}"}
        return out

    def with_accelerators(self, n: int) -> Profile:
        """The same box using only its first n accelerators. A box whose accelerators are
        stand-ins on the host's cores (placement "host") can have any number: each is one more
        XLA CPU device on the same cores and DRAM (what `--devices N` does here)."""
        stand_in = self.values["accelerator"]["placement"] == "host"
        if not (1 <= n <= self.accelerators or (stand_in and n >= 1)):
            raise ConfigError(
                f"profile {self.name!r}: {n} accelerators requested, it has {self.accelerators}"
            )
        values = {s: dict(kv) for s, kv in self.values.items()}
        values["accelerator"]["count"] = n
        return dataclasses.replace(self, values=values)

    def with_link(self, gbps: float) -> Profile:
        """The engine's link emulation (Engine(link_gbps=...), `--link-gbps`): activation hops
        and the staging ring's copies capped at gbps (runtime/executor._throttle, the ring's
        rate cap), so the link, both directions, and the copies run at most at gbps. The cap
        paces the copies (their threads sleep between bursts), so cpu.copy_gbps keeps the
        measured memcpy rate: a copy lasts bytes / min(copy, cap) but its threads are busy
        cores only for bytes / copy (sim/pricing.py _copy). Lowering copy_gbps to the cap
        made them hold the cores for the whole paced copy: at a 0.1 GB/s cap the stand-in's
        weight conversions then waited for the link, 41 s simulated against 28.5 s measured."""
        if not gbps > 0:
            raise ConfigError(f"profile {self.name!r}: link cap must be > 0 GB/s, got {gbps}")
        values = {s: dict(kv) for s, kv in self.values.items()}
        src = {s: dict(kv) for s, kv in self.src.items()}
        why = f"derived: emulated link cap {gbps} GB/s (Engine link_gbps)"
        for key in ("h2d_gbps", "d2h_gbps"):
            values["link"][key], src["link"][key] = float(gbps), why
        return dataclasses.replace(self, values=values, src=src, link_cap_gbps=float(gbps))

    def with_read_gbps(self, gbps: float, why: str) -> Profile:
        """The same box with its host DRAM read rate measured anew (a side-by-side probe in
        the run being predicted: this VM's rate moves 2x within minutes); the kernels'
        efficiencies, which are ratios to that rate, are kept. A stand-in's memory is host
        DRAM, so its mem_gbps follows."""
        values = {s: dict(kv) for s, kv in self.values.items()}
        src = {s: dict(kv) for s, kv in self.src.items()}
        per_node = float(gbps) / self.numa_nodes / float(values["cpu"]["dram_efficiency"])
        values["cpu"]["dram_gbps_per_node"], src["cpu"]["dram_gbps_per_node"] = per_node, why
        if values["accelerator"]["placement"] == "host":
            values["accelerator"]["mem_gbps"], src["accelerator"]["mem_gbps"] = float(gbps), why
        return dataclasses.replace(self, values=values, src=src)

    def with_host_state(
        self, read_gbps: float, peak_tflops: float | None, why: str, stream_gbps: float | None = None
    ) -> Profile:
        """with_read_gbps, and with every rate that runs on the host's cores (the CPU's bf16
        peak; a stand-in accelerator's GEMM and convert rates) scaled by peak_tflops, a
        side-by-side compute probe in the run being predicted, over the same probe's reading
        at calibration (cpu.compute_probe_tflops): for a machine whose neighbours take cores.
        A profile without that reading is re-based on the read probe alone: the ratio over
        its bf16 peak mixes two estimators (calibrate sets the peak to the kernel's own rate
        when the probe reads below it) and over-corrected the first full e04 run (-33% mean
        error). Efficiencies stay as calibrated.

        stream_gbps: the run's stream probe (our FP8 GEMV streaming weights). With it and the
        profile's reading of the same probe at calibration (cpu.stream_probe_gbps), the read
        rate becomes the calibrated one x stream_gbps / that reading, and read_gbps (the bare
        load loop's) is not used: the engine's weight streaming follows the GEMV, and the bare
        loop read 70-78 GB/s in phases where neither moved (docs/simulator.md, "Probes").
        cpu.read_fixed_share u: the re-based read rate is then 1 / ((1 - u) / rate + u /
        calibrated read), the part of a streaming kernel's per-byte time that DRAM does not set
        held fixed."""
        cpu = self.values["cpu"]
        calibrated = float(cpu["dram_gbps_per_node"]) * self.numa_nodes * float(cpu["dram_efficiency"])
        ref = cpu.get("stream_probe_gbps")
        if stream_gbps is not None and ref is not None:
            read_gbps = calibrated * float(stream_gbps) / float(ref)
        u = cpu.get("read_fixed_share")
        if u is not None:
            # A streaming kernel's time per byte = a DRAM part (scales with the probe) + a
            # fixed part u (its decode and multiply work, measured as its L3-resident rate):
            # its rate moves as this harmonic blend of the probe and the calibrated read, not
            # in proportion (in a fast phase both probes rose 1.55x, the engine's step 1.36x)
            read_gbps = 1.0 / ((1.0 - float(u)) / float(read_gbps) + float(u) / calibrated)
        prof = self.with_read_gbps(read_gbps, why)
        ref = self.values["cpu"].get("compute_probe_tflops")
        if peak_tflops is None or ref is None:
            return prof
        values = {s: dict(kv) for s, kv in prof.values.items()}
        src = {s: dict(kv) for s, kv in prof.src.items()}
        scale = float(peak_tflops) / float(ref)
        keys = [("cpu", "bf16_tflops_per_node")]
        if values["accelerator"]["placement"] == "host":
            keys += [
                ("accelerator", k)
                for k in (
                    "fp32_tflops",
                    "bf16_tflops",
                    "fp8_tflops",
                    "weight_convert_gbps",
                    "attn_absorbed_tflops",
                    "attn_expanded_tflops",
                    "attn_absorbed_tflops_small",
                    "attn_expanded_tflops_small",
                )
            ]
        for s, k in keys:
            if k in values[s]:
                values[s][k] = float(values[s][k]) * scale
                src[s][k] = f"{why}; x{scale:.3f} (compute probe over the calibrated peak)"
        return dataclasses.replace(prof, values=values, src=src)


def split_key(dotted: Any) -> tuple[str, str]:
    """(section, key) of a dotted profile key, or a ConfigError listing the valid ones."""
    section, _, key = str(dotted).partition(".")
    if section not in SCHEMA:
        raise ConfigError(f"unknown profile section {section!r} in {dotted!r}; sections: {sorted(SCHEMA)}")
    if key not in SCHEMA[section]:
        raise ConfigError(
            f"unknown profile key {dotted!r}; [{section}] keys: {', '.join(sorted(SCHEMA[section]))}"
        )
    return section, key


def valid_keys() -> list[str]:
    """Every dotted key a profile may set."""
    return [f"{s}.{k}" for s, keys in SCHEMA.items() for k in keys]


def check_value(where: str, want: type, rule: Any, v: Any) -> Any:
    """v as type `want` if it passes `rule` (SCHEMA's rules), else a ConfigError naming `where`."""
    if want is str:
        ok = isinstance(v, str) and v != "" and (not isinstance(rule, tuple) or v in rule)
        need = f"one of {list(rule)}" if isinstance(rule, tuple) else "a non-empty string"
    elif want is int:
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
        need = "an int >= 1"
    else:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        lo_ok = {
            "pos": lambda x: x > 0,
            "frac": lambda x: 0 < x <= 1,
            "share": lambda x: 0 <= x <= 1,
            "nonneg": lambda x: x >= 0,
        }[rule]
        ok = ok and lo_ok(v)
        need = {
            "pos": "a number > 0",
            "frac": "a fraction in (0, 1]",
            "share": "a share in [0, 1]",
            "nonneg": "a number >= 0",
        }[rule]
    if not ok:
        raise ConfigError(f"{where}: must be {need}, got {v!r}")
    return want(v)


def check_collectives(where: str, coll: dict[str, Any]) -> None:
    """A collective kind's latency and rate are one measured model: both or neither."""
    for kind in COLLECTIVE_KINDS:
        have = [k for k in (f"{kind}_latency_s", f"{kind}_gbps") if k in coll]
        if len(have) == 1:
            raise ConfigError(
                f"{where}: collectives.{have[0]} without its pair; set both {kind}_latency_s and "
                f"{kind}_gbps (one fit, measure/collectives.py) or neither"
            )


def _check_src(where: str, src: Any) -> str:
    if not isinstance(src, str) or ":" not in src:
        raise ConfigError(f"{where}: src must be '<kind>: <where the number comes from>', got {src!r}")
    kind, text = src.split(":", 1)
    if kind.strip() not in SOURCE_KINDS or not text.strip():
        raise ConfigError(
            f"{where}: src kind {kind.strip()!r} must be one of {list(SOURCE_KINDS)} with a text"
        )
    return src


def profile_from_dict(d: dict[str, Any], where: str = "profile") -> Profile:
    if d.get("format") != PROFILE_FORMAT:
        raise ConfigError(f"{where}: format {d.get('format')!r}, expected {PROFILE_FORMAT!r}")
    unknown = sorted(set(d) - _TOP - set(SCHEMA))
    if unknown:
        raise ConfigError(
            f"{where}: unknown section(s) {unknown}; known: {sorted(SCHEMA)} and {sorted(_TOP)}"
        )
    name = d.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"{where}: key 'name' must be a non-empty string")
    values: dict[str, dict[str, Any]] = {}
    srcs: dict[str, dict[str, str]] = {}
    ranges: dict[str, tuple[float, float, str]] = {}
    for section, keys in SCHEMA.items():
        got = d.get(section, {})
        if not isinstance(got, dict):
            raise ConfigError(f"{where}: [{section}] must be a table")
        bad = sorted(set(got) - set(keys))
        if bad:
            raise ConfigError(f"{where}: unknown key(s) {bad} in [{section}]; known: {sorted(keys)}")
        values[section], srcs[section] = {}, {}
        for key, (want, required, rule) in keys.items():
            at = f"{where}: {section}.{key}"
            if key not in got:
                if required:
                    raise ConfigError(f"{at}: missing (every profile sets it, with its source)")
                continue
            leaf = got[key]
            if not isinstance(leaf, dict) or not (
                set(leaf) == {"value", "src"} or set(leaf) == {"value", "src", "range", "range_src"}
            ):
                raise ConfigError(
                    f'{at}: must be {{ value = ..., src = "<kind>: ..." }} (optionally with range = [lo, hi], '
                    f'range_src = "<kind>: ..."), got {leaf!r}'
                )
            values[section][key] = check_value(at, want, rule, leaf["value"])
            srcs[section][key] = _check_src(at, leaf["src"])
            if "range" in leaf:
                ranges[f"{section}.{key}"] = _check_range(at, want, rule, leaf, values[section][key])
    link = values["link"]
    if link["interconnect"] == "p2p" and "p2p_gbps" not in link:
        raise ConfigError(f"{where}: link.interconnect = 'p2p' needs link.p2p_gbps")
    check_collectives(where, values["collectives"])
    return Profile(
        name=name, values=values, src=srcs, comment=str(d.get("comment", "")), path=where, ranges=ranges
    )


def _check_range(where: str, want: type, rule: Any, leaf: dict, value: Any) -> tuple[float, float, str]:
    """A leaf's stated range: two numbers of the key's rule around its value, with a source."""
    r = leaf["range"]
    if want is not float or not isinstance(r, list) or len(r) != 2:
        raise ConfigError(f"{where}: range must be [low, high] on a number key, got {r!r}")
    lo, hi = (check_value(f"{where} range", want, rule, x) for x in r)
    if not lo <= value <= hi:
        raise ConfigError(f"{where}: range [{lo}, {hi}] must hold the value {value}")
    return lo, hi, _check_src(f"{where} range_src", leaf["range_src"])


def profiles_dir() -> Path:
    return configs_dir() / "systems"


def profile_names() -> list[str]:
    return sorted(p.stem for p in profiles_dir().glob("*.toml"))


def load_profile(name_or_path: str) -> Profile:
    """A profile by name from configs/systems/<name>.toml, or a path to a TOML file."""
    p = Path(name_or_path)
    if p.suffix != ".toml":
        p = profiles_dir() / f"{name_or_path}.toml"
    if not p.exists():
        hint = " (run `hmoe calibrate` to measure this machine and write it)" if p.stem == "local" else ""
        raise ConfigError(f"system profile {name_or_path!r} not found at {p}{hint}; known: {profile_names()}")
    try:
        raw = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML ({e})") from None
    return profile_from_dict(raw, where=str(p))
