"""Parameter pytrees of a DeepSeek-V3-architecture model.

This file is the contract between the checkpoint loader (hmoe_jax.io), the model
(hmoe_jax.model), the kernels and the engine. Leaves are arrays (numpy, memmap or jax);
a weight matrix is either a plain array laid out as in PyTorch's nn.Linear ([out, in]) or
a quantized tensor from hmoe_jax.quant (Fp8Tensor, later Int4Tensor) with the same
logical shape. Routed experts of one layer are stacked on a leading expert axis so that a
kernel can take the whole layer plus expert ids (no per-call slicing copies).
"""

from __future__ import annotations

from typing import Any

from flax import struct

from hmoe_jax.quant.fp8 import Fp8Tensor

Array = Any  # np.ndarray | jax.Array
Weight = Array | Fp8Tensor  # logical shape [..., out, in]


@struct.dataclass
class MLAParams:
    kv_a: Weight  # [kv_lora_rank + qk_rope_head_dim, D]   (kv_a_proj_with_mqa)
    kv_a_norm: Array  # [kv_lora_rank]
    kv_b: Weight  # [H * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
    o: Weight  # [D, H * v_head_dim]
    # With q_lora_rank: q_a/q_a_norm/q_b set, q None. Without: q set, the others None.
    q_a: Weight | None = None  # [q_lora_rank, D]
    q_a_norm: Array | None = None  # [q_lora_rank]
    q_b: Weight | None = None  # [H * qk_head_dim, q_lora_rank]
    q: Weight | None = None  # [H * qk_head_dim, D]
    # Absorbed-attention weights derived from kv_b at placement (runtime/placement.py), not in
    # checkpoints: arrays w_uk [H, dn, R] / w_uv [H, dv, R] in the policy's dtype, or, for the
    # per-head FP8 kernel, Fp8Tensors w_uk [H, R, dn] (kv_b's 128x128 blocks transposed:
    # exact, same scales) / w_uv [H, dv, R]. None: derived from kv_b inside the computation.
    w_uk: Weight | None = None
    w_uv: Weight | None = None


@struct.dataclass
class FFNParams:
    """SwiGLU MLP: down(silu(gate x) * up x). Dense layers and the shared expert(s)."""

    gate: Weight  # [I, D]
    up: Weight  # [I, D]
    down: Weight  # [D, I]


@struct.dataclass
class ExpertsParams:
    """All routed experts of one layer, stacked: expert e is index e of the leading axis."""

    gate: Weight  # [E, I, D]
    up: Weight  # [E, I, D]
    down: Weight  # [E, D, I]


@struct.dataclass
class MoEParams:
    router: Array  # [E, D]  (mlp.gate.weight), used in f32
    router_bias: Array  # [E]  (mlp.gate.e_score_correction_bias), selection only
    experts: ExpertsParams
    shared: FFNParams | None  # intermediate = moe_intermediate_size * n_shared_experts


@struct.dataclass
class LayerParams:
    attn_norm: Array  # [D]  input_layernorm
    attn: MLAParams
    ffn_norm: Array  # [D]  post_attention_layernorm
    ffn: FFNParams | MoEParams  # FFNParams for layers < first_k_dense_replace


@struct.dataclass
class ModelParams:
    embed: Array  # [V, D]
    layers: tuple[LayerParams, ...]
    norm: Array  # [D]
    lm_head: Weight  # [V, D]
