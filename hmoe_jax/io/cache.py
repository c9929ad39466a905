"""Where hmoe-jax keeps what it derives from its inputs, and how an entry gets there.

One root (`$HMOE_CACHE`, default `~/.cache/hmoe-jax`) holds the embedded default checkpoint,
XLA's compiled executables and the converted weight arenas (`$HMOE_ARENA_DIR`, default
`<root>/arenas`: one per source checkpoint, often as large as the checkpoint, so the one
location a user may want on another disk). An entry is a directory named by a key derived
from its inputs; it is written into a private temp directory beside its final name and
renamed into place, so a reader never sees a partial entry and concurrent first runs are
safe (the loser of the rename drops its copy: same key, same content).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path

from hmoe_jax.io.errors import CheckpointError
from hmoe_jax.io.format import CONFIG_NAME, INDEX_NAME, weight_files

CACHE_ENV = "HMOE_CACHE"
ARENA_DIR_ENV = "HMOE_ARENA_DIR"


class CacheError(CheckpointError):
    """The cache cannot take an entry (no room, not writable)."""


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "hmoe-jax"


def arena_cache_dir() -> Path:
    """Directory of converted arenas: $HMOE_ARENA_DIR, else <cache_root>/arenas."""
    env = os.environ.get(ARENA_DIR_ENV)
    return Path(env) if env else cache_root() / "arenas"


def source_key(checkpoint_dir: str | Path, salt: dict) -> str:
    """Key of a checkpoint directory's content as a reader sees it, without reading tensor
    data: its absolute path, and for config.json, the index and every weight file: name,
    size, mtime and a hash of the safetensors header (names, dtypes, shapes, offsets).
    Reading the headers costs ~16 MB for DeepSeek-V3's 163 shards, so an edit that keeps
    size and mtime (within the filesystem's timestamp granularity) but changes a header is
    still seen; an in-place edit of tensor bytes that keeps size, mtime and header is not.
    `salt`: what else the entry depends on (its format version)."""
    root = Path(checkpoint_dir).resolve()
    names = [n for n in (CONFIG_NAME, INDEX_NAME) if (root / n).exists()] + weight_files(root)
    files = []
    for n in names:
        if not (root / n).is_file():
            continue  # a shard the index lists but lacks: open_catalog names it when converting
        st = (root / n).stat()
        files.append([n, st.st_size, st.st_mtime_ns, _head_hash(root / n)])
    blob = json.dumps({"source": str(root), "files": files, "salt": salt}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _head_hash(path: Path) -> str:
    """sha256 of a safetensors file's length prefix + header (of a JSON file: all of it)."""
    with open(path, "rb") as f:
        if path.suffix != ".safetensors":
            return hashlib.sha256(f.read()).hexdigest()
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        return hashlib.sha256(head + f.read(min(n, 100_000_000))).hexdigest()


def check_free_bytes(directory: str | Path, need_bytes: int, what: str, hint: str = "") -> None:
    """Raise CacheError unless the filesystem holding `directory` (or its nearest existing
    parent) has `need_bytes` free, before anything is written."""
    d = Path(directory).absolute()
    probe = d
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need_bytes:
        raise CacheError(
            f"{d}: not enough free disk to {what}: need {need_bytes} bytes ({need_bytes / 1e9:.2f} GB), "
            f"{free} bytes ({free / 1e9:.2f} GB) free{hint}"
        )


def temp_dir_for(final: Path) -> Path:
    """A fresh private directory beside `final` (same filesystem, so rename is atomic)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def sweep_temps(final: Path) -> None:
    """Remove temp directories of `final` left by converters that died (their pid is gone),
    so a killed first run does not leave a model-sized directory behind forever."""
    for tmp in final.parent.glob(f".tmp-{final.name}-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except PermissionError:
            pass  # alive, another user's


def install(tmp: Path, final: Path) -> bool:
    """Rename a finished temp directory into place. False (and `tmp` removed) when another
    process installed the same entry first; it is the same content (same key)."""
    try:
        os.rename(tmp, final)
        return True
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        return False


def discard(final: Path) -> None:
    """Remove an entry that fails its checks: renamed aside first, so a concurrent reader
    of the final name never sees it half deleted, then deleted."""
    aside = final.with_name(f".bad-{final.name}-{os.getpid()}")
    try:
        os.rename(final, aside)
    except OSError:
        return  # gone already (another process discarded it)
    shutil.rmtree(aside, ignore_errors=True)
