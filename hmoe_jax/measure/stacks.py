"""Random real-shape expert weight stacks for kernel measurements: page-aligned host arrays
handed to jax zero-copy (as the engine holds its experts), FP8 with 128 x 128 block scales
or INT4 with per-group scales."""

from __future__ import annotations

import numpy as np


def fp8_stack(rng, e: int, n: int, k: int):
    import ml_dtypes

    from hmoe_jax.kernels.gemm import device_put_zero_copy
    from hmoe_jax.quant.fp8 import Fp8Tensor
    from hmoe_jax.quant.hostmem import aligned_empty

    w = aligned_empty((e, n, k), np.uint8)
    w.reshape(-1)[:] = np.frombuffer(rng.bytes(w.size), np.uint8)
    w[(w & 0x7F) == 0x7F] = 0  # no NaN codes
    s = aligned_empty((e, -(-n // 128), -(-k // 128)), np.float32)  # 128 x 128 blocks, edges partial
    s[...] = 1e-3
    return Fp8Tensor(
        w=device_put_zero_copy(w.view(ml_dtypes.float8_e4m3fn)), scale_inv=device_put_zero_copy(s)
    )


def int4_stack(rng, e: int, n: int, k: int, group: int = 64):
    import ml_dtypes

    from hmoe_jax.kernels.gemm import device_put_zero_copy
    from hmoe_jax.quant.hostmem import aligned_empty
    from hmoe_jax.quant.int4 import Int4Tensor

    q = aligned_empty((e, n, k // 2), np.uint8)
    q.reshape(-1)[:] = np.frombuffer(rng.bytes(q.size), np.uint8)
    s = aligned_empty((e, n, k // group), ml_dtypes.bfloat16)
    s[...] = 1e-2
    return Int4Tensor(q=device_put_zero_copy(q), scale=device_put_zero_copy(s), group=group)
