"""The shared host weight arena (hmoe_jax.io.arena): bit-exact round trip against the
safetensors loader on the FP8 default model, every leaf a page-aligned view of ONE read-only
map (zero-copy through host_params and jax.device_put), the conversion cache and its
invalidation, the loader / CLI entry points, every bad-input case with its message, and two
OS processes sharing the same physical pages (PSS from /proc/<pid>/smaps)."""

from __future__ import annotations

import dataclasses
import json
import mmap
import os
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from hmoe_jax.config import load_config, named_model_config
from hmoe_jax.io import arena as ar
from hmoe_jax.io.cache import ARENA_DIR_ENV
from hmoe_jax.io.format import FP8_TAG, SCALE_SUFFIX, open_catalog, validate
from hmoe_jax.io.loader import load_checkpoint
from hmoe_jax.io.names import build_params
from hmoe_jax.io.synthetic import ensure_default_checkpoint, synthetic_params
from hmoe_jax.quant.fp8 import Fp8Tensor
from hmoe_jax.runtime.placement import host_params, is_aligned


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HMOE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield ensure_default_checkpoint(progress=False)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(ARENA_DIR_ENV, raising=False)  # conftest points it at a session dir
    return tmp_path / "cache"


def _stacked_reference(ckpt):
    """ModelParams built straight from the safetensors views with np.stack for the experts
    (the in-RAM layout the arena replaces): an oracle independent of the arena code."""
    cfg = load_config(ckpt / "config.json")
    cat = open_catalog(ckpt)
    validate(cfg, cat)

    def get(name):
        if cat.info(name).dtype == FP8_TAG:
            q = cfg.quant
            return Fp8Tensor(
                w=cat.view(name),
                scale_inv=cat.view(name + SCALE_SUFFIX),
                block_n=q.block_n,
                block_k=q.block_k,
            )
        return cat.view(name)

    return cfg, build_params(cfg, get)


def _map_of(a: np.ndarray) -> tuple[np.ndarray, object]:
    """(the outermost array over the mapping, the mmap.mmap object) of a view."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a, a.base


def test_round_trip_is_bit_exact_and_zero_copy(ckpt, cache):
    path = ar.ensure_arena(ckpt, progress=False)
    cfg, params = ar.load_arena(path, verify=True, progress=False)
    ref_cfg, ref = _stacked_reference(ckpt)
    assert cfg == ref_cfg
    leaves, tree = jax.tree_util.tree_flatten(params)
    ref_leaves, ref_tree = jax.tree_util.tree_flatten(ref)
    assert tree == ref_tree  # same pytree, FP8 leaves included (Fp8Tensor w + scale_inv)
    for a, b in zip(leaves, ref_leaves, strict=True):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    outer, m = _map_of(leaves[0])
    assert isinstance(m, mmap.mmap)
    lo, hi = outer.ctypes.data, outer.ctypes.data + outer.nbytes
    for a in leaves:
        assert _map_of(a)[1] is m and np.shares_memory(a, outer)
        assert lo <= a.ctypes.data and a.ctypes.data + a.nbytes <= hi
        assert a.ctypes.data % ar.PAGE_BYTES == 0 and is_aligned(a) and not a.flags.writeable
    kept, copied = host_params(params)
    # np.asarray makes a new ndarray object over the same bytes: compare addresses, not ids.
    assert copied == 0 and [x.ctypes.data for x in jax.tree_util.tree_leaves(kept)] == [
        a.ctypes.data for a in leaves
    ]
    cpu = jax.devices("cpu")[0]
    for a in leaves[:8]:
        assert jax.device_put(a, cpu).unsafe_buffer_pointer() == a.ctypes.data  # zero-copy


def test_conversion_is_cached_and_a_changed_source_invalidates_it(ckpt, tmp_path, cache):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(ckpt, src)
    first = ar.ensure_arena(src, progress=False)
    stat = (first / ar.DATA_NAME).stat()
    assert first.parent == cache / "arenas"
    assert ar.ensure_arena(src, progress=False) == first
    again = (first / ar.DATA_NAME).stat()
    assert (again.st_ino, again.st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)  # not rewritten
    w = src / "model.safetensors"
    os.utime(w, ns=(w.stat().st_atime_ns, w.stat().st_mtime_ns + 10**9))
    second = ar.ensure_arena(src, progress=False)
    assert second != first and ar.is_arena(second)
    assert not first.exists()  # the stale arena of the same source is removed
    other = ar.ensure_arena(src, cache_root=tmp_path / "elsewhere", progress=False)
    assert other.parent == tmp_path / "elsewhere"


def test_loader_and_cli_entry_points(ckpt, tmp_path, cache):
    from hmoe_jax.cli import main

    def mapped_bytes(params):  # size of the file the first leaf (the embedding) is a view of
        return _map_of(jax.tree_util.tree_leaves(params)[0])[0].nbytes

    # The default for a safetensors directory: converted into the cached arena, mapped from it.
    cfg, p = load_checkpoint(ckpt, progress=False)
    path = ar.ensure_arena(ckpt, progress=False)
    assert path.parent == cache / "arenas"
    assert mapped_bytes(p) == (path / ar.DATA_NAME).stat().st_size
    alt = tmp_path / "alt"
    _, p2 = load_checkpoint(ckpt, progress=False, arena_dir=alt)  # the API's own override
    assert [d.parent for d in alt.iterdir() if ar.is_arena(d)] == [alt]
    assert mapped_bytes(p2) == mapped_bytes(p)
    out = tmp_path / "cli_arena"
    assert (
        main(["convert", "--checkpoint", str(ckpt), "--out", str(out), "--format", "arena", "--quiet"]) == 0
    )
    assert (out / "tokenizer.json").exists() == (ckpt / "tokenizer.json").exists()
    cfg2, q = load_checkpoint(out, progress=False)  # an arena directory given directly
    assert cfg2 == cfg
    for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q), strict=True):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
    assert (
        main(["convert", "--checkpoint", str(ckpt), "--out", str(out), "--format", "arena", "--quiet"]) == 0
    )


def _edit_index(path, fn):
    p = path / ar.ARENA_INDEX
    meta = json.loads(p.read_text())
    fn(meta)
    p.write_text(json.dumps(meta))


def test_bad_arenas_fail_with_clear_errors(ckpt, tmp_path):
    good = ar.write_arena(ckpt, tmp_path / "good", progress=False)
    cfg, _ = ar.load_arena(good, progress=False)

    def fresh(name):
        import shutil

        return shutil.copytree(good, tmp_path / name)

    with pytest.raises(ar.ArenaError, match="not an arena"):
        ar.load_arena(ckpt, progress=False)
    d = fresh("missing")
    (d / ar.DATA_NAME).unlink()
    with pytest.raises(ar.ArenaError, match="arena data file not found"):
        ar.load_arena(d, progress=False)
    d = fresh("truncated")
    size = (d / ar.DATA_NAME).stat().st_size
    os.truncate(d / ar.DATA_NAME, size // 2)
    with pytest.raises(ar.ArenaError, match=rf"{size // 2} bytes, the index needs {size} \(truncated\)"):
        ar.load_arena(d, progress=False)
    d = fresh("version")
    _edit_index(d, lambda m: m.update(version=99))
    with pytest.raises(
        ar.ArenaError, match=f"version 99, this build reads 'hmoe-arena' version {ar.VERSION}"
    ):
        ar.load_arena(d, progress=False)
    d = fresh("corrupt")
    leaf = next(e for e in json.loads((d / ar.ARENA_INDEX).read_text())["leaves"] if ".experts." in e["name"])
    with open(d / ar.DATA_NAME, "r+b") as f:
        f.seek(leaf["offset"] + leaf["nbytes"] // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    ar.load_arena(d, progress=False)  # without verification the bytes are not read
    with pytest.raises(ar.ArenaError, match=rf"leaf '{leaf['name']}' .* fails its crc32 check"):
        ar.load_arena(d, verify=True, progress=False)
    d = fresh("config")
    _edit_index(d, lambda m: m["config"].update(moe_intermediate_size=64))
    with pytest.raises(ar.ArenaError, match=r"experts\.gate_proj\.weight' has shape .* \(config mismatch\)"):
        ar.load_arena(d, progress=False)
    other = dataclasses.replace(cfg, rms_norm_eps=1e-5)
    with pytest.raises(ar.ArenaError, match=r"differs from the expected one in \['rms_norm_eps'\]"):
        ar.load_arena(good, cfg=other, progress=False)
    with pytest.raises(ar.ArenaError, match="is not an arena; refusing to replace it"):
        ar.write_arena(ckpt, ckpt.parent, progress=False)


_CHILD = textwrap.dedent(
    """
    import sys, numpy as np, jax
    from hmoe_jax.io.arena import load_arena
    _, params = load_arena(sys.argv[1], progress=False)
    total = sum(int(x.view(np.uint8).sum(dtype=np.uint64)) for x in jax.tree_util.tree_leaves(params))
    print("ready", total, flush=True)
    sys.stdin.read()  # hold the mapping until the parent closes our stdin
    """
)


def test_two_processes_share_the_pages(tmp_path):
    if not os.access(f"/proc/{os.getpid()}/smaps", os.R_OK):
        pytest.skip("/proc/<pid>/smaps is not readable here")
    # 2 dense + 1 MoE layer with wide experts: ~80 MB of f32/bf16 weights.
    base = named_model_config("deepseek_v3_tiny")
    cfg = dataclasses.replace(base, num_hidden_layers=3, moe_intermediate_size=1536, quant=None)
    path = ar.write_arena(synthetic_params(cfg, seed=1), tmp_path / "big", cfg=cfg, progress=False)
    data = os.path.realpath(path / ar.DATA_NAME)
    size_kb = os.path.getsize(data) / 1024
    assert size_kb >= 64 * 1024
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    kids = [
        subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    try:
        sums = [k.stdout.readline().split() for k in kids]
        assert [s[0] for s in sums] == ["ready", "ready"] and sums[0][1] == sums[1][1], sums
        use = [ar.mapped_kb(k.pid, data) for k in kids]
    finally:
        for k in kids:
            k.stdin.close()
        for k in kids:
            k.wait(timeout=60)
    for u in use:
        assert u["Rss"] >= 0.95 * size_kb, (use, size_kb)  # each really mapped all of it
    pss_ratio = sum(u["Pss"] for u in use) / size_kb
    assert pss_ratio <= 1.1, (use, size_kb)  # ... and the pair holds ONE copy
    print(
        f"arena {size_kb / 1024:.0f} MiB, Rss {[u['Rss'] for u in use]} kB, pair Pss / size {pss_ratio:.3f}"
    )
