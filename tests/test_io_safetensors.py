"""Our safetensors reader/writer against the `safetensors` library (the reference), and
every kind of corrupt file, each with the one-line message it must produce."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hmoe_jax.io.errors import CheckpointError
from hmoe_jax.io.safetensors_io import DATA_ALIGN_BYTES, SafetensorsFile, save_arrays


def _arrays():
    r = np.random.default_rng(0)
    return {
        "a.f32": r.standard_normal((3, 5)).astype(np.float32),
        "b.bf16": r.standard_normal((7,)).astype(ml_dtypes.bfloat16),
        "c.f16": r.standard_normal((2, 2, 3)).astype(np.float16),
        "d.fp8": r.uniform(-400, 400, (4, 9)).astype(ml_dtypes.float8_e4m3fn),
        "e.i64": np.arange(5, dtype=np.int64),
        "f.empty": np.zeros((0, 4), np.float32),
    }


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8)


def test_ours_read_by_library(tmp_path):
    arrays = _arrays()
    path = tmp_path / "ours.safetensors"
    save_arrays(path, arrays)
    ref = load_file(str(path))  # torch tensors
    assert sorted(ref) == sorted(arrays)
    for name, a in arrays.items():
        t = ref[name]
        assert tuple(t.shape) == a.shape
        # Compare raw bytes: torch and ml_dtypes share bf16/fp8 bit layouts.
        got = t.contiguous().view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
        assert np.array_equal(got.reshape(-1), _bits(a).reshape(-1)), name
    # The data buffer starts 64-byte aligned (padding in the header, as the format allows).
    assert SafetensorsFile(path).data_start % DATA_ALIGN_BYTES == 0


def test_library_read_by_ours(tmp_path):
    arrays = _arrays()
    tensors = {}
    for k, a in arrays.items():
        if a.dtype == ml_dtypes.bfloat16:
            tensors[k] = torch.from_numpy(a.view(np.uint16).copy()).view(torch.bfloat16)
        elif a.dtype == ml_dtypes.float8_e4m3fn:
            tensors[k] = torch.from_numpy(a.view(np.uint8).copy()).view(torch.float8_e4m3fn)
        else:
            tensors[k] = torch.from_numpy(a.copy())
    path = tmp_path / "lib.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    f = SafetensorsFile(path)
    assert f.metadata == {"format": "pt"}
    for name, a in arrays.items():
        v = f.tensor(name)
        assert v.dtype == a.dtype and v.shape == a.shape
        assert np.array_equal(_bits(v), _bits(a)), name
        assert isinstance(v.base, np.ndarray) or isinstance(v, np.memmap)


def test_views_are_memmapped_and_read_only(tmp_path):
    path = tmp_path / "m.safetensors"
    save_arrays(path, {"w": np.ones((64, 64), np.float32)})
    v = SafetensorsFile(path).tensor("w")
    assert isinstance(v, np.memmap) and not v.flags.writeable
    assert v.ctypes.data % 64 == 0


def _file(tmp_path, header: bytes, data: bytes = b"", length: int | None = None):
    path = tmp_path / "bad.safetensors"
    n = len(header) if length is None else length
    path.write_bytes(struct.pack("<Q", n) + header + data)
    return path


def _header(**entries) -> bytes:
    return json.dumps(entries).encode()


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: (p / "bad.safetensors").write_bytes(b"\x01\x02"), r"too short for a safetensors header"),
        (lambda p: _file(p, b"{}", length=10**12), r"header length 1000000000000 bytes does not fit"),
        (lambda p: _file(p, b"{not json"), r"header is not valid JSON"),
        (lambda p: _file(p, b"[1, 2]"), r"header is a JSON list, expected an object"),
        (
            lambda p: _file(p, _header(w={"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}), b"\0" * 8),
            r"tensor 'w' ends at data byte 16 but the file holds only 8 data bytes \(truncated\)",
        ),
        (
            lambda p: _file(
                p, _header(w={"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}), b"\0" * 16
            ),
            r"tensor 'w' F32\[4\] needs 16 bytes but data_offsets \[0, 12\] span 12",
        ),
        (
            lambda p: _file(p, _header(w={"dtype": "Q4", "shape": [4], "data_offsets": [0, 2]}), b"\0" * 2),
            r"tensor 'w' has unsupported dtype 'Q4'",
        ),
        (lambda p: _file(p, _header(w={"dtype": "F32"})), r"header entry for 'w' is malformed"),
    ],
    ids=["short", "huge-length", "bad-json", "not-object", "truncated", "offsets", "dtype", "malformed"],
)
def test_corrupt_files(tmp_path, make, message):
    make(tmp_path)
    with pytest.raises(CheckpointError, match=message) as e:
        SafetensorsFile(tmp_path / "bad.safetensors")
    assert "bad.safetensors" in str(e.value) and "\n" not in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match=r"nope.safetensors: safetensors file not found"):
        SafetensorsFile(tmp_path / "nope.safetensors")
