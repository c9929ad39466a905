"""What a schedule needs to know about the machine: the host link and accelerator rates,
the accelerator's memory, and the auto-policy and ring thresholds. It is a view of a
hardware profile (plan/profile.py, configs/systems/<name>.toml), the one machine
description: `load_system(NAME, devices)` is the profile NAME using `devices` of its
accelerators, so `hmoe plan`, `hmoe simulate`, `hmoe generate/serve` and the engine read
the same numbers from the same file.

Accelerator compute is priced per dtype (acc_fp32/bf16/fp8_tflops: dense tensor peaks of
one accelerator) so a cost model charges the dtype that actually runs. The defaults are
the paper's box with one RTX 5090 (configs/systems/paper_epyc9355_rtx5090.toml with one
accelerator; tests/test_plan_system.py holds them equal)."""

from __future__ import annotations

import dataclasses
import math

from hmoe_jax.plan.profile import Profile, check_value, load_profile

# field type -> rule of plan.profile.check_value (the profile's own rules), so a value
# built in code is checked exactly like one read from a file
_RULES = {str: "str", int: "count", float: "pos"}
_TYPES = {"str": str, "int": int, "float": float}  # annotation text -> type
_FIELD_RULES = {"acc_compute_efficiency": "frac"}  # fields whose rule is not their type's
# the profile's [schedule] keys, the same names as the fields below
_SCHEDULE_KEYS = (
    "auto_slp_min_tokens",
    "auto_dslp_min_tokens",
    "cpu_prefill_chunk_tokens",
    "slp_experts_per_slot",
)


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    name: str = "paper_epyc9355_rtx5090"
    num_accelerators: int = 1
    h2d_gbps: float = 56.0  # host -> accelerator copy rate (PCIe 5.0 x16 measured, PAPER.md)
    # one accelerator's dense throughput per dtype (RTX 5090 public specs; FP8 with f32
    # accumulate) and its memory
    acc_fp32_tflops: float = 105.0
    acc_bf16_tflops: float = 209.0
    acc_fp8_tflops: float = 419.0
    # the fraction of those peaks a piece's GEMMs reach (the profile's
    # accelerator.compute_efficiency): the slp ring's overlap estimate prices compute at
    # the effective rate, as the simulator does, not at the peak
    acc_compute_efficiency: float = 0.7
    acc_mem_bytes: int = 32 * 2**30
    # auto policy (PAPER.md: below ~4K tokens SLP does not help)
    auto_slp_min_tokens: int = 4096
    auto_dslp_min_tokens: int = 4096  # with >= 2 accelerators and no decode active
    cpu_prefill_chunk_tokens: int = 2048
    slp_experts_per_slot: int = 1

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            want = _TYPES[str(f.type)]
            rule = _FIELD_RULES.get(f.name, _RULES[want])
            v = check_value(f"SystemSpec: key {f.name!r}", want, rule, getattr(self, f.name))
            object.__setattr__(self, f.name, v)

    @classmethod
    def from_profile(cls, profile: Profile) -> SystemSpec:
        """The plan knobs of a profile's box (with as many accelerators as it has): what the
        engine's schedules plan with there, and what the simulator times."""
        acc, link, sch = (profile.values[k] for k in ("accelerator", "link", "schedule"))
        return cls(
            name=profile.name,
            num_accelerators=int(acc["count"]),
            h2d_gbps=float(link["h2d_gbps"]),
            acc_fp32_tflops=float(acc["fp32_tflops"]),
            acc_bf16_tflops=float(acc["bf16_tflops"]),
            acc_fp8_tflops=float(acc["fp8_tflops"]),
            acc_compute_efficiency=float(acc["compute_efficiency"]),
            acc_mem_bytes=int(acc["mem_bytes"]),
            **{k: int(sch[k]) for k in _SCHEDULE_KEYS},
        )


def load_system(name_or_path: str, devices: int | None = None) -> SystemSpec:
    """The SystemSpec of profile NAME (configs/systems/NAME.toml, or a path to a .toml),
    using its first `devices` accelerators (None: all it has). A ConfigError lists the
    known profiles when NAME is not one, and names the count when the box has fewer
    accelerators than asked for (a stand-in box, placement "host", has any number)."""
    prof = load_profile(name_or_path)
    return SystemSpec.from_profile(prof if devices is None else prof.with_accelerators(devices))


MAX_COPY_THREADS = 8  # past this a host's memcpy is memory-bandwidth bound, not thread bound


def copy_threads_for(
    link_gbps: float, one_thread_gbps: float, cores: int, max_threads: int = MAX_COPY_THREADS
) -> int:
    """Host memcpy threads that keep a `link_gbps` link busy: ceil(link / one thread's rate),
    at least 1, at most min(cores, max_threads). The staging ring sizes its threads with it
    (runtime/staging.size_copy_threads) and the simulator's bands the pessimistic end of
    cpu.copy_threads (sim/bands.py)."""
    if not link_gbps > 0 or not one_thread_gbps > 0:
        raise ValueError(
            f"copy_threads_for: link_gbps ({link_gbps}) and one_thread_gbps ({one_thread_gbps}) must be > 0"
        )
    if cores < 1 or max_threads < 1:
        raise ValueError(f"copy_threads_for: cores ({cores}) and max_threads ({max_threads}) must be >= 1")
    return max(1, min(math.ceil(link_gbps / one_thread_gbps), cores, max_threads))
