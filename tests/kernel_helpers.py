"""Helpers shared by the GEMM kernel tests (test_kernels_gemm.py, test_kernels_bf16.py).

Importing this module skips the importing test module when the _hmoe_ffi extension is not
built.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hmoe_jax.kernels import ffi

try:
    ffi.extension()
except ffi.FfiUnavailable:  # pragma: no cover - the CI builds the extension
    pytest.skip("the _hmoe_ffi extension is not built", allow_module_level=True)

from hmoe_jax.kernels import gemm  # noqa: E402
from hmoe_jax.quant.fp8 import Fp8Tensor, quantize_np  # noqa: E402

FEATURES = ffi.cpu_features()
ISAS = [gemm.ISA_PORTABLE]
if FEATURES["avx2"]:
    ISAS.append(gemm.ISA_AVX2)
if FEATURES["avx512"]:
    ISAS.append(gemm.ISA_AVX512)
ISA_IDS = {gemm.ISA_PORTABLE: "portable", gemm.ISA_AVX2: "avx2", gemm.ISA_AVX512: "avx512"}


def err_bound(x: np.ndarray, wf: np.ndarray) -> np.ndarray:
    """gamma_K bound for x [M, K] against W [N, K] (f32 values): 2 * K * 2^-24 * (|x_bf16| @ |W|^T)."""
    xb = np.abs(x.astype(ml_dtypes.bfloat16).astype(np.float32))
    return 2.0 * wf.shape[-1] * 2.0**-24 * (xb @ np.abs(wf).T) + 1e-30


def fp8_weight(rng: np.random.Generator, *shape: int) -> Fp8Tensor:
    """A random block-FP8 weight [..., N, K] (e.g. [N, K] or [H, N, K]) whose 128 x 128 blocks
    (per leading index) have magnitudes that differ by orders, so a scale applied to the wrong
    block, or a wrong head offset, fails."""
    *lead, n, k = shape
    block_mag = np.exp(rng.uniform(-4, 4, size=(*lead, -(-n // 128), -(-k // 128))))
    wf = rng.standard_normal(shape) * np.repeat(np.repeat(block_mag, 128, -2), 128, -1)[..., :n, :k]
    return quantize_np(wf.astype(np.float32))


def raw_call(target: str, out_shape, *args, **attrs):
    """The FFI target called directly (bypassing the Python wrapper's checks), f32 result."""
    ffi.register_all()
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, jnp.float32))
    return np.asarray(call(*args, **{k: np.int64(v) for k, v in attrs.items()}))
