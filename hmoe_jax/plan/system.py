"""What a schedule needs to know about the machine: link and accelerator rates, memory,
and the auto-policy thresholds. Read from configs/systems/<name>.json (a file shared with
the simulator: keys the engine does not use are ignored there, never invented here)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from hmoe_jax.config import ConfigError, configs_dir


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    name: str = "local"
    num_accelerators: int = 1
    h2d_gbps: float = 56.0  # host -> accelerator copy rate (PCIe 5.0 x16 measured, PAPER.md)
    acc_tflops: float = 419.0  # dense FP8 tensor throughput of one accelerator (RTX 5090)
    acc_mem_bytes: int = 32 * 2**30
    cpu_mem_gbps: float = 1228.0  # host DRAM bandwidth (decode experts are bound by it)
    # auto policy (PAPER.md: below ~4K tokens SLP does not help)
    auto_slp_min_tokens: int = 4096
    auto_dslp_min_tokens: int = 4096  # with >= 2 accelerators and no decode active
    cpu_prefill_chunk_tokens: int = 2048
    slp_experts_per_slot: int = 1


_FIELDS = {f.name: f for f in dataclasses.fields(SystemSpec)}


def system_from_dict(d: dict[str, Any], where: str = "system") -> SystemSpec:
    kw: dict[str, Any] = {}
    for key, f in _FIELDS.items():
        if key in d:
            want = {"str": str, "int": int, "float": float}[
                f.type if isinstance(f.type, str) else f.type.__name__
            ]
            try:
                kw[key] = want(d[key])
            except (TypeError, ValueError):
                raise ConfigError(f"{where}: key {key!r} must be {want.__name__}, got {d[key]!r}") from None
    spec = SystemSpec(**kw)
    if spec.h2d_gbps <= 0 or spec.acc_tflops <= 0:
        raise ConfigError(
            f"{where}: h2d_gbps and acc_tflops must be > 0, got {spec.h2d_gbps}, {spec.acc_tflops}"
        )
    if spec.slp_experts_per_slot < 1 or spec.cpu_prefill_chunk_tokens < 1:
        raise ConfigError(f"{where}: slp_experts_per_slot and cpu_prefill_chunk_tokens must be >= 1")
    return spec


def load_system(name_or_path: str) -> SystemSpec:
    """A system by name from configs/systems/, or a path to a JSON file."""
    p = Path(name_or_path)
    if not p.suffix:
        p = configs_dir() / "systems" / f"{name_or_path}.json"
    if not p.exists():
        known = sorted(q.stem for q in (configs_dir() / "systems").glob("*.json"))
        raise ConfigError(f"system config {name_or_path!r} not found at {p}; known: {known}")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from None
    raw.setdefault("name", p.stem)
    return system_from_dict(raw, where=str(p))
