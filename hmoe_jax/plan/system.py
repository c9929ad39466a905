"""What a schedule needs to know about the machine: link and accelerator rates, memory,
and the auto-policy thresholds. Read from configs/systems/<name>.json, strictly like model
configs: an unknown key is a ConfigError naming it (a typo must not fall back to a
default), "comment" is the one documentation key, and every value is checked (type, > 0).

Accelerator compute is priced per dtype (acc_fp32/bf16/fp8_tflops: dense tensor rates of
one accelerator) so a cost model charges the dtype that actually runs."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from hmoe_jax.config import ConfigError, configs_dir


@dataclasses.dataclass(frozen=True)
class SystemSpec:
    name: str = "local"
    num_accelerators: int = 1
    h2d_gbps: float = 56.0  # host -> accelerator copy rate (PCIe 5.0 x16 measured, PAPER.md)
    # one accelerator's dense throughput per dtype (RTX 5090 public specs; FP8 with f32
    # accumulate) and its memory
    acc_fp32_tflops: float = 105.0
    acc_bf16_tflops: float = 209.0
    acc_fp8_tflops: float = 419.0
    acc_mem_gbps: float = 1792.0  # GDDR7
    acc_mem_bytes: int = 32 * 2**30
    cpu_mem_gbps: float = 1228.0  # host DRAM bandwidth (decode experts are bound by it)
    # auto policy (PAPER.md: below ~4K tokens SLP does not help)
    auto_slp_min_tokens: int = 4096
    auto_dslp_min_tokens: int = 4096  # with >= 2 accelerators and no decode active
    cpu_prefill_chunk_tokens: int = 2048
    slp_experts_per_slot: int = 1

    def __post_init__(self) -> None:
        for key in _FIELDS:  # validated here too, so SystemSpec(...) in code is checked
            object.__setattr__(self, key, _check_value(key, getattr(self, key), "SystemSpec"))


_TYPES = {"str": str, "int": int, "float": float}
_FIELDS = {f.name: _TYPES[str(f.type)] for f in dataclasses.fields(SystemSpec)}  # key -> type
_DOC_KEYS = frozenset({"comment"})  # documentation only: accepted, not stored
_RULES = {str: "a non-empty string", int: "an int >= 1", float: "a finite number > 0"}


def _check_value(key: str, v: Any, where: str) -> Any:
    """v as the field's type; ConfigError naming the key if it is the wrong type or <= 0."""
    want = _FIELDS[key]
    if want is str:
        ok = isinstance(v, str) and v != ""
    elif want is int:  # a bool is a Python int, never a count here; 2.0 is not an int either
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
    else:  # a JSON integer is a fine rate ("h2d_gbps": 25)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
    if not ok:
        raise ConfigError(f"{where}: key {key!r} must be {_RULES[want]}, got {v!r}")
    return want(v)


def system_from_dict(d: dict[str, Any], where: str = "system") -> SystemSpec:
    unknown = set(d) - set(_FIELDS) - _DOC_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown system key(s) {sorted(unknown)}; known: {sorted(_FIELDS)}")
    return SystemSpec(**{k: _check_value(k, v, where) for k, v in d.items() if k in _FIELDS})


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
