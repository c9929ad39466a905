"""What a plan runs against: the placed weights (plus the absorbed-attention weights the
precision policy derives from kv_b once, at placement). The cache is runtime/kvpool.py."""

from __future__ import annotations

import dataclasses

import numpy as np

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.params import ExpertsParams, MLAParams, ModelParams
from hmoe_jax.model.precision import F32, Precision
from hmoe_jax.quant.fp8 import Fp8Tensor, dequantize_np
from hmoe_jax.runtime import placement as P


@dataclasses.dataclass
class PlacedWeights:
    """One host copy of everything; non-expert weights placed on the first accelerator."""

    cfg: ModelConfig
    placement: P.Placement
    host: ModelParams  # every leaf: aligned host numpy (the one copy)
    acc: ModelParams  # routed experts removed, the rest on placement.acc
    host_experts: list[ExpertsParams | None]  # per layer, numpy (SLP streams these)
    host_experts_dev: list[ExpertsParams | None]  # the same buffers as host-device jax arrays
    host_copied_bytes: int = 0  # bytes host_params had to re-align (0 for an aligned arena)
    _acc_full: ModelParams | None = None

    @staticmethod
    def place(
        params: ModelParams, cfg: ModelConfig, placement: P.Placement, prec: Precision = F32
    ) -> PlacedWeights:
        host, copied = P.host_params(params)
        rest, experts = P.split_experts(host)
        acc = P.put(with_absorbed_weights(rest, cfg, prec), placement.acc)
        experts_dev = [None if e is None else P.put(e, placement.host) for e in experts]
        return PlacedWeights(cfg, placement, host, acc, experts, experts_dev, copied)

    def acc_full(self) -> ModelParams:
        """All weights on the accelerator (the reference schedule; zero-copy on stand-ins,
        a full VRAM copy on a GPU, so only for models that fit)."""
        if self._acc_full is None:
            self._acc_full = P.put(self.host, self.placement.acc)
        return self._acc_full


def absorbed_weights(attn: MLAParams, cfg: ModelConfig, prec: Precision) -> tuple[object, object]:
    """(w_uk, w_uv) for a bf16 policy, derived once from kv_b [H (dn + dv), R] (numpy):
    FP8 kv_b with the per-head FP8 kernel hook -> Fp8Tensors w_uk [H, R, dn] (each 128 x 128
    block transposed with its scale: exact) and w_uv [H, dv, R] (a slice); otherwise plain
    arrays w_uk [H, dn, R], w_uv [H, dv, R] in the policy's dot dtype (what vLLM keeps too:
    one bf16 copy of kv_b's two halves instead of a dequantisation every step)."""
    h, dn, dv, r = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    kv_b = attn.kv_b
    blocks_fit = isinstance(kv_b, Fp8Tensor) and kv_b.block_n == 128 and dn % 128 == 0 and dv % 128 == 0
    if blocks_fit and prec.fp8_head_matmul is not None:
        w = np.asarray(kv_b.w).reshape(h, dn + dv, r)
        sc = np.asarray(kv_b.scale_inv).reshape(h, (dn + dv) // 128, -1)
        nb = dn // 128
        uk = Fp8Tensor(
            w=np.ascontiguousarray(w[:, :dn].transpose(0, 2, 1)),
            scale_inv=np.ascontiguousarray(sc[:, :nb].transpose(0, 2, 1)),
            block_n=kv_b.block_k,
            block_k=kv_b.block_n,
        )
        uv = Fp8Tensor(
            w=np.ascontiguousarray(w[:, dn:]),
            scale_inv=np.ascontiguousarray(sc[:, nb:]),
            block_n=128,
            block_k=kv_b.block_k,
        )
        return uk, uv
    full = dequantize_np(kv_b) if isinstance(kv_b, Fp8Tensor) else np.asarray(kv_b, np.float32)
    full = full.reshape(h, dn + dv, r)
    dt = np.dtype(prec.dot_dtype)
    return np.ascontiguousarray(full[:, :dn]).astype(dt), np.ascontiguousarray(full[:, dn:]).astype(dt)


def with_absorbed_weights(params: ModelParams, cfg: ModelConfig, prec: Precision) -> ModelParams:
    """params with MLAParams.w_uk / w_uv filled for a non-exact policy (unchanged for f32:
    the parity policy derives them from kv_b inside the computation, as the reference)."""
    if prec.exact:
        return params
    layers = []
    for lp in params.layers:
        uk, uv = absorbed_weights(lp.attn, cfg, prec)
        layers.append(lp.replace(attn=lp.attn.replace(w_uk=uk, w_uv=uv)))
    return params.replace(layers=tuple(layers))
