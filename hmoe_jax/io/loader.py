"""Load an HF-format DeepSeek-V3 checkpoint directory into (ModelConfig, ModelParams).

Lazy and single-copy: every safetensors file is memory-mapped once; non-expert tensors
are read-only views into those maps (bytes are paged in when first used). Routed experts
are stacked per layer and matrix ([E, ...], the layout kernels take with expert ids) into
ONE preallocated 64-byte-aligned host buffer each, reading every expert once; aligned
buffers are zero-copy into JAX on CPU (shared/NOTES.md). FP8 weights stay FP8: an
`Fp8Tensor` of the e4m3 view plus its float32 `weight_scale_inv` view.

Layout accepted: config.json + model.safetensors, or shards listed by
model.safetensors.index.json; tensor names as DeepSeek's release (hmoe_jax.io.names).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from hmoe_jax.config import ModelConfig, load_config
from hmoe_jax.io.errors import CheckpointError
from hmoe_jax.io.names import TensorSpec, build_params, expected_tensors, is_unused
from hmoe_jax.io.safetensors_io import DTYPES, SafetensorsFile, TensorInfo
from hmoe_jax.model.params import ModelParams
from hmoe_jax.quant.fp8 import Fp8Tensor, scale_grid_shape
from hmoe_jax.quant.hostmem import ALIGN_BYTES, aligned_empty  # noqa: F401  (writer imports ALIGN_BYTES)

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


def open_catalog(root: str | Path) -> Catalog:
    """Parse the index (if any) and every shard header; no tensor data is read."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory not found")
    index = root / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(
                f"{index}: not a valid index (expected JSON with a 'weight_map' object; {e!r})"
            ) from None
        names = sorted(set(weight_map.values()))
    elif (root / SINGLE_NAME).exists():
        weight_map, names = None, [SINGLE_NAME]
    else:
        found = sorted(p.name for p in root.glob("*.safetensors"))
        if len(found) != 1:
            raise CheckpointError(
                f"{root}: expected {SINGLE_NAME} or {INDEX_NAME}, found {len(found)} *.safetensors file(s) {found[:4]}"
            )
        weight_map, names = None, found
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


class _Loader:
    """The `get` and `stack` hooks build_params calls, with progress accounting."""

    def __init__(self, cfg: ModelConfig, cat: Catalog, specs: list[TensorSpec], upcast_f32: bool, bar: tqdm):
        self.cfg, self.cat, self.upcast_f32, self.bar = cfg, cat, upcast_f32, bar
        self.specs = {s.name: s for s in specs}
        self.layer = ""
        self.stacked_bytes = 0
        self.upcast_bytes = 0

    def get(self, name: str) -> Any:
        s = self.specs[name]
        v = self.cat.view(name)
        layer = name.split(".")[2] if name.startswith("model.layers.") else ""
        if layer != self.layer:  # progress per tensor, labelled per layer
            self.layer = layer
            self.bar.set_description(f"loading layer {layer}" if layer else "loading")
        self.bar.update(1)
        if v.dtype == DTYPES[FP8_TAG]:
            q = self.cfg.quant
            return Fp8Tensor(
                w=v, scale_inv=self.cat.view(name + SCALE_SUFFIX), block_n=q.block_n, block_k=q.block_k
            )
        if self.upcast_f32 and v.dtype != np.float32 and ".mlp.experts." not in s.name:
            # Only on request: it trades memory (2x for bf16) for no per-call converts.
            self.upcast_bytes += v.size * 4
            return v.astype(np.float32)
        return v

    def stack(self, ws: list[Any]) -> Any:
        if isinstance(ws[0], Fp8Tensor):
            w = self._stack_arrays([t.w for t in ws])
            s = self._stack_arrays([t.scale_inv for t in ws])
            return Fp8Tensor(w=w, scale_inv=s, block_n=ws[0].block_n, block_k=ws[0].block_k)
        return self._stack_arrays(ws)

    def _stack_arrays(self, views: list[np.ndarray]) -> np.ndarray:
        dtypes = {v.dtype for v in views}
        if len(dtypes) != 1:
            raise CheckpointError(
                f"{self.cat.root}: experts of one layer mix dtypes {sorted(map(str, dtypes))}"
            )
        out = aligned_empty((len(views), *views[0].shape), views[0].dtype)  # [E, ...]
        # Copy as raw bytes: numpy's same-dtype copy of ml_dtypes (e4m3, bf16) goes through
        # the dtype's element loop, 3-8x slower than a byte copy (measured 0.7-1.7 vs
        # 4.8-5.8 GB/s on 16 experts of 2048x7168 FP8).
        raw = out.view(np.uint8)
        for e, v in enumerate(views):
            raw[e] = v.view(np.uint8)  # reads expert e's bytes from the map exactly once
        self.stacked_bytes += out.nbytes
        return out


def load_checkpoint(
    path: str | Path, *, progress: bool = True, upcast_f32: bool = False, arena: bool | None = None
) -> tuple[ModelConfig, ModelParams]:
    """Load a checkpoint directory. `upcast_f32` converts non-expert bf16/f16 leaves to
    float32 copies (for f32 compute without per-call converts); FP8 and experts stay as
    stored. `arena`: None (default) maps an arena directory (hmoe_jax.io.arena) as such and
    reads safetensors as below; True converts safetensors once into the cached shared arena
    and maps that; False never treats `path` as an arena. Raises ConfigError /
    CheckpointError with one-line messages."""
    if arena is not False:
        from hmoe_jax.io import arena as ar

        if arena or ar.is_arena(path):
            root = path if ar.is_arena(path) else ar.ensure_arena(path, progress=progress)
            return ar.load_arena(root, upcast_f32=upcast_f32, progress=progress)
    t0 = time.perf_counter()
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory not found")
    cfg = load_config(root / "config.json")
    cat = open_catalog(root)
    specs = validate(cfg, cat)
    if cat.unused:
        _note_unused(cfg, cat)
    with tqdm(
        total=len(specs),
        desc="loading",
        unit="tensor",
        file=sys.stderr,
        disable=None if progress else True,
        leave=False,
    ) as bar:
        ld = _Loader(cfg, cat, specs, upcast_f32, bar)
        params = build_params(cfg, ld.get, stack=ld.stack)
    if progress:
        total = sum(cat.info(s.name).nbytes for s in specs)
        print(
            f"loaded {root} in {time.perf_counter() - t0:.2f} s: {total / 1e6:.1f} MB of weights, "
            f"{ld.stacked_bytes / 1e6:.1f} MB routed experts stacked into aligned buffers, rest memory-mapped"
            + (f", {ld.upcast_bytes / 1e6:.1f} MB upcast to f32" if ld.upcast_bytes else ""),
            file=sys.stderr,
        )
    return cfg, params


def _note_unused(cfg: ModelConfig, cat: Catalog) -> None:
    idx = [t.split(".")[2] for t in cat.unused if t.startswith("model.layers.")]
    layers = sorted({int(i) for i in idx if i.isdigit() and int(i) >= cfg.num_hidden_layers})
    what = []
    if layers:
        what.append(f"layer(s) {layers} >= num_hidden_layers={cfg.num_hidden_layers} (MTP)")
    if any(t.endswith("rotary_emb.inv_freq") for t in cat.unused):
        what.append("rotary inv_freq caches")
    print(f"note: skipping {len(cat.unused)} unused tensor(s): {', '.join(what)}", file=sys.stderr)
