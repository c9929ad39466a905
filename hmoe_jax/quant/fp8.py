"""DeepSeek block-FP8: float8_e4m3fn weights [.., N, K] and one float32 scale per
block_n x block_k block ([.., ceil(N/bn), ceil(K/bk)]), MULTIPLIED to dequantize
(`weight_scale_inv` in the release: it is the inverse of the quantisation scale).
Edge blocks may be partial (e.g. kv_a_proj_with_mqa is [576, 7168]: 4.5 row blocks).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct

FP8_DTYPE = np.dtype(ml_dtypes.float8_e4m3fn)
FP8_MAX = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)  # 448


@struct.dataclass
class Fp8Tensor:
    w: Any  # float8_e4m3fn [..., N, K]
    scale_inv: Any  # float32 [..., ceil(N/block_n), ceil(K/block_k)]
    block_n: int = struct.field(pytree_node=False, default=128)
    block_k: int = struct.field(pytree_node=False, default=128)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.w.shape)

    @property
    def ndim(self) -> int:
        return len(self.w.shape)


def scale_grid_shape(shape: tuple[int, ...], block_n: int = 128, block_k: int = 128) -> tuple[int, ...]:
    *lead, n, k = shape
    return (*lead, -(-n // block_n), -(-k // block_k))


def _expand_scale(scale: Any, n: int, k: int, bn: int, bk: int, xp: Any) -> Any:
    s = xp.repeat(xp.repeat(scale, bn, axis=-2), bk, axis=-1)
    return s[..., :n, :k]


def dequantize_np(t: Fp8Tensor, dtype: Any = np.float32) -> np.ndarray:
    """Reference dequantization in numpy: f32(w) * scale, block-expanded."""
    w = np.asarray(t.w)
    n, k = w.shape[-2:]
    s = _expand_scale(np.asarray(t.scale_inv, np.float32), n, k, t.block_n, t.block_k, np)
    return (w.astype(np.float32) * s).astype(dtype)


def dequantize(t: Fp8Tensor, dtype: Any = jnp.float32) -> Any:
    """Same as dequantize_np in jnp (traceable)."""
    n, k = t.w.shape[-2:]
    s = _expand_scale(jnp.asarray(t.scale_inv, jnp.float32), n, k, t.block_n, t.block_k, jnp)
    return (jnp.asarray(t.w).astype(jnp.float32) * s).astype(dtype)


def quantize_np(w: np.ndarray, block_n: int = 128, block_k: int = 128) -> Fp8Tensor:
    """Quantize [.., N, K] to block FP8 the way DeepSeek's release does: per block,
    scale_inv = amax / 448, w_fp8 = round_to_nearest_even(w / scale_inv).
    An all-zero block gets scale_inv = 1 (avoids 0/0; dequantizes to exact zeros)."""
    w = np.asarray(w, np.float32)
    *lead, n, k = w.shape
    nb, kb = -(-n // block_n), -(-k // block_k)
    pad = [(0, 0)] * len(lead) + [(0, nb * block_n - n), (0, kb * block_k - k)]
    wp = np.pad(w, pad)
    blocks = wp.reshape(*lead, nb, block_n, kb, block_k)
    amax = np.abs(blocks).max(axis=(-3, -1))  # [.., nb, kb]
    scale = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    s = _expand_scale(scale, n, k, block_n, block_k, np)
    q = np.clip(w / s, -FP8_MAX, FP8_MAX).astype(FP8_DTYPE)
    return Fp8Tensor(w=q, scale_inv=scale, block_n=block_n, block_k=block_k)
