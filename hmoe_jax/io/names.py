"""DeepSeek / HF tensor names <-> ModelParams.

`expected_tensors(cfg)` lists every tensor a checkpoint of `cfg` must hold, with its
shape and whether the FP8 release stores it quantized (then a `<name>_scale_inv` tensor
of the block-grid shape sits beside it). `build_params(cfg, get)` assembles ModelParams
from a name -> tensor lookup; it stacks routed experts on a leading axis.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.params import (
    ExpertsParams,
    FFNParams,
    LayerParams,
    MLAParams,
    ModelParams,
    MoEParams,
)
from hmoe_jax.plan.tensors import TensorSpec, expected_tensors  # noqa: F401  (re-exported)
from hmoe_jax.quant.fp8 import Fp8Tensor


def is_unused(cfg: ModelConfig, name: str) -> bool:
    """Tensors a checkpoint may hold that inference skips: the MTP layer(s) stored as
    model.layers.{num_hidden_layers + k}.*, and rotary caches some exporters write."""
    if name.startswith("model.layers."):
        idx = name.split(".")[2]
        if idx.isdigit() and int(idx) >= cfg.num_hidden_layers:
            return True
    return name.endswith("rotary_emb.inv_freq")


Getter = Callable[[str], object]  # name -> array or Fp8Tensor


def _stack(ws: list[object]) -> object:
    """Stack per-expert weights on a new leading axis (one copy at load time; the
    result is the layer's single host copy)."""
    if isinstance(ws[0], Fp8Tensor):
        return Fp8Tensor(
            w=np.stack([np.asarray(w.w) for w in ws]),
            scale_inv=np.stack([np.asarray(w.scale_inv) for w in ws]),
            block_n=ws[0].block_n,
            block_k=ws[0].block_k,
        )
    return np.stack([np.asarray(w) for w in ws])


def build_params(
    cfg: ModelConfig, get: Getter, stack: Callable[[list[object]], object] = _stack
) -> ModelParams:
    """Assemble ModelParams. `get(name)` returns the tensor (already validated against
    expected_tensors); `stack` combines one layer's per-expert tensors (a loader may pass
    one that writes into a preallocated aligned arena instead)."""
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        lora = cfg.q_lora_rank is not None
        attn = MLAParams(
            kv_a=get(f"{a}.kv_a_proj_with_mqa.weight"),
            kv_a_norm=get(f"{a}.kv_a_layernorm.weight"),
            kv_b=get(f"{a}.kv_b_proj.weight"),
            o=get(f"{a}.o_proj.weight"),
            q_a=get(f"{a}.q_a_proj.weight") if lora else None,
            q_a_norm=get(f"{a}.q_a_layernorm.weight") if lora else None,
            q_b=get(f"{a}.q_b_proj.weight") if lora else None,
            q=None if lora else get(f"{a}.q_proj.weight"),
        )

        def ffn(q: str) -> FFNParams:
            return FFNParams(
                gate=get(f"{q}.gate_proj.weight"),
                up=get(f"{q}.up_proj.weight"),
                down=get(f"{q}.down_proj.weight"),
            )

        if cfg.is_moe_layer(i):
            e = range(cfg.n_routed_experts)
            experts = ExpertsParams(
                gate=stack([get(f"{p}.mlp.experts.{j}.gate_proj.weight") for j in e]),
                up=stack([get(f"{p}.mlp.experts.{j}.up_proj.weight") for j in e]),
                down=stack([get(f"{p}.mlp.experts.{j}.down_proj.weight") for j in e]),
            )
            mlp = MoEParams(
                router=get(f"{p}.mlp.gate.weight"),
                router_bias=get(f"{p}.mlp.gate.e_score_correction_bias"),
                experts=experts,
                shared=ffn(f"{p}.mlp.shared_experts") if cfg.n_shared_experts else None,
            )
        else:
            mlp = ffn(f"{p}.mlp")
        layers.append(
            LayerParams(
                attn_norm=get(f"{p}.input_layernorm.weight"),
                attn=attn,
                ffn_norm=get(f"{p}.post_attention_layernorm.weight"),
                ffn=mlp,
            )
        )
    return ModelParams(
        embed=get("model.embed_tokens.weight"),
        layers=tuple(layers),
        norm=get("model.norm.weight"),
        lm_head=get("lm_head.weight"),
    )


def flatten_params(cfg: ModelConfig, params: ModelParams) -> dict[str, object]:
    """Inverse of build_params: name -> tensor (experts unstacked as views). Used by the
    checkpoint writer."""
    out: dict[str, object] = {}

    def put(name: str, x: object) -> None:
        if x is not None:
            out[name] = x

    def unstack(x: object, j: int) -> object:
        if isinstance(x, Fp8Tensor):
            return Fp8Tensor(w=x.w[j], scale_inv=x.scale_inv[j], block_n=x.block_n, block_k=x.block_k)
        return x[j]

    put("model.embed_tokens.weight", params.embed)
    for i, lp in enumerate(params.layers):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        put(f"{p}.input_layernorm.weight", lp.attn_norm)
        put(f"{p}.post_attention_layernorm.weight", lp.ffn_norm)
        put(f"{a}.kv_a_proj_with_mqa.weight", lp.attn.kv_a)
        put(f"{a}.kv_a_layernorm.weight", lp.attn.kv_a_norm)
        put(f"{a}.kv_b_proj.weight", lp.attn.kv_b)
        put(f"{a}.o_proj.weight", lp.attn.o)
        put(f"{a}.q_a_proj.weight", lp.attn.q_a)
        put(f"{a}.q_a_layernorm.weight", lp.attn.q_a_norm)
        put(f"{a}.q_b_proj.weight", lp.attn.q_b)
        put(f"{a}.q_proj.weight", lp.attn.q)

        def put_ffn(q: str, f: FFNParams) -> None:
            put(f"{q}.gate_proj.weight", f.gate)
            put(f"{q}.up_proj.weight", f.up)
            put(f"{q}.down_proj.weight", f.down)

        if isinstance(lp.ffn, MoEParams):
            put(f"{p}.mlp.gate.weight", lp.ffn.router)
            put(f"{p}.mlp.gate.e_score_correction_bias", lp.ffn.router_bias)
            ex = lp.ffn.experts
            for j in range(cfg.n_routed_experts):
                put_ffn(
                    f"{p}.mlp.experts.{j}",
                    FFNParams(gate=unstack(ex.gate, j), up=unstack(ex.up, j), down=unstack(ex.down, j)),
                )
            if lp.ffn.shared is not None:
                put_ffn(f"{p}.mlp.shared_experts", lp.ffn.shared)
        else:
            put_ffn(f"{p}.mlp", lp.ffn)
    put("model.norm.weight", params.norm)
    put("lm_head.weight", params.lm_head)
    return out
