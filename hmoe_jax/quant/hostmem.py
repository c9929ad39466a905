"""Host buffers for weights: 64-byte aligned, because jax.device_put(numpy) on the CPU
backend aliases a buffer (zero-copy) only at that alignment (numpy's default is 16;
shared/NOTES.md), and the FFI kernels read weights with aligned vector loads. In the
lowest layer every user may import (io, kernels, runtime, experiments); numpy only."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

ALIGN_BYTES = 64


def aligned_empty(shape: tuple[int, ...], dtype: Any, align: int = ALIGN_BYTES) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an `align`-byte boundary."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    off = -raw.ctypes.data % align
    return raw[off : off + nbytes].view(dtype).reshape(shape)


def is_aligned(a: np.ndarray, align: int = ALIGN_BYTES) -> bool:
    """True if `a` is C-contiguous and starts on an `align`-byte boundary (zero-copy ready)."""
    return a.ctypes.data % align == 0 and a.flags.c_contiguous
