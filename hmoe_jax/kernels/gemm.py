"""CPU FP8 / INT4 matmul kernels (XLA FFI custom calls) and their `_ref` twins.

    y = fp8_matmul(x, w)      # x [..., K] f32|bf16, w Fp8Tensor [N, K] -> y [..., N] f32
    y = int4_matmul(x, w)     # w Int4Tensor [N, K]
    y = bf16_matmul(x, w)     # w bfloat16 [N, K] (lm_head): plain bf16 weights, no scales
    y = fp8_head_matmul(x, w) # x [..., H, K], w Fp8Tensor [H, N, K] -> y [..., H, N] f32

Numerics (all ISA paths, and the `_ref`s): x is rounded to bf16 (nearest even), each
weight decodes exactly, products are exact in f32 and summed in f32 per scale block, the
block scale is applied after that sum. A NaN e4m3 code (0x7F/0xFF) gives NaN outputs.

Weights are passed zero-copy: give jax arrays made with `device_put_zero_copy` (64-byte
aligned host memory; shared/NOTES.md). A plain numpy argument is copied by JAX on every
call, and inside jit it becomes a baked-in constant.

`max_isa` forces a lower path (0 portable, 1 AVX2, 2 AVX-512; -1 = best this CPU has);
`num_threads` 0 = all cores (our own pool; 1 = the calling thread only).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hmoe_jax.kernels.ffi import register_all
from hmoe_jax.quant.fp8 import FP8_DTYPE, Fp8Tensor, dequantize, scale_grid_shape
from hmoe_jax.quant.hostmem import aligned_empty, is_aligned
from hmoe_jax.quant.int4 import BF16_DTYPE, Int4Tensor, dequantize_int4

ISA_PORTABLE, ISA_AVX2, ISA_AVX512 = 0, 1, 2


def device_put_zero_copy(a: np.ndarray) -> jax.Array:
    """A jax CPU array that aliases `a`'s memory (copied once into aligned memory if `a`
    is not 64-byte aligned)."""
    a = np.asarray(a)
    if not is_aligned(a):
        b = aligned_empty(a.shape, a.dtype)
        b[...] = a
        a = b
    return jax.device_put(a, jax.devices("cpu")[0])


def _check_x(op: str, x: Any, k: int) -> None:
    if x.ndim < 1 or x.shape[-1] != k:
        raise ValueError(f"{op}: x shape {tuple(x.shape)} must end in K={k} (the weight's input dim)")
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)):
        raise TypeError(f"{op}: x dtype must be float32 or bfloat16, got {jnp.dtype(x.dtype)}")


def _check_fp8(w: Fp8Tensor, op: str = "fp8_matmul", dims: str = "[N, K]") -> None:
    if not isinstance(w, Fp8Tensor):
        raise TypeError(f"{op}: w must be an Fp8Tensor, got {type(w).__name__}")
    if len(w.w.shape) != dims.count(",") + 1:
        raise ValueError(f"{op}: w.w must be {dims}, got shape {tuple(w.w.shape)}")
    if jnp.dtype(w.w.dtype) not in (jnp.dtype(FP8_DTYPE), jnp.dtype(jnp.uint8)):
        raise TypeError(f"{op}: w.w dtype must be float8_e4m3fn, got {jnp.dtype(w.w.dtype)}")
    want = scale_grid_shape(tuple(w.w.shape), w.block_n, w.block_k)
    if tuple(w.scale_inv.shape) != want:
        raise ValueError(
            f"{op}: w.scale_inv shape {tuple(w.scale_inv.shape)} does not match w.w "
            f"{tuple(w.w.shape)} with {w.block_n}x{w.block_k} blocks: expected {want}"
        )
    if jnp.dtype(w.scale_inv.dtype) != jnp.dtype(jnp.float32):
        raise TypeError(f"{op}: w.scale_inv dtype must be float32, got {jnp.dtype(w.scale_inv.dtype)}")
    if w.block_k % 64:
        raise ValueError(f"{op}: block_k must be a multiple of 64, got {w.block_k}")


def _check_int4(w: Int4Tensor) -> None:
    op = "int4_matmul"
    if not isinstance(w, Int4Tensor):
        raise TypeError(f"{op}: w must be an Int4Tensor, got {type(w).__name__}")
    if len(w.q.shape) != 2:
        raise ValueError(f"{op}: w.q must be [N, K/2], got shape {tuple(w.q.shape)}")
    if jnp.dtype(w.q.dtype) != jnp.dtype(jnp.uint8):
        raise TypeError(f"{op}: w.q dtype must be uint8, got {jnp.dtype(w.q.dtype)}")
    n, k = w.shape
    if w.group % 64 or k % w.group:
        raise ValueError(f"{op}: group={w.group} must be a multiple of 64 dividing K={k}")
    if tuple(w.scale.shape) != (n, k // w.group):
        raise ValueError(
            f"{op}: w.scale shape {tuple(w.scale.shape)} does not match w.q {tuple(w.q.shape)}: "
            f"expected {(n, k // w.group)}"
        )
    if jnp.dtype(w.scale.dtype) != jnp.dtype(BF16_DTYPE):
        raise TypeError(f"{op}: w.scale dtype must be bfloat16, got {jnp.dtype(w.scale.dtype)}")


def _fp8_call(target: str, x: Any, w: Fp8Tensor, n: int, max_isa: int, num_threads: int) -> jax.Array:
    """The FFI call shared by the FP8 ops: y [..., N] f32 from x [..., K] and w's codes + scales."""
    register_all()
    call = jax.ffi.ffi_call(
        target, jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32), vmap_method="expand_dims"
    )
    return call(
        x,
        w.w,
        w.scale_inv,
        max_isa=np.int64(max_isa),
        num_threads=np.int64(num_threads),
        block_n=np.int64(w.block_n),
        block_k=np.int64(w.block_k),
    )


def fp8_matmul(x: Any, w: Fp8Tensor, *, max_isa: int = -1, num_threads: int = 0) -> jax.Array:
    """y[..., n] = sum_k bf16(x)[..., k] * dequant(w)[n, k], f32. Jittable and vmappable
    over x (weights must not be batched)."""
    _check_fp8(w)
    n, k = w.w.shape
    _check_x("fp8_matmul", x, k)
    return _fp8_call("hmoe_fp8_gemm", x, w, n, max_isa, num_threads)


def int4_matmul(x: Any, w: Int4Tensor, *, max_isa: int = -1, num_threads: int = 0) -> jax.Array:
    """y[..., n] = sum_k bf16(x)[..., k] * (q * scale)[n, k], f32."""
    _check_int4(w)
    n, k = w.shape
    _check_x("int4_matmul", x, k)
    register_all()
    call = jax.ffi.ffi_call(
        "hmoe_int4_gemm",
        jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32),
        vmap_method="expand_dims",
    )
    return call(x, w.q, w.scale, max_isa=np.int64(max_isa), num_threads=np.int64(num_threads))


def _check_bf16_weight(w: Any) -> None:
    op = "bf16_matmul"
    if not hasattr(w, "shape") or not hasattr(w, "dtype"):
        raise TypeError(f"{op}: w must be a bfloat16 array [N, K], got {type(w).__name__}")
    if len(w.shape) != 2 or 0 in w.shape:
        raise ValueError(f"{op}: w must be a non-empty [N, K], got shape {tuple(w.shape)}")
    if jnp.dtype(w.dtype) != jnp.dtype(jnp.bfloat16):
        raise TypeError(f"{op}: w dtype must be bfloat16, got {jnp.dtype(w.dtype)}")


def bf16_matmul(x: Any, w: Any, *, max_isa: int = -1, num_threads: int = 0) -> jax.Array:
    """y[..., n] = sum_k bf16(x)[..., k] * w[n, k], one f32 sum per output; w is a plain
    bfloat16 [N, K] (e.g. lm_head), any K. Jittable and vmappable over x."""
    _check_bf16_weight(w)
    n, k = w.shape
    _check_x("bf16_matmul", x, k)
    register_all()
    call = jax.ffi.ffi_call(
        "hmoe_bf16_gemm",
        jax.ShapeDtypeStruct((*x.shape[:-1], n), jnp.float32),
        vmap_method="expand_dims",
    )
    return call(x, w, max_isa=np.int64(max_isa), num_threads=np.int64(num_threads))


def fp8_head_matmul(x: Any, w: Fp8Tensor, *, max_isa: int = -1, num_threads: int = 0) -> jax.Array:
    """H independent FP8 GEMVs: y[..., h, n] = sum_k bf16(x)[..., h, k] * dequant(w[h])[n, k],
    f32 (MLA's absorbed W_uk^T q and W_uv o per head). x [..., H, K], w Fp8Tensor
    [H, N, K] with scale_inv [H, ceil(N/bn), ceil(K/bk)]. Numerics of fp8_matmul, per head."""
    op = "fp8_head_matmul"
    _check_fp8(w, op, "[H, N, K]")
    h, n, k = w.w.shape
    _check_x(op, x, k)
    if x.ndim < 2 or x.shape[-2] != h:
        raise ValueError(f"{op}: x shape {tuple(x.shape)} must end in [H, K]=[{h}, {k}] (the weight's heads)")
    return _fp8_call("hmoe_fp8_bmv", x, w, n, max_isa, num_threads)


def _bf16_round(x: Any) -> jax.Array:
    return jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32)


def fp8_matmul_ref(x: Any, w: Fp8Tensor) -> jax.Array:
    """Reference: dequantize in f32, round x to bf16, f32 dot at full precision."""
    wf = dequantize(w, jnp.float32)  # [N, K]
    return jnp.einsum("...k,nk->...n", _bf16_round(x), wf, precision=jax.lax.Precision.HIGHEST)


def int4_matmul_ref(x: Any, w: Int4Tensor) -> jax.Array:
    wf = dequantize_int4(w, jnp.float32)  # [N, K]
    return jnp.einsum("...k,nk->...n", _bf16_round(x), wf, precision=jax.lax.Precision.HIGHEST)


def bf16_matmul_ref(x: Any, w: Any) -> jax.Array:
    """Reference: round x to bf16, f32 dot at full precision (bf16 -> f32 is exact)."""
    wf = jnp.asarray(w).astype(jnp.float32)  # [N, K]
    return jnp.einsum("...k,nk->...n", _bf16_round(x), wf, precision=jax.lax.Precision.HIGHEST)


def fp8_head_matmul_ref(x: Any, w: Fp8Tensor) -> jax.Array:
    """Reference: dequantize every head in f32, round x to bf16, per-head f32 dot."""
    wf = dequantize(w, jnp.float32)  # [H, N, K]
    return jnp.einsum("...hk,hnk->...hn", _bf16_round(x), wf, precision=jax.lax.Precision.HIGHEST)


def read_bytes(buf: Any, *, num_threads: int = 0, max_isa: int = -1) -> jax.Array:
    """Read every byte of `buf` (sum of its 64-bit words mod 2^64 as uint32 [2]: low, high
    words); time it for the
    memory read bandwidth through the same FFI path and thread pool as the kernels."""
    register_all()
    call = jax.ffi.ffi_call("hmoe_read_bytes", jax.ShapeDtypeStruct((2,), jnp.uint32))
    return call(buf, max_isa=np.int64(max_isa), num_threads=np.int64(num_threads))
