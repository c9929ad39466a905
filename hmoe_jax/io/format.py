"""The HF / DeepSeek checkpoint format as files: the file names of a checkpoint directory,
the safetensors dtype tags we accept, the catalog of where every tensor lives (parsed from
headers only) and its validation against config.json. Every reader and writer of the
format (loader, arena, writer) shares these; none of them imports another for them.

Layout accepted: config.json + model.safetensors, or shards listed by
model.safetensors.index.json; tensor names as DeepSeek's release (hmoe_jax.io.names).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from hmoe_jax.config import ModelConfig
from hmoe_jax.io.errors import CheckpointError
from hmoe_jax.io.names import TensorSpec, expected_tensors, is_unused
from hmoe_jax.io.safetensors_io import SafetensorsFile, TensorInfo
from hmoe_jax.quant.fp8 import scale_grid_shape

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"  # "X.weight" -> "X.weight_scale_inv"
FLOAT_TAGS = ("F32", "BF16", "F16")
FP8_TAG = "F8_E4M3"


@dataclasses.dataclass
class Catalog:
    """Where every tensor of a checkpoint lives, after validation against the config."""

    root: Path
    files: dict[str, SafetensorsFile]  # file name -> parsed file
    where: dict[str, str]  # tensor name -> file name
    unused: list[str]  # tensors present but skipped (MTP layers, rotary caches)

    def info(self, name: str) -> TensorInfo:
        return self.files[self.where[name]].tensors[name]

    def view(self, name: str) -> np.ndarray:
        return self.files[self.where[name]].tensor(name)

    def origin(self, name: str) -> str:
        return str(self.root / self.where[name])


def weight_files(root: str | Path) -> list[str]:
    """Names of the safetensors files a checkpoint directory holds (from the index when
    there is one); raises CheckpointError when the layout is not one we read."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory not found")
    index = root / INDEX_NAME
    if index.exists():
        return sorted(set(_weight_map(index).values()))
    if (root / SINGLE_NAME).exists():
        return [SINGLE_NAME]
    found = sorted(p.name for p in root.glob("*.safetensors"))
    if len(found) != 1:
        raise CheckpointError(
            f"{root}: expected {SINGLE_NAME} or {INDEX_NAME}, found {len(found)} *.safetensors file(s) {found[:4]}"
        )
    return found


def _weight_map(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{index}: not a valid index (expected JSON with a 'weight_map' object; {e!r})"
        ) from None
    return weight_map


def open_catalog(root: str | Path) -> Catalog:
    """Parse the index (if any) and every shard header; no tensor data is read."""
    root = Path(root)
    names = weight_files(root)
    index = root / INDEX_NAME
    weight_map = _weight_map(index) if index.exists() else None
    files = {}
    for n in names:
        if not (root / n).exists():
            raise CheckpointError(f"{index}: lists shard {n!r}, which is not in {root}")
        files[n] = SafetensorsFile(root / n)
    where: dict[str, str] = {}
    for n, f in files.items():
        for t in f.names():
            if t in where:
                raise CheckpointError(f"{root}: tensor {t!r} is stored twice ({where[t]} and {n})")
            where[t] = n
    if weight_map is not None:
        for t, n in weight_map.items():
            if where.get(t) != n:
                raise CheckpointError(
                    f"{index}: maps {t!r} to {n!r}, but that shard's header does not hold it"
                )
    return Catalog(root=root, files=files, where=where, unused=[])


def _shape(s: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, s)) + "]"


def validate(cfg: ModelConfig, cat: Catalog) -> list[TensorSpec]:
    """Check names, shapes, dtypes and FP8 scale grids against the config; fills
    cat.unused. Returns the expected specs in checkpoint order of the config."""
    specs = expected_tensors(cfg)
    wanted = {s.name for s in specs}
    missing = [s for s in specs if s.name not in cat.where]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        s = missing[0]
        raise CheckpointError(
            f"{cat.root}: missing tensor {s.name!r} (expected shape {_shape(s.shape)}){more}"
        )
    for s in specs:
        info = cat.info(s.name)
        if info.shape != s.shape:
            raise CheckpointError(
                f"{cat.origin(s.name)}: tensor {s.name!r} has shape {_shape(info.shape)}, expected {_shape(s.shape)} from config.json"
            )
        _check_dtype(cfg, cat, s, info)
    scales = {s.name + SCALE_SUFFIX for s in specs if s.quantized and cat.info(s.name).dtype == FP8_TAG}
    unexpected = []
    for t in cat.where:
        if t in wanted or t in scales:
            continue
        if is_unused(cfg, t):
            cat.unused.append(t)
        else:
            unexpected.append(t)
    if unexpected:
        raise CheckpointError(
            f"{cat.origin(unexpected[0])}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all); "
            f"not part of a {cfg.model_type} model with this config.json"
        )
    return specs


def _check_dtype(cfg: ModelConfig, cat: Catalog, s: TensorSpec, info: TensorInfo) -> None:
    where = cat.origin(s.name)
    if info.dtype in FLOAT_TAGS:
        return
    if info.dtype != FP8_TAG or not s.quantized:
        allowed = FLOAT_TAGS + ((FP8_TAG,) if s.quantized else ())
        raise CheckpointError(
            f"{where}: tensor {s.name!r} has dtype {info.dtype}, expected one of {list(allowed)}"
        )
    if cfg.quant is None:
        raise CheckpointError(
            f"{where}: tensor {s.name!r} is {FP8_TAG} but config.json has no quantization_config (expected quant_method 'fp8')"
        )
    sname = s.name + SCALE_SUFFIX
    if sname not in cat.where:
        raise CheckpointError(f"{where}: FP8 tensor {s.name!r} has no {sname!r} beside it")
    sinfo = cat.info(sname)
    grid = scale_grid_shape(s.shape, cfg.quant.block_n, cfg.quant.block_k)
    if sinfo.shape != grid:
        raise CheckpointError(
            f"{cat.origin(sname)}: {sname!r} has shape {_shape(sinfo.shape)}, expected {_shape(grid)} "
            f"({_shape(s.shape)} in {cfg.quant.block_n}x{cfg.quant.block_k} blocks)"
        )
    if sinfo.dtype != "F32":
        raise CheckpointError(f"{cat.origin(sname)}: {sname!r} has dtype {sinfo.dtype}, expected F32")


def unused_note(cfg: ModelConfig, cat: Catalog) -> str:
    """One line naming what validate() put in cat.unused (MTP layers, rotary caches)."""
    idx = [t.split(".")[2] for t in cat.unused if t.startswith("model.layers.")]
    layers = sorted({int(i) for i in idx if i.isdigit() and int(i) >= cfg.num_hidden_layers})
    what = []
    if layers:
        what.append(f"layer(s) {layers} >= num_hidden_layers={cfg.num_hidden_layers} (MTP)")
    if any(t.endswith("rotary_emb.inv_freq") for t in cat.unused):
        what.append("rotary inv_freq caches")
    return f"note: skipping {len(cat.unused)} unused tensor(s): {', '.join(what)}"
