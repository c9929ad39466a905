"""Accelerator precision policy: the dtypes activations and the latent cache are stored in,
and which matmul implementations consume the weights.

- `bf16` (default for serving): activations, hidden hops and the latent cache in bf16;
  every matmul accumulates in f32 (`preferred_element_type`); norms, softmax, the router
  and the online-softmax statistics in f32. FP8 weights stay FP8 and are consumed inside
  the matmul: on the CPU stand-in by our FFI kernels (which round activations to bf16
  exactly like this policy); on a GPU (engine.precision_for) by the block-scaled FP8 GEMMs
  of kernels/fp8_gemm.py, which also quantise the activations to e4m3 per token per 128
  channels (DeepSeek's own inference): fp8_matmul for [N, K] weights, fp8_grouped_matmul
  for the SLP ring slot's experts (rows sorted by expert), fp8_head_matmul for the absorbed
  MLA's per-head halves of kv_b. A weight no hook covers is dequantised to bf16 inside the
  computation that uses it, one matrix at a time (never a whole-layer or lm_head f32 copy).
- `f32`: everything in f32 with f32 weights dequantised in f32: the HF-parity policy
  (tests compare it with transformers at 1e-4).

A Precision is static (hashable) and passed to jitted functions like `cfg`. Matmul hooks
are plain functions so the model layer does not import the kernels (kernels sit above it):
the engine builds the policy with the kernels' functions (hmoe_jax.runtime.placement).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp

# hook(x [..., K], w) -> [..., N] f32
MatmulFn = Callable[[Any, Any], Any]
# hook(x [M, K] rows sorted by group, w Fp8Tensor [G, N, K], group_sizes [G]) -> [M, N] f32
GroupedMatmulFn = Callable[[Any, Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class Precision:
    name: str
    act_dtype: Any  # activations between ops, hops, residual stream
    cache_dtype: Any  # latent + rope cache
    # dtype dots are computed in when both operands are activations/caches (scores, P.V):
    # bf16 on GPUs; f32 on XLA:CPU, which cannot run BF16 x BF16 -> F32 dots.
    dot_dtype: Any
    fp8_matmul: MatmulFn | None = None  # Fp8Tensor [N, K] weights
    bf16_matmul: MatmulFn | None = None  # bf16 [N, K] weights (lm_head)
    fp8_head_matmul: MatmulFn | None = None  # Fp8Tensor [H, N, K] per-head weights (absorbed MLA)
    fp8_grouped_matmul: GroupedMatmulFn | None = None  # Fp8Tensor [G, N, K] expert groups (SLP)

    @property
    def exact(self) -> bool:
        """f32 everywhere (HF parity)."""
        return self.name == "f32"

    @property
    def matmul_precision(self) -> Any:
        # f32 policy: full f32 products on GPUs too (XLA:GPU would otherwise use TF32).
        import jax

        return jax.lax.Precision.HIGHEST if self.exact else None


F32 = Precision("f32", jnp.float32, jnp.float32, jnp.float32)
BF16 = Precision("bf16", jnp.bfloat16, jnp.bfloat16, jnp.bfloat16)
BF16_CPU = Precision("bf16", jnp.bfloat16, jnp.bfloat16, jnp.float32)

POLICIES = ("bf16", "f32")


def policy(
    name: str,
    *,
    cpu: bool,
    accel_fp8_matmul: MatmulFn | None = None,
    accel_fp8_grouped_matmul: GroupedMatmulFn | None = None,
    accel_fp8_head_matmul: MatmulFn | None = None,
    **hooks: MatmulFn | None,
) -> Precision:
    """The named policy for a backend: `cpu` selects f32 activation dots (XLA:CPU) and
    allows the CPU matmul hooks (`hooks`: our FFI kernels run on CPU devices only). The
    accel_* hooks are the accelerator's FP8 GEMMs (kernels.fp8_gemm: fp8_linear,
    fp8_grouped_linear, fp8_head_linear): the bf16 policy on a non-CPU backend consumes FP8
    weights through them instead of a bf16 dequantisation. They are ignored on CPU, so the
    CPU policy is the same object with or without them (tests build the GPU policy on CPU
    with cpu=False and the kernels' interpret or `_ref` forms)."""
    if name == "f32":
        return F32
    if name != "bf16":
        raise ValueError(f"precision {name!r}: expected one of {POLICIES}")
    if cpu:
        return dataclasses.replace(BF16_CPU, **hooks)
    accel = {
        "fp8_matmul": accel_fp8_matmul,
        "fp8_grouped_matmul": accel_fp8_grouped_matmul,
        "fp8_head_matmul": accel_fp8_head_matmul,
    }
    accel = {k: v for k, v in accel.items() if v is not None}
    return dataclasses.replace(BF16, **accel) if accel else BF16
