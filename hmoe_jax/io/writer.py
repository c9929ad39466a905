"""Write checkpoints in HF / DeepSeek layout: config.json + safetensors (optionally sharded
with model.safetensors.index.json), DeepSeek tensor names, and DeepSeek's FP8 release
format (e4m3 `X.weight` + float32 `X.weight_scale_inv` per 128x128 block) for every tensor
the release stores quantized; embed, lm_head, norms and the router stay high precision.

Tensors are produced one at a time while the file is written (the header is computed
from shapes first), so `convert_checkpoint` holds one tensor in memory at a time.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from tqdm import tqdm

from hmoe_jax.config import ModelConfig, QuantConfig, load_config
from hmoe_jax.io.errors import CheckpointError
from hmoe_jax.io.format import (
    CONFIG_NAME,
    FP8_TAG,
    INDEX_NAME,
    SCALE_SUFFIX,
    SINGLE_NAME,
    open_catalog,
    validate,
)
from hmoe_jax.io.names import expected_tensors, flatten_params
from hmoe_jax.io.safetensors_io import DTYPES, PlannedTensor, write_file
from hmoe_jax.model.params import ModelParams
from hmoe_jax.quant.fp8 import FP8_DTYPE, Fp8Tensor, dequantize_np, quantize_np, scale_grid_shape
from hmoe_jax.quant.hostmem import ALIGN_BYTES

# Files besides weights that travel with a checkpoint on convert.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")
FORMATS = {"fp8": None, "bf16": np.dtype(ml_dtypes.bfloat16), "f32": np.dtype(np.float32)}
DEFAULT_CONVERT_SHARD_BYTES = 5_000_000_000  # HF's default max_shard_size


@dataclasses.dataclass(frozen=True)
class _Source:
    """One logical tensor to write: a thunk returning an array or an Fp8Tensor."""

    name: str
    shape: tuple[int, ...]
    quantized: bool  # stored FP8 in DeepSeek's release
    dtype: np.dtype  # stored dtype of the source (FP8_DTYPE for Fp8Tensor)
    load: Callable[[], Any]


class _QuantizeOnce:
    """One FP8 weight quantized on first use; the weight and its scale are separate planned
    tensors that may be written in either order, and the pair is dropped once both are."""

    def __init__(self, src: _Source, quant: QuantConfig):
        self.src, self.quant, self.t, self.left = src, quant, None, 2

    def take(self, part: str) -> np.ndarray:
        if self.t is None:
            t = self.src.load()
            q = self.quant
            if not isinstance(t, Fp8Tensor):
                t = quantize_np(np.asarray(t, np.float32), q.block_n, q.block_k)
            elif (t.block_n, t.block_k) != (q.block_n, q.block_k):
                raise CheckpointError(
                    f"{self.src.name}: FP8 blocks {t.block_n}x{t.block_k}, writer uses {q.block_n}x{q.block_k}"
                )
            self.t = t
        out = np.asarray(self.t.w) if part == "w" else np.asarray(self.t.scale_inv, np.float32)
        self.left -= 1
        if not self.left:
            self.t = None
        return out


def _plan(sources: list[_Source], fmt: str, quant: QuantConfig) -> list[PlannedTensor]:
    """Tensors as written; an FP8 weight is followed by its scale grid."""
    out: list[PlannedTensor] = []
    for src in sources:
        if fmt == "fp8" and src.quantized:
            once = _QuantizeOnce(src, quant)
            grid = scale_grid_shape(src.shape, quant.block_n, quant.block_k)
            out.append(PlannedTensor(src.name, FP8_DTYPE, src.shape, lambda o=once: o.take("w")))
            out.append(
                PlannedTensor(src.name + SCALE_SUFFIX, np.dtype(np.float32), grid, lambda o=once: o.take("s"))
            )
            continue
        target = _target_dtype(src, fmt)

        def produce(src=src, target=target) -> np.ndarray:
            t = src.load()
            a = dequantize_np(t) if isinstance(t, Fp8Tensor) else np.asarray(t)
            return a.astype(target, copy=False)

        out.append(PlannedTensor(src.name, target, src.shape, produce))
    return out


def _target_dtype(src: _Source, fmt: str) -> np.dtype:
    """High-precision dtype of a tensor written as-is: 'fp8'/'keep' keep the source dtype,
    'bf16'/'f32' cast; FP8 sources there are dequantized (to f32 unless told otherwise).
    The routing bias stays f32 as in DeepSeek's release: it decides expert selection, and
    bf16 rounding of it flips near-tied choices."""
    if src.name.endswith("e_score_correction_bias"):
        return np.dtype(np.float32)
    if fmt in ("fp8", "keep"):
        return np.dtype(np.float32) if src.dtype == FP8_DTYPE else src.dtype
    return FORMATS[fmt]


def _shards(plan: list[PlannedTensor], shard_bytes: int | None) -> list[list[PlannedTensor]]:
    if not shard_bytes:
        return [plan]
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in plan:
        # Keep a weight and its scale in one shard, as DeepSeek's release does (a reader
        # resolves them by name anyway; this bounds how long a quantized pair is held).
        joined = t.name.endswith(SCALE_SUFFIX)
        if shards[-1] and not joined and size + t.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _write(
    out_dir: Path,
    cfg: ModelConfig,
    plan: list[PlannedTensor],
    shard_bytes: int | None,
    progress: bool,
    torch_dtype: str,
) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    shards = _shards(plan, shard_bytes)
    total = sum(t.nbytes for t in plan)
    weight_map: dict[str, str] = {}
    with tqdm(
        total=total,
        desc="writing",
        unit="B",
        unit_scale=True,
        file=sys.stderr,
        disable=None if progress else True,
        leave=False,
    ) as bar:
        for i, shard in enumerate(shards):
            # Tensors whose size is a multiple of 64 bytes first: the data buffer starts
            # 64-byte aligned, so each of them is too, and jax.device_put of its memmap view
            # is then zero-copy (the file's page cache stays the only copy). Stable: the
            # rest keep their order at the end.
            shard = sorted(shard, key=lambda t: t.nbytes % ALIGN_BYTES != 0)
            fname = SINGLE_NAME if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_file(out_dir / fname, shard, {"format": "pt"}, on_tensor=lambda t: bar.update(t.nbytes))
            weight_map.update({t.name: fname for t in shard})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2))
    elif (out_dir / INDEX_NAME).exists():
        (out_dir / INDEX_NAME).unlink()  # a stale index would shadow the single file
    d = cfg.to_hf_dict()
    d["torch_dtype"] = torch_dtype
    (out_dir / CONFIG_NAME).write_text(json.dumps(d, indent=2))


def _dominant_dtype(plan: list[PlannedTensor]) -> str:
    hp = [t for t in plan if t.dtype != FP8_DTYPE and not t.name.endswith(SCALE_SUFFIX)]
    dt = max(hp, key=lambda t: t.nbytes).dtype if hp else np.dtype(np.float32)
    return {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16"}.get(dt, "bfloat16")


def save_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    params: ModelParams,
    *,
    fp8: bool = False,
    shard_bytes: int | None = None,
    progress: bool = False,
) -> None:
    """Write params under DeepSeek's names. fp8=True quantizes every tensor the release
    stores quantized (already-FP8 leaves are written as they are) and sets config
    quantization_config; fp8=False writes leaves in their dtype, FP8 ones dequantized to f32."""
    named = flatten_params(cfg, params)
    quant = cfg.quant or QuantConfig()
    sources = []
    for s in expected_tensors(cfg):
        x = named[s.name]
        dt = FP8_DTYPE if isinstance(x, Fp8Tensor) else np.dtype(x.dtype)
        sources.append(_Source(s.name, s.shape, s.quantized, dt, lambda x=x: x))
    out_cfg = dataclasses.replace(cfg, quant=quant if fp8 else None)
    plan = _plan(sources, "fp8" if fp8 else "keep", quant)
    _write(Path(out_dir), out_cfg, plan, shard_bytes, progress, _dominant_dtype(plan))


def convert_checkpoint(
    in_dir: str | Path,
    out_dir: str | Path,
    *,
    fmt: str = "fp8",
    shard_bytes: int | None = DEFAULT_CONVERT_SHARD_BYTES,
    progress: bool = True,
) -> None:
    """Stream a checkpoint into another format: 'fp8' (DeepSeek block FP8), 'bf16' or
    'f32' (FP8 tensors dequantized). Reads one tensor at a time from the memory map."""
    if fmt not in FORMATS:
        raise CheckpointError(f"unknown format {fmt!r} (expected one of {sorted(FORMATS)})")
    in_dir, out_dir = Path(in_dir), Path(out_dir)
    if not in_dir.is_dir():
        raise CheckpointError(f"{in_dir}: checkpoint directory not found")
    if out_dir.resolve() == in_dir.resolve():
        raise CheckpointError(f"{out_dir}: output directory must differ from the input")
    cfg = load_config(in_dir / CONFIG_NAME)
    cat = open_catalog(in_dir)
    specs = validate(cfg, cat)
    if cat.unused:
        print(
            f"note: not converting {len(cat.unused)} unused tensor(s) (MTP layers, rotary caches)",
            file=sys.stderr,
        )
    quant = cfg.quant or QuantConfig()

    def loader(name: str) -> Callable[[], Any]:
        def load() -> Any:
            v = cat.view(name)
            if cat.info(name).dtype == FP8_TAG:
                return Fp8Tensor(
                    w=v, scale_inv=cat.view(name + SCALE_SUFFIX), block_n=quant.block_n, block_k=quant.block_k
                )
            return v

        return load

    sources = [
        _Source(s.name, s.shape, s.quantized, DTYPES[cat.info(s.name).dtype], loader(s.name)) for s in specs
    ]
    plan = _plan(sources, fmt, quant)
    out_cfg = dataclasses.replace(cfg, quant=quant if fmt == "fp8" else None)
    _write(out_dir, out_cfg, plan, shard_bytes, progress, _dominant_dtype(plan))
    for f in SIDE_FILES:
        if (in_dir / f).exists():
            shutil.copy2(in_dir / f, out_dir / f)
    if progress:
        print(f"converted {in_dir} -> {out_dir} ({fmt})", file=sys.stderr)
