"""The host weight arena: ModelParams as ONE page-aligned data file plus a JSON index,
mapped read-only and MAP_SHARED. It is how every checkpoint is served (load_checkpoint
converts a safetensors directory into one on first use): the routed experts, stacked
[E, ...] as the kernels take them, and every other leaf are views of the file's pages, so
the host holds the weights once (never a stacked copy beside the source), and every OS
process that loads it maps the same page-cache pages (one host copy for a prefill process
and a decode process). docs/checkpoints.md has the format; in short:
  weights.bin  every leaf at a 4096-byte aligned offset, routed experts stacked [E, ...],
               FP8 as e4m3 bytes + f32 scale_inv, others in their stored dtype;
  arena.json   format, version, config dict, per leaf {path (keystr in ModelParams), name,
               dtype, shape, offset, nbytes, crc32}; stacked experts drop the expert index
               in `name` (model.layers.3.mlp.experts.gate_proj.weight).
load_arena's leaves are read-only views into one np.memmap (mode "r" = PROT_READ +
MAP_SHARED), page aligned and C-contiguous: placement.host_params keeps them and
jax.device_put on CPU is zero-copy. ensure_arena converts a safetensors checkpoint once,
leaf by leaf from its memory maps, into the cache (hmoe_jax.io.cache) keyed by the source
files.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import re
import shutil
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import jax
import numpy as np
from tqdm import tqdm

from hmoe_jax.config import ModelConfig, QuantConfig, config_from_dict, load_config
from hmoe_jax.io import cache
from hmoe_jax.io.errors import CheckpointError
from hmoe_jax.io.format import CONFIG_NAME, FP8_TAG, SCALE_SUFFIX, open_catalog, unused_note, validate
from hmoe_jax.io.names import build_params, expected_tensors, flatten_params
from hmoe_jax.io.safetensors_io import DTYPES, dtype_tag
from hmoe_jax.model.params import ModelParams
from hmoe_jax.quant.fp8 import Fp8Tensor, scale_grid_shape

FORMAT = "hmoe-arena"
# Bump on any change of layout or meaning; it is checked on load and is part of the cache key.
VERSION = 1
DATA_NAME = "weights.bin"
ARENA_INDEX = "arena.json"
PAGE_BYTES = 4096  # leaf alignment: a page, so a leaf never shares a page with another
_SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")
_EXPERT = re.compile(r"\.experts\.\d+\.")


class ArenaError(CheckpointError):
    """An arena directory that is missing, truncated, of another version or corrupt."""


def is_arena(path: str | Path) -> bool:
    return (Path(path) / ARENA_INDEX).is_file()


@dataclasses.dataclass(frozen=True)
class _Src:
    """A leaf to write: its name and the arrays whose bytes, concatenated, are the leaf
    (one array, or one per expert for a stacked leaf). Views into safetensors maps read
    nothing until written."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    parts: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def _stacked_name(name: str) -> str:
    return _EXPERT.sub(".experts.", name, count=1)


def _src(name: str, a: Any) -> _Src:
    a = np.asarray(a)
    return _Src(name, a.dtype, tuple(a.shape), (a,))


def _stack_srcs(ws: list[_Src]) -> _Src:
    if len({w.dtype for w in ws}) != 1 or len({w.shape for w in ws}) != 1:
        raise ArenaError(f"{_stacked_name(ws[0].name)}: experts of one layer differ in dtype or shape")
    return _Src(
        _stacked_name(ws[0].name), ws[0].dtype, (len(ws), *ws[0].shape), sum((w.parts for w in ws), ())
    )


def _stack(ws: list[Any]) -> Any:
    if isinstance(ws[0], Fp8Tensor):
        return dataclasses.replace(
            ws[0], w=_stack_srcs([t.w for t in ws]), scale_inv=_stack_srcs([t.scale_inv for t in ws])
        )
    return _stack_srcs(ws)


def _plan_checkpoint(root: Path) -> tuple[ModelConfig, dict[str, Any], ModelParams]:
    """ModelParams whose leaves are _Src views, read through the format's catalog."""
    cfg = load_config(root / CONFIG_NAME)
    cat = open_catalog(root)
    validate(cfg, cat)
    if cat.unused:
        print(unused_note(cfg, cat), file=sys.stderr)

    def get(name: str) -> Any:
        w = _src(name, cat.view(name))
        if cat.info(name).dtype == FP8_TAG:
            q = cfg.quant
            s = _src(name + SCALE_SUFFIX, cat.view(name + SCALE_SUFFIX))
            return Fp8Tensor(w=w, scale_inv=s, block_n=q.block_n, block_k=q.block_k)
        return w

    raw = json.loads((root / CONFIG_NAME).read_text())  # exactly what load_config parsed
    return cfg, raw, build_params(cfg, get, stack=_stack)


def _plan_params(cfg: ModelConfig, params: ModelParams) -> tuple[ModelConfig, dict[str, Any], ModelParams]:
    named = flatten_params(cfg, params)
    blocks = {(x.block_n, x.block_k) for x in named.values() if isinstance(x, Fp8Tensor)}
    if len(blocks) > 1 or (blocks and cfg.quant and blocks != {(cfg.quant.block_n, cfg.quant.block_k)}):
        raise ArenaError(f"FP8 leaves use block sizes {sorted(blocks)}, config says {cfg.quant}")
    if blocks and cfg.quant is None:
        (bn, bk) = blocks.pop()
        cfg = dataclasses.replace(cfg, quant=QuantConfig(block_n=bn, block_k=bk))

    def get(name: str) -> Any:
        x = named[name]
        if isinstance(x, Fp8Tensor):
            return dataclasses.replace(
                x, w=_src(name, x.w), scale_inv=_src(name + SCALE_SUFFIX, np.asarray(x.scale_inv, np.float32))
            )
        return _src(name, x)

    raw = cfg.to_hf_dict()
    raw["model_type"] = cfg.model_type  # to_hf_dict says deepseek_v3 for Kimi-K2 too
    return cfg, raw, build_params(cfg, get, stack=_stack)


def _release(a: np.ndarray) -> None:
    """Drop this process's mapping of a source view's pages once written (MADV_DONTNEED on
    a read-only file map: the page cache keeps them, reclaimable), so converting ~650 GB
    does not grow the converter's RSS to the model size."""
    outer = a
    while isinstance(outer.base, np.ndarray):
        outer = outer.base
    m = outer.base
    if not isinstance(m, mmap.mmap) or not hasattr(m, "madvise") or a.nbytes == 0:
        return
    start = a.ctypes.data - outer.ctypes.data
    lo = start - start % mmap.PAGESIZE
    m.madvise(mmap.MADV_DONTNEED, lo, start + a.nbytes - lo)


def _leaves(tree: Any, kind: type) -> list[tuple[str, Any]]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, kind))
    return [(jax.tree_util.keystr(p), x) for p, x in flat]


def write_arena(
    source: str | Path | ModelParams,
    out_dir: str | Path,
    *,
    cfg: ModelConfig | None = None,
    progress: bool = True,
) -> Path:
    """Write an arena from a checkpoint directory (streamed tensor by tensor from its
    memory maps) or from in-memory `params` (then `cfg` is required). Written into a temp
    directory beside out_dir and renamed into place; an existing arena at out_dir is
    replaced (processes that mapped it keep their pages), any other existing path is an
    error. Returns out_dir."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not is_arena(out_dir) and any(out_dir.iterdir()):
        raise ArenaError(f"{out_dir}: exists and is not an arena; refusing to replace it")
    tmp = _write_tmp(_plan(source, cfg), out_dir, progress)
    old = out_dir.with_name(f".old-{out_dir.name}-{os.getpid()}")
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


@dataclasses.dataclass(frozen=True)
class _Plan:
    """An arena before it is written: its config, leaves and where they come from."""

    raw: dict[str, Any]  # the config dict stored in the index
    leaves: list[tuple[str, _Src]]  # (keystr in ModelParams, source)
    src_dir: Path | None  # the checkpoint directory, None for in-memory params

    @property
    def data_bytes(self) -> int:
        """Size of weights.bin: every leaf padded to a page."""
        return sum(s.nbytes + (-s.nbytes % PAGE_BYTES) for _, s in self.leaves)


def _plan(source: Any, cfg: ModelConfig | None) -> _Plan:
    if isinstance(source, ModelParams):
        if cfg is None:
            raise ArenaError("write_arena(params, ...) needs cfg=")
        _, raw, tree = _plan_params(cfg, source)
        return _Plan(raw, _leaves(tree, _Src), None)
    src_dir = Path(source).resolve()
    _, raw, tree = _plan_checkpoint(src_dir)
    return _Plan(raw, _leaves(tree, _Src), src_dir)


def _write_tmp(plan: _Plan, out_dir: Path, progress: bool, hint: str = "") -> Path:
    """Write the arena into a fresh temp directory beside out_dir (after checking that
    its filesystem has room) and return that directory."""
    t0 = time.perf_counter()
    need = plan.data_bytes + 2**20  # + the index (~100 B per leaf) and side files
    cache.check_free_bytes(out_dir.parent, need, f"write the weight arena {out_dir.name}", hint)
    tmp = cache.temp_dir_for(out_dir)
    src_dir = plan.src_dir
    try:
        index, data_bytes = _write_data(tmp / DATA_NAME, plan.leaves, progress, release=src_dir is not None)
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "config": plan.raw,
            "source": str(src_dir) if src_dir else None,
        }
        meta |= {"data_bytes": data_bytes, "leaves": index}
        (tmp / ARENA_INDEX).write_text(json.dumps(meta, indent=1))
        for name in _SIDE_FILES if src_dir else ():
            if (src_dir / name).exists():
                shutil.copy2(src_dir / name, tmp / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # never leave a partial (maybe huge) temp dir
        raise
    if progress:
        dt = time.perf_counter() - t0
        print(
            f"wrote arena {out_dir}: {len(index)} leaves, {data_bytes / 1e6:.1f} MB in {dt:.2f} s "
            f"({data_bytes / 1e6 / max(dt, 1e-9):.0f} MB/s)",
            file=sys.stderr,
        )
    return tmp


def _write_data(
    path: Path, leaves: list[tuple[str, _Src]], progress: bool, release: bool
) -> tuple[list[dict[str, Any]], int]:
    """Write every leaf page-aligned; returns (index entries, data bytes)."""
    index: list[dict[str, Any]] = []
    off = 0
    total = sum(s.nbytes for _, s in leaves)
    disable = None if progress else True  # None: a bar only on a terminal, as the loader
    bar = tqdm(
        total=total, desc="arena", unit="B", unit_scale=True, file=sys.stderr, disable=disable, leave=False
    )
    with bar, open(path, "wb") as f:
        for key, s in leaves:
            bar.set_description(f"arena {s.name.split('.mlp.')[0]}")
            # crc32 of every leaf in full, computed while its bytes pass through anyway:
            # zlib does ~4 GB/s on one core here, so the ~650 GB of DeepSeek-V3 cost
            # ~3 min of CPU next to reading them from disk; sampled pages would miss most
            # corruption. It detects accidents (bit rot, torn copies), not tampering.
            crc = 0
            for p in s.parts:
                b = memoryview(np.ascontiguousarray(p).reshape(-1).view(np.uint8))
                f.write(b)
                crc = zlib.crc32(b, crc)
                bar.update(len(b))
                if release:  # only our own read-only source maps
                    _release(p)
            index.append(
                dict(path=key, name=s.name, dtype=dtype_tag(s.dtype), shape=list(s.shape))
                | dict(offset=off, nbytes=s.nbytes, crc32=crc)
            )
            off += s.nbytes
            pad = -off % PAGE_BYTES
            f.write(b"\0" * pad)
            off += pad
        f.flush()
        os.fsync(f.fileno())
    return index, off


def _read_index(root: Path) -> dict[str, Any]:
    p = root / ARENA_INDEX
    if not p.is_file():
        raise ArenaError(f"{root}: not an arena (no {ARENA_INDEX})")
    try:
        meta = json.loads(p.read_text())
        fmt, version, leaves = meta["format"], meta["version"], meta["leaves"]
        int(meta["data_bytes"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ArenaError(f"{p}: not a valid arena index ({e!r})") from None
    if fmt != FORMAT or version != VERSION:
        raise ArenaError(
            f"{p}: arena format {fmt!r} version {version!r}, this build reads {FORMAT!r} version {VERSION}; "
            "convert the checkpoint again (ensure_arena / hmoe convert --format arena)"
        )
    if not isinstance(leaves, list):
        raise ArenaError(f"{p}: 'leaves' is not a list")
    return meta


def arena_config(path: str | Path) -> ModelConfig:
    """The config an arena was written for, from its index alone (maps nothing: a
    coordinator process that only validates requests never touches the weight pages)."""
    root = Path(path)
    try:
        return config_from_dict(_read_index(root)["config"], where=str(root / ARENA_INDEX))
    except (KeyError, TypeError) as e:
        raise ArenaError(f"{root / ARENA_INDEX}: no valid 'config' ({e!r})") from None


def mapped_kb(pid: int, path: str | Path) -> dict[str, int]:
    """Rss and Pss (kB) of process `pid`'s mappings of file `path`, from /proc/<pid>/smaps.
    Pss splits each resident page among the processes that map it, so the sum over
    processes sharing one copy is one copy, where Rss would count it once per process."""
    target = os.path.realpath(path)
    out = {"Rss": 0, "Pss": 0}
    inside = False
    with open(f"/proc/{int(pid)}/smaps") as f:
        for line in f:
            head = line.split()
            if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:  # a mapping's header line
                inside = len(head) >= 6 and head[5] == target
            elif inside and head[0].rstrip(":") in out:
                out[head[0].rstrip(":")] += int(head[1])
    return out


def _expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name (stacked names for experts) -> shape the config implies."""
    out = {}
    for s in expected_tensors(cfg):
        name = _stacked_name(s.name)
        out[name] = (cfg.n_routed_experts, *s.shape) if name != s.name else s.shape
    return out


def load_arena(
    path: str | Path,
    *,
    cfg: ModelConfig | None = None,
    verify: bool = False,
    upcast_f32: bool = False,
    progress: bool = True,
) -> tuple[ModelConfig, ModelParams]:
    """Map an arena (read-only, MAP_SHARED) and return (config, params of views into the
    map). `cfg`: the config the caller expects (mismatch is an error). `verify`: check
    every leaf's crc32 (reads the whole file). `upcast_f32`: as load_checkpoint (copies
    non-expert bf16/f16 leaves to f32)."""
    t0 = time.perf_counter()
    root = Path(path)
    meta = _read_index(root)
    try:
        got = config_from_dict(meta["config"], where=str(root / ARENA_INDEX))
    except (KeyError, TypeError) as e:
        raise ArenaError(f"{root / ARENA_INDEX}: no valid 'config' ({e!r})") from None
    if cfg is not None and got != cfg:
        diff = [f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(got, f.name)]
        raise ArenaError(f"{root}: arena config differs from the expected one in {diff}")
    cfg = got
    data = root / DATA_NAME
    size = data.stat().st_size if data.is_file() else None
    if size is None:
        raise ArenaError(f"{data}: arena data file not found")
    if size < meta["data_bytes"]:
        raise ArenaError(f"{data}: {size} bytes, the index needs {meta['data_bytes']} (truncated)")
    mm = np.memmap(data, dtype=np.uint8, mode="r")  # ACCESS_READ: PROT_READ, MAP_SHARED
    shapes = _expected_shapes(cfg)
    by_name: dict[str, np.ndarray] = {}
    for e in meta["leaves"]:
        try:
            name, tag, shape, off, n = e["name"], e["dtype"], tuple(e["shape"]), e["offset"], e["nbytes"]
        except (KeyError, TypeError) as err:
            raise ArenaError(f"{root / ARENA_INDEX}: malformed leaf entry {e!r} ({err!r})") from None
        if tag not in DTYPES or n != int(np.prod(shape, dtype=np.int64)) * DTYPES[tag].itemsize:
            raise ArenaError(
                f"{root / ARENA_INDEX}: leaf {name!r} has bad dtype/shape/nbytes {tag}{list(shape)} {n}"
            )
        if off % PAGE_BYTES or off + n > meta["data_bytes"]:
            raise ArenaError(f"{root / ARENA_INDEX}: leaf {name!r} at offset {off} (+{n}) is misplaced")
        want = shapes.get(name)
        if name.endswith(SCALE_SUFFIX) and name[: -len(SCALE_SUFFIX)] in shapes and cfg.quant:
            want = scale_grid_shape(shapes[name[: -len(SCALE_SUFFIX)]], cfg.quant.block_n, cfg.quant.block_k)
        if want != shape:
            raise ArenaError(
                f"{root}: leaf {name!r} has shape {list(shape)}, the arena's config implies "
                f"{list(want) if want else 'no such tensor'} (config mismatch)"
            )
        raw = mm[off : off + n]
        if verify and zlib.crc32(raw) != e["crc32"]:
            raise ArenaError(
                f"{data}: leaf {name!r} (bytes {off}..{off + n}) fails its crc32 check "
                f"({zlib.crc32(raw):#010x}, index says {e['crc32']:#010x}): corrupt arena"
            )
        by_name[name] = raw.view(DTYPES[tag]).reshape(shape)
    params = _assemble(cfg, root, by_name, upcast_f32)
    paths = [p for p, _ in _leaves(params, np.ndarray)]
    if paths != [e["path"] for e in meta["leaves"]]:
        raise ArenaError(f"{root}: index leaves do not match the ModelParams layout of its config")
    if progress:
        print(
            f"mapped arena {root} in {time.perf_counter() - t0:.2f} s: {len(paths)} leaves, "
            f"{meta['data_bytes'] / 1e6:.1f} MB shared read-only" + (", verified" if verify else ""),
            file=sys.stderr,
        )
    return cfg, params


def _assemble(cfg: ModelConfig, root: Path, by_name: dict[str, np.ndarray], upcast_f32: bool) -> ModelParams:
    def leaf(name: str) -> Any:
        if name not in by_name:
            raise ArenaError(f"{root}: arena has no leaf {name!r}")
        w = by_name[name]
        if name + SCALE_SUFFIX in by_name:
            q = cfg.quant
            return Fp8Tensor(
                w=w, scale_inv=by_name[name + SCALE_SUFFIX], block_n=q.block_n, block_k=q.block_k
            )
        if upcast_f32 and w.dtype != np.float32 and ".mlp.experts." not in name:
            return w.astype(np.float32)
        return w

    # Experts come back from get() as names; stack() turns the layer's names into its
    # stacked leaf, so build_params stays the one definition of the pytree.
    def get(name: str) -> Any:
        return name if _EXPERT.search(name) else leaf(name)

    return build_params(cfg, get, stack=lambda names: leaf(_stacked_name(names[0])))


def cache_key(checkpoint_dir: str | Path) -> str:
    """The source's key (hmoe_jax.io.cache.source_key) salted with the arena version."""
    return cache.source_key(checkpoint_dir, {"format": FORMAT, "version": VERSION})


def check_intact(root: Path) -> str | None:
    """Why an arena directory cannot be served as is (None when it can), from its index and
    file size alone: an index that does not parse or is of another version, a data file
    missing, shorter or longer than the index says, a leaf out of bounds. Reads no weight
    data, so a flipped bit inside a leaf is left to load_arena(verify=True)."""
    try:
        meta = _read_index(root)
    except ArenaError as e:
        return str(e)
    data = root / DATA_NAME
    if not data.is_file():
        return f"{data}: arena data file not found"
    size, want = data.stat().st_size, int(meta["data_bytes"])
    if size != want:
        return f"{data}: {size} bytes, the index says {want} ({'truncated' if size < want else 'overlong'})"
    try:
        end = max((int(e["offset"]) + int(e["nbytes"]) for e in meta["leaves"]), default=0)
    except (KeyError, TypeError, ValueError) as e:
        return f"{root / ARENA_INDEX}: malformed leaf entry ({e!r})"
    if end > want:
        return f"{root / ARENA_INDEX}: a leaf ends at byte {end}, past the data's {want}"
    return None


def ensure_arena(
    checkpoint_dir: str | Path, cache_root: str | Path | None = None, progress: bool = True
) -> Path:
    """The arena of a safetensors checkpoint, converted once into `cache_root` (default
    hmoe_jax.io.cache.arena_cache_dir(): $HMOE_ARENA_DIR, else $HMOE_CACHE/arenas) /
    <name>-<cache_key> and reused afterwards. A cached arena that fails check_intact
    (truncated, torn index, other version) is discarded and converted again. Free disk
    is checked before converting. Older arenas of the same source (a changed file) are
    removed after a new one is made."""
    src = Path(checkpoint_dir).resolve()
    if not src.is_dir():
        raise CheckpointError(f"{src}: checkpoint directory not found")
    load_config(src / CONFIG_NAME)  # a bad config.json is named before the weight files
    root = Path(cache_root) if cache_root is not None else cache.arena_cache_dir()
    final = root / f"{src.name}-{cache_key(src)}"
    if final.exists():
        why = check_intact(final)
        if why is None:
            return final
        print(f"note: cached arena {final} is unusable ({why}); converting again", file=sys.stderr)
        cache.discard(final)
    plan = _plan(src, None)
    if root.is_dir():
        cache.sweep_temps(final)
    if progress:
        print(
            f"converting {src} once into the weight arena {final} ({plan.data_bytes / 1e9:.2f} GB; "
            f"set ${cache.ARENA_DIR_ENV} to put it elsewhere)",
            file=sys.stderr,
        )
    hint = f"; free space there, or set ${cache.ARENA_DIR_ENV} to a directory on a disk with room"
    cache.install(_write_tmp(plan, final, progress, hint), final)
    for old in root.iterdir():
        if old != final and old.name.startswith(f"{src.name}-") and is_arena(old):
            try:
                stale = json.loads((old / ARENA_INDEX).read_text()).get("source") == str(src)
            except (json.JSONDecodeError, OSError):
                stale = False
            if stale:
                shutil.rmtree(old, ignore_errors=True)
    return final
