"""Which kernels an engine runs: the host experts' function (jnp reference or the fused CPU
MoE FFI op) and the precision policy's matmul hooks for the placement (our FFI GEMMs on CPU
stand-ins, the Pallas block-scaled FP8 GEMMs on a GPU, plain jnp otherwise)."""

from __future__ import annotations

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.moe import ExpertFn, experts_ref
from hmoe_jax.model.precision import Precision, policy
from hmoe_jax.runtime import placement as P


def ffi_moe_available() -> bool:
    try:
        from hmoe_jax.kernels import ffi

        return "hmoe_moe_experts" in ffi.register_all()
    except ImportError:
        return False


def expert_fn_named(name: str, cfg: ModelConfig | None = None) -> ExpertFn:
    """'ref': plain-JAX experts_ref; 'ffi': the fused CPU MoE op (hmoe_jax.kernels.moe, FP8 /
    INT4 weights); 'auto': ffi for quantized weights when the extension is built, else ref."""
    if name == "auto":
        quantized = cfg is not None and cfg.quant is not None
        name = "ffi" if quantized and ffi_moe_available() else "ref"
    if name == "ref":
        return experts_ref
    if name == "ffi":
        from hmoe_jax.kernels.moe import moe_experts

        return moe_experts
    raise ValueError(f"expert_fn {name!r}: expected 'auto', 'ref' or 'ffi'")


# Accelerator platforms whose bf16 policy runs the Pallas FP8 GEMMs (Triton backend)
GPU_PLATFORMS = ("gpu", "cuda")


def precision_for(name: str, placement: P.Placement) -> Precision:
    """The named policy for this placement. On CPU stand-ins the bf16 policy's weight
    matmuls go through our FFI kernels (they run on the host CPU the stand-in is); on a
    GPU through the Pallas block-scaled FP8 GEMMs (kernels/fp8_gemm.py: every FP8 weight's
    matmul, the SLP ring slot's experts and the absorbed MLA's per-head weights)."""
    if name == "bf16" and placement.acc.platform in GPU_PLATFORMS:
        from hmoe_jax.kernels import fp8_gemm

        return policy(
            name,
            cpu=False,
            accel_fp8_matmul=fp8_gemm.fp8_linear,
            accel_fp8_grouped_matmul=fp8_gemm.fp8_grouped_linear,
            accel_fp8_head_matmul=fp8_gemm.fp8_head_linear,
        )
    if not placement.stand_in or name == "f32" or not ffi_moe_available():
        return policy(name, cpu=placement.stand_in)
    from hmoe_jax.kernels import ffi, gemm

    have = ffi.register_all()

    def hook(fn_name: str, target: str):
        return getattr(gemm, fn_name, None) if target in have else None

    return policy(
        name,
        cpu=True,
        fp8_matmul=hook("fp8_matmul", "hmoe_fp8_gemm"),
        bf16_matmul=hook("bf16_matmul", "hmoe_bf16_gemm"),
        fp8_head_matmul=hook("fp8_head_matmul", "hmoe_fp8_bmv"),
    )


__all__ = ["GPU_PLATFORMS", "expert_fn_named", "ffi_moe_available", "precision_for"]
