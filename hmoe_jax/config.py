"""Model configuration: a frozen, validated view of an HF DeepSeek-V3-style ``config.json``.

Unknown keys are errors (a typo must not silently fall back to a default); keys that only
describe training or packaging are accepted and ignored; keys whose value selects a
behaviour we do not implement are checked against the one value we support.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that we cannot run faithfully. The message names the key."""


# Keys that change nothing at inference time (training knobs, packaging, HF bookkeeping).
_IGNORED_KEYS = frozenset(
    {
        "architectures",
        "auto_map",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "initializer_range",
        "aux_loss_alpha",
        "seq_aux",
        "ep_size",
        "pretraining_tp",
        "attention_dropout",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
        "output_router_logits",
        "_name_or_path",
        "pad_token_id",
        "tokenizer_class",
        "num_nextn_predict_layers",
        "qk_head_dim",
        "head_dim",
        "router_aux_loss_coef",
        "tie_word_embeddings",
    }
)

# Keys whose only supported value is fixed: (key, allowed values).
_FIXED_KEYS = {
    "hidden_act": ("silu",),
    "scoring_func": ("sigmoid",),
    "topk_method": ("noaux_tc",),
    "moe_layer_freq": (1,),
    "attention_bias": (False,),
    "rope_interleave": (True,),
}

_MODEL_TYPES = ("deepseek_v3", "kimi_k2")
_ROPE_TYPES = ("default", "yarn")
_ROPE_KEYS = frozenset(
    {
        "rope_type",
        "type",
        "rope_theta",
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
    }
)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """DeepSeek's released FP8 format: e4m3 weights, one f32 scale per block, multiplied."""

    fmt: str = "e4m3"
    block_n: int = 128
    block_k: int = 128


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense FFN of the first_k_dense_replace layers
    moe_intermediate_size: int  # one routed (and one shared) expert
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    q_lora_rank: int | None  # None: plain q_proj (DeepSeek-V2-Lite style)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    norm_topk_prob: bool
    first_k_dense_replace: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    quant: QuantConfig | None = None  # set when the checkpoint is block-FP8

    # Derived sizes, named as the paper and DeepSeek's code use them.
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values per token per layer in the latent KV cache (576 for DeepSeek-V3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk_head_dim), times YaRN's mscale^2 correction (DeepSeek-V3, HF)."""
        scale = self.qk_head_dim**-0.5
        r = self.rope
        if r.rope_type == "yarn" and r.mscale_all_dim:
            m = yarn_get_mscale(r.factor, r.mscale_all_dim)
            scale = scale * m * m
        return scale

    @property
    def eos_ids(self) -> tuple[int, ...]:
        if self.eos_token_id is None:
            return ()
        if isinstance(self.eos_token_id, int):
            return (self.eos_token_id,)
        return tuple(self.eos_token_id)

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json HF transformers 5.x writes for this model (rope_parameters form)."""
        d: dict[str, Any] = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("rope", "quant")
        }
        # HF has one model class for both families; "kimi_k2" is not an HF model_type
        # (AutoConfig would refuse the file), so the HF view always says deepseek_v3.
        d["model_type"] = "deepseek_v3"
        d["architectures"] = ["DeepseekV3ForCausalLM"]
        if isinstance(d["eos_token_id"], tuple):
            d["eos_token_id"] = list(d["eos_token_id"])
        r = self.rope
        rp: dict[str, Any] = {"rope_theta": r.theta, "rope_type": r.rope_type}
        if r.rope_type == "yarn":
            rp.update(
                factor=r.factor,
                original_max_position_embeddings=r.original_max_position_embeddings,
                beta_fast=r.beta_fast,
                beta_slow=r.beta_slow,
                mscale=r.mscale,
                mscale_all_dim=r.mscale_all_dim,
            )
        d["rope_parameters"] = rp
        d["tie_word_embeddings"] = False
        d["num_nextn_predict_layers"] = 0
        d["hidden_act"] = "silu"
        d["rope_interleave"] = True
        d["attention_bias"] = False
        if self.quant is not None:
            d["quantization_config"] = {
                "activation_scheme": "dynamic",
                "fmt": self.quant.fmt,
                "quant_method": "fp8",
                "weight_block_size": [self.quant.block_n, self.quant.block_k],
            }
        return d


def yarn_get_mscale(scale: float = 1.0, mscale: float = 1.0) -> float:
    if scale <= 1.0:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _parse_rope(d: dict[str, Any], where: str) -> RopeConfig:
    # HF 5.x writes `rope_parameters` (with rope_theta inside); DeepSeek's release writes
    # `rope_theta` + `rope_scaling` (with "type"). Accept both, but not both at once.
    params = d.pop("rope_parameters", None)
    scaling = d.pop("rope_scaling", None)
    theta = d.pop("rope_theta", None)
    if params is not None and scaling is not None:
        raise ConfigError(f"{where}: both 'rope_parameters' and 'rope_scaling' are set; keep one")
    rp = dict(params or scaling or {})
    unknown = set(rp) - _ROPE_KEYS
    if unknown:
        raise ConfigError(f"{where}: unknown rope key(s) {sorted(unknown)}")
    if "rope_theta" in rp and theta is not None and float(rp["rope_theta"]) != float(theta):
        raise ConfigError(f"{where}: rope_theta {theta} disagrees with rope_parameters {rp['rope_theta']}")
    theta = float(rp.pop("rope_theta", theta if theta is not None else 10000.0))
    rtype = rp.pop("rope_type", None) or rp.pop("type", None) or "default"
    rp.pop("type", None)
    if rtype not in _ROPE_TYPES:
        raise ConfigError(f"{where}: rope type {rtype!r} is not supported (expected one of {_ROPE_TYPES})")
    if rtype == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type=rtype,
        factor=float(rp.get("factor", 1.0)),
        original_max_position_embeddings=int(rp.get("original_max_position_embeddings", 4096)),
        beta_fast=float(rp.get("beta_fast", 32.0)),
        beta_slow=float(rp.get("beta_slow", 1.0)),
        mscale=float(rp.get("mscale", 1.0)),
        mscale_all_dim=float(rp.get("mscale_all_dim", 0.0)),
    )


def _parse_quant(q: dict[str, Any] | None, where: str) -> QuantConfig | None:
    if q is None:
        return None
    q = dict(q)
    method = q.pop("quant_method", None)
    if method != "fp8":
        raise ConfigError(
            f"{where}: quantization_config.quant_method {method!r} is not supported (expected 'fp8')"
        )
    fmt = q.pop("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{where}: quantization_config.fmt {fmt!r} is not supported (expected 'e4m3')")
    act = q.pop("activation_scheme", "dynamic")
    if act != "dynamic":
        raise ConfigError(f"{where}: quantization_config.activation_scheme {act!r} is not supported")
    block = q.pop("weight_block_size", [128, 128])
    q.pop("modules_to_not_convert", None)
    if q:
        raise ConfigError(f"{where}: unknown quantization_config key(s) {sorted(q)}")
    if len(block) != 2 or min(block) <= 0:
        raise ConfigError(f"{where}: quantization_config.weight_block_size {block} must be two positive ints")
    return QuantConfig(fmt=fmt, block_n=int(block[0]), block_k=int(block[1]))


_INT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "n_routed_experts",
    "num_experts_per_tok",
    "first_k_dense_replace",
    "max_position_embeddings",
)


def config_from_dict(raw: dict[str, Any], where: str = "config") -> ModelConfig:
    """Validate an HF-style config dict. `where` names the source in error messages."""
    d = dict(raw)
    model_type = d.pop("model_type", "deepseek_v3")
    if model_type not in _MODEL_TYPES:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not supported (expected one of {_MODEL_TYPES})"
        )
    for key, allowed in _FIXED_KEYS.items():
        if key in d:
            v = d.pop(key)
            if v not in allowed:
                raise ConfigError(f"{where}: {key}={v!r} is not supported (expected {allowed[0]!r})")
    rope = _parse_rope(d, where)
    quant = _parse_quant(d.pop("quantization_config", None), where)
    for key in list(d):
        if key in _IGNORED_KEYS:
            d.pop(key)
    missing = [k for k in _INT_KEYS if k not in d]
    if missing:
        raise ConfigError(f"{where}: missing required key(s) {missing}")
    kw: dict[str, Any] = {k: int(d.pop(k)) for k in _INT_KEYS}
    num_heads = kw["num_attention_heads"]
    kw["num_key_value_heads"] = int(d.pop("num_key_value_heads", num_heads))
    q_lora = d.pop("q_lora_rank", None)
    kw["q_lora_rank"] = None if q_lora is None else int(q_lora)
    kw["n_shared_experts"] = int(d.pop("n_shared_experts", 0) or 0)
    kw["n_group"] = int(d.pop("n_group", 1) or 1)
    kw["topk_group"] = int(d.pop("topk_group", 1) or 1)
    kw["routed_scaling_factor"] = float(d.pop("routed_scaling_factor", 1.0))
    kw["norm_topk_prob"] = bool(d.pop("norm_topk_prob", True))
    kw["rms_norm_eps"] = float(d.pop("rms_norm_eps", 1e-6))
    kw["bos_token_id"] = d.pop("bos_token_id", None)
    eos = d.pop("eos_token_id", None)
    kw["eos_token_id"] = tuple(eos) if isinstance(eos, list) else eos
    if d:
        raise ConfigError(f"{where}: unknown config key(s) {sorted(d)}")
    cfg = ModelConfig(model_type=model_type, rope=rope, quant=quant, **kw)
    _check_consistent(cfg, where)
    return cfg


def _check_consistent(cfg: ModelConfig, where: str) -> None:
    def bad(msg: str) -> ConfigError:
        return ConfigError(f"{where}: {msg}")

    if cfg.num_key_value_heads != cfg.num_attention_heads:
        raise bad(
            f"num_key_value_heads={cfg.num_key_value_heads} must equal num_attention_heads={cfg.num_attention_heads} for MLA"
        )
    if cfg.n_routed_experts % cfg.n_group:
        raise bad(f"n_routed_experts={cfg.n_routed_experts} is not divisible by n_group={cfg.n_group}")
    if not 1 <= cfg.topk_group <= cfg.n_group:
        raise bad(f"topk_group={cfg.topk_group} must be in [1, n_group={cfg.n_group}]")
    per_group = cfg.n_routed_experts // cfg.n_group
    if cfg.n_group > 1 and per_group < 2:
        raise bad(f"group-limited routing needs >= 2 experts per group, got {per_group}")
    if cfg.num_experts_per_tok > cfg.topk_group * per_group:
        raise bad(
            f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds the experts in topk_group={cfg.topk_group} groups ({cfg.topk_group * per_group})"
        )
    if cfg.qk_rope_head_dim % 2:
        raise bad(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even")
    if not 0 <= cfg.first_k_dense_replace <= cfg.num_hidden_layers:
        raise bad(f"first_k_dense_replace={cfg.first_k_dense_replace} must be in [0, num_hidden_layers]")


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read a config.json (or a directory holding one)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{p}: config file not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p}: expected a JSON object")
    return config_from_dict(raw, where=str(p))


def configs_dir() -> Path:
    """configs/ of a source checkout, or the copy installed inside the package."""
    here = Path(__file__).resolve().parent
    for cand in (here.parent / "configs", here / "_configs"):
        if (cand / "models").is_dir():
            return cand
    raise ConfigError(f"configs directory not found near {here}")


def named_model_config(name: str) -> ModelConfig:
    """A config from configs/models/, e.g. 'deepseek_v3', 'deepseek_v3_tiny', 'kimi_k2_tiny'."""
    path = configs_dir() / "models" / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in (configs_dir() / "models").glob("*.json"))
        raise ConfigError(f"unknown model config {name!r}; known: {known}")
    return load_config(path)
