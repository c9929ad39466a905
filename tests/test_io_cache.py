"""The arena cache behind load_checkpoint (hmoe_jax.io.cache + arena.ensure_arena): where it
lives ($HMOE_ARENA_DIR, else $HMOE_CACHE/arenas), that a cached arena is reused, that a
truncated or torn one is detected and rebuilt with the checkpoint's bytes (checked
against the safetensors file itself), that an edit keeping size and mtime still changes
the key, and that a disk without room fails before writing with the bytes and directory."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

from hmoe_jax.io import arena as ar
from hmoe_jax.io import cache
from hmoe_jax.io.loader import load_checkpoint
from hmoe_jax.io.names import flatten_params
from hmoe_jax.io.safetensors_io import SafetensorsFile
from hmoe_jax.io.synthetic import ensure_default_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HMOE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield ensure_default_checkpoint(progress=False)


@pytest.fixture
def arenas(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.ARENA_DIR_ENV, str(tmp_path / "arenas"))
    return tmp_path / "arenas"


def _assert_same_as_file(ckpt, cfg, params):
    """Every tensor equals its bytes in model.safetensors (read by name, not by the arena)."""
    f = SafetensorsFile(ckpt / "model.safetensors")
    named = flatten_params(cfg, params)
    assert len(named) > 10
    for name, x in named.items():
        if hasattr(x, "scale_inv"):
            assert np.array_equal(np.asarray(x.scale_inv), f.tensor(name + "_scale_inv")), name
            x = x.w
        assert np.array_equal(np.asarray(x).view(np.uint8), f.tensor(name).view(np.uint8)), name


def _only_arena(arenas):
    (d,) = [d for d in arenas.iterdir() if ar.is_arena(d)]
    assert not [d for d in arenas.iterdir() if d.name.startswith(".")]  # no temp dir left
    return d


def test_location_env_and_default(tmp_path, monkeypatch):
    monkeypatch.setenv("HMOE_CACHE", str(tmp_path / "c"))
    monkeypatch.delenv(cache.ARENA_DIR_ENV, raising=False)
    assert cache.arena_cache_dir() == tmp_path / "c" / "arenas"
    monkeypatch.setenv(cache.ARENA_DIR_ENV, str(tmp_path / "elsewhere"))
    assert cache.arena_cache_dir() == tmp_path / "elsewhere"


def test_second_load_reuses_the_arena(ckpt, arenas, capsys):
    cfg, p = load_checkpoint(ckpt)
    assert "converting" in capsys.readouterr().err
    d = _only_arena(arenas)
    st = (d / ar.DATA_NAME).stat()
    _, q = load_checkpoint(ckpt)
    err = capsys.readouterr().err
    assert "converting" not in err and "mapped arena" in err
    again = (d / ar.DATA_NAME).stat()
    assert (again.st_ino, again.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    _assert_same_as_file(ckpt, cfg, q)


@pytest.mark.parametrize(
    "damage, why",
    [
        (lambda d: os.truncate(d / ar.DATA_NAME, (d / ar.DATA_NAME).stat().st_size // 3), "truncated"),
        (lambda d: (d / ar.DATA_NAME).unlink(), "arena data file not found"),
        (lambda d: (d / ar.ARENA_INDEX).write_text('{"format": "hmoe-ar'), "not a valid arena index"),
    ],
    ids=["truncated-data", "missing-data", "torn-index"],
)
def test_a_damaged_cache_is_rebuilt(ckpt, arenas, capsys, damage, why):
    load_checkpoint(ckpt, progress=False)
    d = _only_arena(arenas)
    damage(d)
    cfg, p = load_checkpoint(ckpt, progress=False)
    err = capsys.readouterr().err
    assert f"cached arena {d} is unusable" in err and why in err, err
    assert _only_arena(arenas) == d and ar.check_intact(d) is None
    _assert_same_as_file(ckpt, cfg, p)


def test_a_bad_leaf_entry_of_the_right_size_is_rebuilt(ckpt, arenas):
    # check_intact reads sizes only; load_arena then refuses the entry and the loader
    # discards the cache and converts again.
    load_checkpoint(ckpt, progress=False)
    d = _only_arena(arenas)
    meta = json.loads((d / ar.ARENA_INDEX).read_text())
    meta["leaves"][0]["dtype"] = "I64"
    (d / ar.ARENA_INDEX).write_text(json.dumps(meta))
    assert ar.check_intact(d) is None
    cfg, p = load_checkpoint(ckpt, progress=False)
    assert json.loads((d / ar.ARENA_INDEX).read_text())["leaves"][0]["dtype"] != "I64"
    _assert_same_as_file(ckpt, cfg, p)


def test_key_sees_a_header_edit_that_keeps_size_and_mtime(ckpt, tmp_path):
    src = shutil.copytree(ckpt, tmp_path / "src")
    w = src / "model.safetensors"
    before = cache.source_key(src, {})
    st = w.stat()
    raw = bytearray(w.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    head = raw[8 : 8 + n].decode()
    k = head.index('"F32"')  # one tensor's dtype tag, same length
    raw[8 + k : 8 + k + 5] = b'"I32"'
    w.write_bytes(bytes(raw))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert w.stat().st_size == st.st_size and w.stat().st_mtime_ns == st.st_mtime_ns
    assert cache.source_key(src, {}) != before
    assert cache.source_key(src, {"version": 2}) != cache.source_key(src, {})


def test_no_room_fails_before_writing(ckpt, arenas, monkeypatch):
    free = 4096
    monkeypatch.setattr(cache.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12, free))
    with pytest.raises(cache.CacheError) as e:
        load_checkpoint(ckpt, progress=False)
    msg = str(e.value)
    need = ar._plan(ckpt, None).data_bytes
    assert msg.startswith(str(arenas)) and "not enough free disk" in msg
    assert f"need {need + 2**20} bytes" in msg and f"{free} bytes" in msg and cache.ARENA_DIR_ENV in msg
    assert not arenas.exists() or not any(arenas.iterdir())  # nothing written, no temp dir


def test_upcast_and_pytree_are_the_arena_s(ckpt, arenas):
    cfg, p = load_checkpoint(ckpt, progress=False)
    _, up = load_checkpoint(ckpt, progress=False, upcast_f32=True)
    assert jax.tree_util.tree_structure(p) == jax.tree_util.tree_structure(up)
    assert up.embed.dtype == np.float32 and np.array_equal(up.embed, np.asarray(p.embed, np.float32))


def test_a_dead_converter_s_temp_dir_is_swept(ckpt, arenas):
    import subprocess
    import sys

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid = int(dead.stdout)  # exited: its pid is free (reuse within this test is unlikely)
    load_checkpoint(ckpt, progress=False)
    d = _only_arena(arenas)
    shutil.rmtree(d)
    left = arenas / f".tmp-{d.name}-{pid}"
    (left / "partial").mkdir(parents=True)
    load_checkpoint(ckpt, progress=False)
    assert not left.exists() and _only_arena(arenas) == d
