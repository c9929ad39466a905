"""safetensors files, read as zero-copy memmap views and written as a stream.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
N bytes of JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {..}},
then the data buffer; offsets are relative to the buffer, which has no holes. We parse the
header ourselves so that every tensor is a view into ONE read-only np.memmap of the file
(no bytes are read until a kernel touches them) and so that every defect (bad length, bad
JSON, truncated data, unknown dtype) is reported with the file and tensor name.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

import ml_dtypes
import numpy as np

from hmoe_jax.io.errors import CheckpointError

# safetensors dtype tag <-> numpy dtype (ml_dtypes supplies bf16 and the FP8 formats).
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_TAGS = {v: k for k, v in DTYPES.items()}

# Header length cap: safetensors itself refuses headers over 100 MB; a larger value means
# a corrupt or foreign file, and we must not try to allocate it.
MAX_HEADER_BYTES = 100_000_000
# Data start is padded to this (with spaces in the JSON, as the format allows) so views
# of our own files are 64-byte aligned, the alignment jax.device_put needs for zero-copy.
DATA_ALIGN_BYTES = 64


def dtype_tag(dtype: Any) -> str:
    dt = np.dtype(dtype)
    if dt not in _TAGS:
        raise CheckpointError(f"dtype {dt} has no safetensors tag (supported: {sorted(DTYPES)})")
    return _TAGS[dt]


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors tag, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data buffer
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """One parsed safetensors file. `tensor(name)` is a read-only view into a memmap."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.tensors, self.metadata, self.data_start = _parse_header(self.path)
        self._mm: np.memmap | None = None

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def _map(self) -> np.memmap:
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm

    def tensor(self, name: str) -> np.ndarray:
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path}: no tensor {name!r}")
        raw = self._map()[self.data_start + info.begin : self.data_start + info.end]
        return raw.view(DTYPES[info.dtype]).reshape(info.shape)


def _parse_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{path}: file is {size} bytes, too short for a safetensors header (8-byte length)"
                )
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{path}: header length {n} bytes does not fit (file is {size} bytes, limit {MAX_HEADER_BYTES}); not a safetensors file or corrupt"
                )
            text = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: safetensors file not found") from None
    try:
        raw = json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: header is a JSON {type(raw).__name__}, expected an object")
    meta = raw.pop("__metadata__", None) or {}
    data_start = 8 + n
    data_bytes = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in raw.items():
        tensors[name] = _parse_entry(path, name, entry, data_bytes)
    return tensors, meta, data_start


def _parse_entry(path: Path, name: str, entry: Any, data_bytes: int) -> TensorInfo:
    try:
        tag, shape, (begin, end) = (
            entry["dtype"],
            tuple(int(s) for s in entry["shape"]),
            entry["data_offsets"],
        )
        begin, end = int(begin), int(end)
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"{path}: header entry for {name!r} is malformed: {entry!r}") from None
    if tag not in DTYPES:
        raise CheckpointError(
            f"{path}: tensor {name!r} has unsupported dtype {tag!r} (supported: {sorted(DTYPES)})"
        )
    want = math.prod(shape) * DTYPES[tag].itemsize
    if end - begin != want or begin < 0:
        raise CheckpointError(
            f"{path}: tensor {name!r} {tag}{list(shape)} needs {want} bytes but data_offsets {[begin, end]} span {end - begin}"
        )
    if end > data_bytes:
        raise CheckpointError(
            f"{path}: tensor {name!r} ends at data byte {end} but the file holds only {data_bytes} data bytes (truncated)"
        )
    return TensorInfo(name, tag, shape, begin, end)


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    """A tensor to be written: its layout is known before its values (for streaming)."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    produce: Callable[[], Any]  # -> array of exactly dtype/shape, called once, in order

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


def _header_bytes(plan: list[PlannedTensor], metadata: dict[str, str]) -> bytes:
    hdr: dict[str, Any] = {"__metadata__": dict(metadata)}
    off = 0
    for t in plan:
        hdr[t.name] = {
            "dtype": dtype_tag(t.dtype),
            "shape": list(t.shape),
            "data_offsets": [off, off + t.nbytes],
        }
        off += t.nbytes
    text = json.dumps(hdr, separators=(",", ":")).encode()
    pad = -(8 + len(text)) % DATA_ALIGN_BYTES
    return struct.pack("<Q", len(text) + pad) + text + b" " * pad


def _write_array(f: BinaryIO, a: np.ndarray) -> None:
    # A uint8 view writes ml_dtypes arrays too (their buffer format is not a struct code).
    f.write(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))


def write_file(
    path: str | os.PathLike,
    plan: Iterable[PlannedTensor],
    metadata: dict[str, str] | None = None,
    on_tensor: Callable[[PlannedTensor], None] | None = None,
) -> int:
    """Write one safetensors file, producing each tensor only when its turn comes (so a
    converter holds one tensor at a time). Returns the bytes written."""
    plan = list(plan)
    path = Path(path)
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "wb") as f:
        f.write(_header_bytes(plan, metadata or {"format": "pt"}))
        for t in plan:
            a = np.asarray(t.produce())
            if a.dtype != t.dtype or tuple(a.shape) != t.shape:
                raise CheckpointError(
                    f"{path}: tensor {t.name!r} was planned as {dtype_tag(t.dtype)}{list(t.shape)} but produced {a.dtype}{list(a.shape)}"
                )
            _write_array(f, a)
            if on_tensor is not None:
                on_tensor(t)
    os.replace(tmp, path)  # a reader never sees a half-written file under the real name
    return path.stat().st_size


def save_arrays(
    path: str | os.PathLike, arrays: dict[str, Any], metadata: dict[str, str] | None = None
) -> int:
    """Write a name -> array dict (small files, tests)."""
    plan = []
    for name, a in arrays.items():
        a = np.asarray(a)
        plan.append(PlannedTensor(name, a.dtype, tuple(a.shape), lambda a=a: a))
    return write_file(path, plan, metadata)
