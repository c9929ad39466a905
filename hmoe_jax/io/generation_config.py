"""A checkpoint's `generation_config.json` (HF format) as default sampling parameters, as
vLLM's `--generation-config auto` (its default) reads it.

`hmoe generate` and `hmoe serve` take `--generation-config auto|none|DIR`: auto reads
<checkpoint>/generation_config.json when the file exists, DIR reads DIR/generation_config.json
(it must exist), none reads nothing (the builtin defaults). The values are defaults only: a
CLI flag or a request field that is given wins.

Keys used: temperature, top_p, top_k, max_new_tokens, do_sample, and (as vLLM also takes them)
repetition_penalty, min_p, presence_penalty, frequency_penalty. do_sample = false (given
explicitly) means greedy, as HF's generate() does: temperature 0. When do_sample is absent
the temperature is used as written (vLLM ignores do_sample). Every other key is ignored and
named in `ignored` (the commands print it on stderr), except metadata that carries no
sampling choice (_from_model_config, transformers_version, bos/pad token ids). A null value
is an absent key. A malformed file (not JSON, not an object, a value of the wrong type or
out of range) raises CheckpointError naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from hmoe_jax.io.errors import CheckpointError

FILE_NAME = "generation_config.json"
MODES = ("auto", "none")  # or a directory holding FILE_NAME
_METADATA = frozenset({"_from_model_config", "transformers_version", "bos_token_id", "pad_token_id"})


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults from a generation_config.json; None: the file does not set it."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    source: Path | None = None  # the file read, None: nothing read
    ignored: tuple[str, ...] = ()  # keys present but not applied

    def describe(self) -> str:
        """One line for stderr: what was applied and what was ignored."""
        applied = {
            k: v
            for k, v in (
                ("temperature", self.temperature),
                ("top_p", self.top_p),
                ("top_k", self.top_k),
                ("max_new_tokens", self.max_new_tokens),
                ("repetition_penalty", self.repetition_penalty),
                ("min_p", self.min_p),
                ("presence_penalty", self.presence_penalty),
                ("frequency_penalty", self.frequency_penalty),
            )
            if v is not None
        }
        text = f"{self.source}: default sampling " + (
            ", ".join(f"{k}={v}" for k, v in applied.items()) or "none set"
        )
        if self.ignored:
            text += f"; ignored (unsupported): {', '.join(self.ignored)}"
        return text


NO_DEFAULTS = GenerationDefaults()


def _number(path: Path, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise CheckpointError(f"{path}: {key!r} must be a finite number, got {value!r}")
    return float(value)


def _integer(path: Path, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointError(f"{path}: {key!r} must be an integer, got {value!r}")
    return int(value)


def parse_generation_config(path: Path, raw: Any) -> GenerationDefaults:
    """A parsed generation_config.json object -> GenerationDefaults (CheckpointError if bad)."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    got = {k: v for k, v in raw.items() if v is not None}
    vals = _checked(path, got)
    temperature = vals["temperature"]
    if "do_sample" in got:
        if not isinstance(got["do_sample"], bool):
            raise CheckpointError(f"{path}: 'do_sample' must be true or false, got {got['do_sample']!r}")
        if not got["do_sample"]:
            temperature = 0.0  # HF: do_sample=false is greedy whatever the temperature says
        elif temperature is None:
            temperature = 1.0  # HF's default temperature when sampling
    penalties = {k: vals[k] for k in _PENALTIES}
    used = {*_FIELDS, "do_sample"}
    ignored = tuple(sorted(k for k in got if k not in used and k not in _METADATA))
    return GenerationDefaults(
        temperature,
        vals["top_p"],
        vals["top_k"],
        vals["max_new_tokens"],
        **penalties,
        source=path,
        ignored=ignored,
    )


# The keys read, each with its type and the range its request field allows; the processor
# defaults (vLLM reads them too): OpenAI's [-2, 2] for presence / frequency, HF's > 0 for the
# repetition penalty.
_PENALTIES = ("repetition_penalty", "min_p", "presence_penalty", "frequency_penalty")
_FIELDS = {
    "temperature": (_number, lambda x: x >= 0, ">= 0"),
    "top_p": (_number, lambda x: 0 < x <= 1, "in (0, 1]"),
    "top_k": (_integer, lambda x: x >= 0, ">= 0 (0 = off)"),
    "max_new_tokens": (_integer, lambda x: x >= 1, ">= 1"),
    "repetition_penalty": (_number, lambda x: x > 0, "> 0"),
    "min_p": (_number, lambda x: 0 <= x <= 1, "in [0, 1]"),
    "presence_penalty": (_number, lambda x: -2 <= x <= 2, "in [-2, 2]"),
    "frequency_penalty": (_number, lambda x: -2 <= x <= 2, "in [-2, 2]"),
}


def _checked(path: Path, got: dict[str, Any]) -> dict[str, Any]:
    """Each _FIELDS key: its value, typed and range-checked (CheckpointError naming the key), or None."""
    out: dict[str, Any] = {}
    for key, (parse, ok, words) in _FIELDS.items():
        if key not in got:
            out[key] = None
            continue
        value = parse(path, key, got[key])
        if not ok(value):
            raise CheckpointError(f"{path}: {key!r} must be {words}, got {value}")
        out[key] = value
    return out


def load_generation_config(checkpoint: str | Path, mode: str | Path | None) -> GenerationDefaults:
    """Defaults for `--generation-config MODE` and a checkpoint directory. None or "none":
    no defaults; "auto": the checkpoint's file if present; otherwise a directory whose
    generation_config.json must exist."""
    if mode is None or str(mode) == "none":
        return NO_DEFAULTS
    if str(mode) == "auto":
        path = Path(checkpoint) / FILE_NAME
        if not path.is_file():
            return NO_DEFAULTS
    else:
        path = Path(mode) / FILE_NAME
        if not path.is_file():
            raise CheckpointError(f"--generation-config {mode}: {path} not found (or use auto / none)")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not readable JSON ({e})") from None
    return parse_generation_config(path, raw)
