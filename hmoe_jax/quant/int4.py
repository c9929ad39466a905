"""Group-quantized symmetric INT4 weights (the paper's INT4 configuration), and their cache.

Format (`Int4Tensor`, logical weight [.., N, K]):
- q: uint8 [.., N, K/2], two's-complement int4 values in [-7, 7] packed two per byte.
  Nibble order per 64-element chunk c of a row (32 bytes): byte 32c + j holds element
  64c + j in its LOW nibble and element 64c + 32 + j in its HIGH nibble (j in [0, 32)).
  (Not the adjacent-pair order of jnp.int4: this order lets the SIMD decode produce the
  elements in natural order with one zero-extension and two shifts/masks.)
- scale: bfloat16 [.., N, K/group], MULTIPLIED: w = q * scale, scale = amax / 7 per group
  (all-zero group: scale 1, q 0).
- group: 64 by default (a multiple of 64 that divides K).
Bytes per weight: 0.5 + 2 / group = 0.531 at group 64, i.e. 0.53 of FP8's ~1.0001.

bf16 scales rather than f16: no range problem for tiny or huge groups, and the 2^-9
relative rounding of the scale is far below the int4 step (1/7 of amax).
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import struct

from hmoe_jax.quant.fp8 import Fp8Tensor, dequantize_np

BF16_DTYPE = np.dtype(ml_dtypes.bfloat16)
INT4_QMAX = 7  # symmetric: [-7, 7]; -8 is valid in the format but never produced
CHUNK = 64  # nibble-order chunk (elements)


@struct.dataclass
class Int4Tensor:
    q: Any  # uint8 [..., N, K/2]
    scale: Any  # bfloat16 [..., N, K/group]
    group: int = struct.field(pytree_node=False, default=64)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n, half_k = self.q.shape
        return (*lead, n, 2 * half_k)

    @property
    def ndim(self) -> int:
        return len(self.q.shape)


def int4_bytes_per_weight(group: int) -> float:
    return 0.5 + BF16_DTYPE.itemsize / group


def _check_group(k: int, group: int) -> None:
    if group <= 0 or group % CHUNK != 0:
        raise ValueError(f"int4 group must be a positive multiple of {CHUNK}, got {group}")
    if k % group != 0:
        raise ValueError(f"int4 weight: K={k} must be a multiple of group={group}")


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """int values in [-8, 7], [.., K] (K % 64 == 0) -> uint8 [.., K/2] in the chunk order."""
    q = np.asarray(q)
    *lead, k = q.shape
    if k % CHUNK != 0:
        raise ValueError(f"pack_nibbles: K={k} must be a multiple of {CHUNK}")
    u = (q.astype(np.int16) & 0xF).astype(np.uint8).reshape(*lead, k // CHUNK, 2, CHUNK // 2)
    return (u[..., 0, :] | (u[..., 1, :] << 4)).reshape(*lead, k // 2)


def unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """Inverse of pack_nibbles: uint8 [.., K/2] -> int8 [.., K]."""
    p = np.asarray(packed, np.uint8)
    *lead, half_k = p.shape
    c = p.reshape(*lead, half_k // (CHUNK // 2), CHUNK // 2)
    lo = (c & 0xF).astype(np.int8)
    hi = (c >> 4).astype(np.int8)
    vals = np.stack([lo, hi], axis=-2)  # [.., chunks, 2, 32]
    vals = np.where(vals >= 8, vals - 16, vals).astype(np.int8)
    return vals.reshape(*lead, 2 * half_k)


def _as_f32(w: Any) -> np.ndarray:
    if isinstance(w, Fp8Tensor):
        return dequantize_np(w)
    return np.asarray(w).astype(np.float32)


def quantize_int4_np(w: Any, group: int = 64) -> Int4Tensor:
    """f32 / bf16 array or Fp8Tensor [.., N, K] -> Int4Tensor (round to nearest even)."""
    wf = _as_f32(w)
    *lead, n, k = wf.shape
    _check_group(k, group)
    g = wf.reshape(*lead, n, k // group, group)
    amax = np.abs(g).max(axis=-1)  # [.., N, K/group]
    scale = np.where(amax > 0, amax / INT4_QMAX, 1.0).astype(BF16_DTYPE)
    # divide by the bf16-rounded scale actually stored, so q * scale is the best grid point
    s32 = scale.astype(np.float32)[..., None]
    q = np.clip(np.rint(g / s32), -INT4_QMAX, INT4_QMAX).astype(np.int8).reshape(*lead, n, k)
    return Int4Tensor(q=pack_nibbles(q), scale=scale, group=group)


def dequantize_int4_np(t: Int4Tensor, dtype: Any = np.float32) -> np.ndarray:
    """Reference dequantization in numpy: q * scale, group-expanded."""
    q = unpack_nibbles(np.asarray(t.q)).astype(np.float32)
    s = np.repeat(np.asarray(t.scale).astype(np.float32), t.group, axis=-1)
    return (q * s).astype(dtype)


def dequantize_int4(t: Int4Tensor, dtype: Any = jnp.float32) -> Any:
    """Same as dequantize_int4_np in jnp (traceable)."""
    p = jnp.asarray(t.q)
    *lead, half_k = p.shape
    c = p.reshape(*lead, half_k // (CHUNK // 2), CHUNK // 2)
    vals = jnp.stack([c & 0xF, c >> 4], axis=-2).astype(jnp.int32)
    vals = jnp.where(vals >= 8, vals - 16, vals).reshape(*lead, 2 * half_k)
    s = jnp.repeat(jnp.asarray(t.scale).astype(jnp.float32), t.group, axis=-1)
    return (vals.astype(jnp.float32) * s).astype(dtype)


# ---- conversion cache (orbax-checkpoint): convert once, then restore ----


def _source_digest(w: Any) -> str:
    """Cheap fingerprint of the source weight: shape, dtype and a strided sample of bytes,
    so a cache entry made from a different tensor under the same name is not reused."""
    parts = [w.w, w.scale_inv] if isinstance(w, Fp8Tensor) else [w]
    h = hashlib.sha256()
    for a in parts:
        a = np.asarray(a)
        h.update(f"{a.shape}{a.dtype}".encode())
        flat = a.reshape(-1).view(np.uint8)
        step = max(1, flat.size // 65536)
        h.update(np.ascontiguousarray(flat[::step]).tobytes())
    return h.hexdigest()[:16]


def cached_quantize_int4(w: Any, cache_dir: str | os.PathLike, name: str, group: int = 64) -> Int4Tensor:
    """quantize_int4_np(w, group), stored under cache_dir/name with orbax-checkpoint; a later
    call with the same source tensor restores it instead of converting again."""
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        raise ImportError(
            "cached_quantize_int4 needs orbax-checkpoint: pip install 'hmoe-jax[int4cache]'"
        ) from None

    path = os.path.abspath(os.path.join(os.fspath(cache_dir), name))
    digest = _source_digest(w)
    ckpt = ocp.StandardCheckpointer()
    if os.path.isdir(path):
        meta_path = os.path.join(path, "hmoe_int4_meta.txt")
        meta = open(meta_path).read().split() if os.path.exists(meta_path) else []
        if meta == [digest, str(group)]:
            tree = ckpt.restore(os.path.join(path, "tree"))
            return Int4Tensor(
                q=np.asarray(tree["q"], np.uint8),
                scale=np.asarray(tree["scale"]).astype(BF16_DTYPE),
                group=group,
            )
        raise ValueError(
            f"int4 cache {path}: made from a different source tensor or group "
            f"(cached {meta}, now {[digest, str(group)]}); delete it or use another name"
        )
    t = quantize_int4_np(w, group)
    os.makedirs(path)
    ckpt.save(os.path.join(path, "tree"), {"q": np.asarray(t.q), "scale": np.asarray(t.scale)})
    ckpt.wait_until_finished()
    with open(os.path.join(path, "hmoe_int4_meta.txt"), "w") as f:
        f.write(f"{digest} {group}\n")
    return t
