"""Load-time model changes for the model-running commands (generate, logits, serve):
`--hf-overrides JSON` (vLLM's flag: config.json keys overridden before the model is built)
and `--experts-format int4` (routed experts converted to our INT4 group-64 format at load).

Both exist to serve the capacity-reduced variants peers ship (experiments/e07_quality.py,
e08_lm_eval.py): fewer routed experts per token, INT4 CPU experts. An override may change
only how the stored weights are used (routing, norms, context, rope, special ids); a key
that would change a weight's shape, or that the loader ignores, is refused by name, since
either would be a silent wrong answer.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from hmoe_jax.config import _IGNORED_KEYS, ConfigError, ModelConfig, config_from_dict
from hmoe_jax.io.errors import InputError

EXPERTS_FORMATS = ("stored", "int4")
INT4_GROUP = 64  # the paper's INT4 configuration (hmoe_jax/quant/int4.py)

# fields that fix the weights' shapes / storage: an override must leave them as stored
_WEIGHT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "n_shared_experts",
    "first_k_dense_replace",
    "quant",
    "model_type",
)


def parse_hf_overrides(text: str) -> dict[str, Any]:
    """The --hf-overrides value: a JSON object of config.json keys."""
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"--hf-overrides: not valid JSON ({e.msg} at char {e.pos}): {text!r}") from None
    if not isinstance(d, dict):
        raise InputError(
            f"--hf-overrides: expected a JSON object like '{{\"num_experts_per_tok\": 2}}', got {text!r}"
        )
    return d


def apply_hf_overrides(cfg: ModelConfig, ckpt: Path, overrides: dict[str, Any]) -> ModelConfig:
    """cfg rebuilt from the checkpoint's config.json with `overrides` merged in (validated as
    a config file is). Raises InputError naming the key for an unknown key, a key the loader
    ignores, or a key that changes the weights' shapes."""
    if not overrides:
        return cfg
    path = Path(ckpt) / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else cfg.to_hf_dict()
    ignored = sorted(k for k in overrides if k in _IGNORED_KEYS)
    if ignored:
        raise InputError(
            f"--hf-overrides: key(s) {ignored} are ignored by the loader; overriding them has no effect"
        )
    merged = {**raw, **overrides}
    # rope_parameters and rope_scaling are two spellings of one thing: overriding one
    # replaces the other rather than tripping the "both set" check
    for a, b in (("rope_parameters", "rope_scaling"), ("rope_scaling", "rope_parameters")):
        if a in overrides and b not in overrides:
            merged.pop(b, None)
    try:
        new = config_from_dict(merged, where="--hf-overrides")
    except ConfigError as e:
        raise InputError(str(e)) from None
    changed = [f for f in _WEIGHT_FIELDS if getattr(new, f) != getattr(cfg, f)]
    if changed:
        raise InputError(
            f"--hf-overrides: {changed} would change the weights' shapes or storage; only keys that "
            "change how the stored weights are used (e.g. num_experts_per_tok) may be overridden"
        )
    return new


def int4_routed_experts(params: Any, cfg: ModelConfig, group: int = INT4_GROUP) -> Any:
    """params with every MoE layer's routed experts quantized to INT4 (hmoe_jax/quant/int4.py,
    group `group`) from the stored experts: bf16 as stored, FP8 dequantized to f32 first."""
    import numpy as np

    from hmoe_jax.model.params import ExpertsParams, MoEParams
    from hmoe_jax.quant.fp8 import Fp8Tensor
    from hmoe_jax.quant.int4 import quantize_int4_np

    def q(w: Any) -> Any:
        return quantize_int4_np(w if isinstance(w, Fp8Tensor) else np.asarray(w, np.float32), group)

    layers = []
    for i, ly in enumerate(params.layers):
        if cfg.is_moe_layer(i) and isinstance(ly.ffn, MoEParams):
            e = ly.ffn.experts
            ly = ly.replace(ffn=ly.ffn.replace(experts=ExpertsParams(q(e.gate), q(e.up), q(e.down))))
        layers.append(ly)
    return params.replace(layers=tuple(layers))


def with_experts_format(params: Any, cfg: ModelConfig, fmt: str) -> Any:
    if fmt == "stored":
        return params
    if fmt == "int4":
        return int4_routed_experts(params, cfg)
    raise InputError(f"--experts-format {fmt!r}: expected one of {EXPERTS_FORMATS}")


def describe(cfg_before: ModelConfig, cfg: ModelConfig, fmt: str) -> str | None:
    """One stderr line saying what was changed at load, or None."""
    parts = [
        f"{f.name} {getattr(cfg_before, f.name)} -> {getattr(cfg, f.name)}"
        for f in dataclasses.fields(cfg)
        if getattr(cfg_before, f.name) != getattr(cfg, f.name)
    ]
    if fmt != "stored":
        parts.append(f"routed experts as {fmt} (group {INT4_GROUP})")
    return "hmoe: load options: " + "; ".join(parts) if parts else None
