"""Test helper: a tiny random HF `DeepseekV3ForCausalLM` built from one of our ModelConfigs,
the numerical reference of the model tests (and of the CLI tests of hmoe_jax.io).

Every parameter gets a non-trivial random value, including the norm weights and the
router's e_score_correction_bias (HF initialises those to ones/zeros, which would hide a
missing norm weight or a bias used in the weights). HF 5.x keeps the routed experts fused
in memory (`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj` [E, D, I]);
`hf_state_dict` converts them to DeepSeek's per-expert names, which are also the names
`save_pretrained` writes.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import torch

from hmoe_jax.config import ModelConfig, RopeConfig, named_model_config
from hmoe_jax.io.names import build_params
from hmoe_jax.model.params import ModelParams
from hmoe_jax.quant.fp8 import Fp8Tensor, dequantize_np, quantize_np


def tiny_config(
    name: str = "deepseek_v3_tiny", *, rope: RopeConfig | None = None, **overrides
) -> ModelConfig:
    """A configs/models/<name>.json twin with overrides, unquantized (quant=None): the
    parity tests run on f32 weights and quantize explicitly where they test FP8."""
    cfg = named_model_config(name)
    kw = dict(quant=None, **overrides)
    if rope is not None:
        kw["rope"] = rope
    return dataclasses.replace(cfg, **kw)


def hf_config(cfg: ModelConfig):
    """DeepseekV3Config from ModelConfig.to_hf_dict() (eager attention, no MTP layer)."""
    from transformers import DeepseekV3Config

    d = cfg.to_hf_dict()
    d.pop("quantization_config", None)
    # Kimi-K2 reuses the DeepSeek-V3 class; HF's config class fixes model_type itself.
    d.pop("model_type", None)
    hc = DeepseekV3Config(**d)
    hc._attn_implementation = "eager"
    return hc


_FUSED_GATE_UP = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.down_proj$")


def hf_state_dict(model) -> dict[str, np.ndarray]:
    """The model's tensors as f32 numpy under DeepSeek's names (experts unfused)."""
    out: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        a = t.detach().to(torch.float32).cpu().numpy()
        if m := _FUSED_GATE_UP.match(name):
            inter = a.shape[1] // 2  # gate rows first: HF does gate, up = linear(...).chunk(2)
            for j in range(a.shape[0]):
                out[f"{m[1]}.{j}.gate_proj.weight"] = a[j, :inter]
                out[f"{m[1]}.{j}.up_proj.weight"] = a[j, inter:]
        elif m := _FUSED_DOWN.match(name):
            for j in range(a.shape[0]):
                out[f"{m[1]}.{j}.down_proj.weight"] = a[j]
        else:
            out[name] = a
    return out


@torch.no_grad()
def _randomize(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if "rotary_emb" in name:
            continue  # inv_freq buffers: computed from the config
        if name.endswith("e_score_correction_bias"):
            # Comparable to the spread of sigmoid scores, so selection differs from the
            # unbiased ranking and the weights must come from the unbiased scores.
            t.copy_(0.1 * torch.randn(t.shape, generator=g))
        elif t.ndim == 1:  # RMSNorm weights
            t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
        elif name.endswith("embed_tokens.weight"):
            t.copy_(torch.randn(t.shape, generator=g))
        elif name.endswith("mlp.gate.weight"):
            # Router logits of O(1): sigmoid scores well spread, few near-ties.
            t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)
        else:  # [.., out, in] projections: unit-variance outputs for unit inputs
            t.copy_(torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5)


def build_hf_model(cfg: ModelConfig, seed: int = 0):
    """(model in eval mode, f32, random init; its state dict as numpy under DeepSeek names)."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(hf_config(cfg)).to(torch.float32).eval()
    _randomize(model, seed)
    return model, hf_state_dict(model)


def params_from_state(cfg: ModelConfig, state: dict[str, np.ndarray]) -> ModelParams:
    return build_params(cfg, lambda name: state[name])


def quantized_state(cfg: ModelConfig, state: dict[str, np.ndarray]) -> dict[str, object]:
    """The FP8 release form of `state`: every tensor DeepSeek stores quantized becomes an
    Fp8Tensor (quantize_np), the rest stays f32."""
    from hmoe_jax.io.names import expected_tensors

    quant = {s.name for s in expected_tensors(cfg) if s.quantized}
    return {k: quantize_np(v) if k in quant else v for k, v in state.items()}


def dequantized_state(qstate: dict[str, object]) -> dict[str, np.ndarray]:
    return {k: dequantize_np(v) if isinstance(v, Fp8Tensor) else v for k, v in qstate.items()}


@torch.no_grad()
def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    """Teacher-forced logits [B, T, V] f32 of token ids [B, T]."""
    out = model(input_ids=torch.as_tensor(np.asarray(ids), dtype=torch.long), use_cache=False)
    return out.logits.to(torch.float32).numpy()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF generate(do_sample=False) with its default DynamicCache (which stores the same
    normed latent + roped k_rope as ours); EOS disabled so exactly max_new_tokens come."""
    from transformers import GenerationConfig

    ids = torch.as_tensor([prompt], dtype=torch.long)
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen, use_cache=True)
    return out[0, len(prompt) :].tolist()
