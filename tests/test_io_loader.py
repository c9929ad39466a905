"""Checkpoint loader and writer: round trips (f32, bf16, f16, FP8, sharded) against the
params they were written from, the FP8 format against quantize_np (the reference), the
single-copy layout (every leaf a page-aligned view of the cached arena's map, experts
included), the MTP-skip note, and
every bad-input case with its one-line message."""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest

from hmoe_jax.config import ConfigError, named_model_config
from hmoe_jax.io.errors import CheckpointError
from hmoe_jax.io.loader import load_checkpoint
from hmoe_jax.io.names import expected_tensors, flatten_params
from hmoe_jax.io.safetensors_io import SafetensorsFile, save_arrays
from hmoe_jax.io.synthetic import synthetic_params
from hmoe_jax.io.writer import convert_checkpoint, save_checkpoint
from hmoe_jax.quant.fp8 import Fp8Tensor, quantize_np, scale_grid_shape

BF16 = np.dtype(ml_dtypes.bfloat16)
# 2 dense + 1 MoE layer of the DeepSeek-V3 twin; kv_a_proj_with_mqa is [144, 256]: a
# partial 128-row edge block, like the real [576, 7168].
CFG = dataclasses.replace(named_model_config("deepseek_v3_tiny"), num_hidden_layers=3, quant=None)


def _f32_params(cfg=CFG):
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), synthetic_params(cfg, seed=3))


@pytest.fixture(scope="module")
def src():
    return _f32_params()


@pytest.fixture(scope="module")
def f32_dir(tmp_path_factory, src):
    d = tmp_path_factory.mktemp("f32")
    save_checkpoint(d, CFG, src)
    return d


def _names(cfg, params):
    return flatten_params(cfg, params)


def _is_memmap_backed(a) -> bool:
    while a is not None:
        if isinstance(a, np.memmap):
            return True
        a = getattr(a, "base", None)
    return False


def _expert_leaves(params):
    for lp in params.layers:
        ex = getattr(lp.ffn, "experts", None)
        if ex is not None:
            yield from (ex.gate, ex.up, ex.down)


def test_f32_roundtrip_and_lazy_layout(f32_dir, src):
    cfg, params = load_checkpoint(f32_dir, progress=False)
    assert cfg == CFG
    want, got = _names(CFG, src), _names(cfg, params)
    assert sorted(want) == sorted(got)
    for k in want:
        assert got[k].dtype == np.float32 and np.array_equal(got[k], want[k]), k
    for w in _expert_leaves(params):
        assert w.shape[0] == CFG.n_routed_experts  # stacked [E, ...] as the kernels take them
    for leaf in jax.tree_util.tree_leaves(params):
        # Experts too: a view of the arena file's pages, never an anonymous stacked copy.
        assert _is_memmap_backed(leaf) and not leaf.flags.writeable
        assert leaf.ctypes.data % 4096 == 0 and leaf.flags.c_contiguous
        assert jax.device_put(leaf).unsafe_buffer_pointer() == leaf.ctypes.data  # zero-copy


def test_fp8_format_matches_reference_quantizer(tmp_path, src):
    save_checkpoint(tmp_path, CFG, src, fp8=True)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["quantization_config"]["quant_method"] == "fp8"
    assert raw["quantization_config"]["weight_block_size"] == [128, 128]
    f = SafetensorsFile(tmp_path / "model.safetensors")
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert f.tensors[kv_a].dtype == "F8_E4M3" and f.tensors[kv_a].shape == (144, 256)
    assert f.tensors[kv_a + "_scale_inv"].shape == (2, 2)  # ceil(144/128) x 256/128
    cfg, params = load_checkpoint(tmp_path, progress=False)
    assert cfg.quant is not None
    want = _names(CFG, src)
    got = _names(cfg, params)
    for s in expected_tensors(CFG):
        g = got[s.name]
        if s.quantized:
            ref = quantize_np(want[s.name])
            assert isinstance(g, Fp8Tensor) and g.w.dtype == ml_dtypes.float8_e4m3fn, s.name
            assert np.array_equal(g.w.view(np.uint8), ref.w.view(np.uint8)), s.name
            assert np.array_equal(g.scale_inv, ref.scale_inv), s.name
        else:  # embed, lm_head, norms, router, bias: written exactly as given
            assert not isinstance(g, Fp8Tensor) and np.array_equal(g, want[s.name]), s.name
    for w in _expert_leaves(params):  # FP8 stays FP8: no dequantized copy
        assert isinstance(w, Fp8Tensor) and w.w.dtype == ml_dtypes.float8_e4m3fn
        assert w.w.ctypes.data % 64 == 0 and w.scale_inv.shape == scale_grid_shape(w.w.shape)


def test_sharded_equals_single(tmp_path, f32_dir, src):
    save_checkpoint(tmp_path, CFG, src, shard_bytes=1_000_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == {s.name for s in expected_tensors(CFG)}
    _, one = load_checkpoint(f32_dir, progress=False)
    _, many = load_checkpoint(tmp_path, progress=False)
    a, b = _names(CFG, one), _names(CFG, many)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_bf16_and_f16_inputs(tmp_path, f32_dir, src):
    convert_checkpoint(f32_dir, tmp_path / "bf16", fmt="bf16", shard_bytes=None, progress=False)
    _, p = load_checkpoint(tmp_path / "bf16", progress=False)
    want, got = _names(CFG, src), _names(CFG, p)
    for k in want:
        dt = np.float32 if k.endswith("e_score_correction_bias") else BF16  # bias kept f32
        assert got[k].dtype == dt and np.array_equal(got[k], want[k].astype(dt)), k
    # upcast_f32: non-expert leaves become f32 copies of the bf16 values; experts stay bf16.
    _, up = load_checkpoint(tmp_path / "bf16", progress=False, upcast_f32=True)
    for k, v in _names(CFG, up).items():
        assert v.dtype == (BF16 if ".mlp.experts." in k else np.float32), k
        assert np.array_equal(v, got[k].astype(np.float32)), k
    f16 = jax.tree_util.tree_map(lambda a: a.astype(np.float16), src)
    save_checkpoint(tmp_path / "f16", CFG, f16)
    _, p16 = load_checkpoint(tmp_path / "f16", progress=False)
    for k, v in _names(CFG, p16).items():
        want16 = want[k].astype(np.float16)
        dt = np.float32 if k.endswith("e_score_correction_bias") else np.float16  # upcast, lossless
        assert v.dtype == dt and np.array_equal(v, want16.astype(dt)), k


def test_convert_to_fp8_equals_writer(tmp_path, f32_dir, src, capsys):
    convert_checkpoint(f32_dir, tmp_path / "c", fmt="fp8", shard_bytes=2_000_000, progress=True)
    save_checkpoint(tmp_path / "w", CFG, src, fp8=True)
    assert "converted" in capsys.readouterr().err
    _, a = load_checkpoint(tmp_path / "c", progress=False)
    _, b = load_checkpoint(tmp_path / "w", progress=False)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        assert x.dtype == y.dtype and np.array_equal(
            np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8)
        )


def _rewrite(d, edit):
    """Read every tensor of d/model.safetensors, apply edit(dict), write it back."""
    f = SafetensorsFile(d / "model.safetensors")
    tensors = {k: np.array(f.tensor(k)) for k in f.names()}
    del f
    edit(tensors)
    save_arrays(d / "model.safetensors", tensors)


@pytest.fixture()
def ckpt(tmp_path, src):
    d = tmp_path / "ck"
    save_checkpoint(d, CFG, src, fp8=True)
    return d


def test_mtp_and_rotary_tensors_skipped_with_one_note(ckpt, capsys):
    def add(t):
        t["model.layers.3.eh_proj.weight"] = np.zeros((4, 4), np.float32)  # MTP layer (index 3 = L)
        t["model.layers.3.mlp.experts.0.gate_proj.weight"] = np.zeros((4, 4), ml_dtypes.float8_e4m3fn)
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(8, np.float32)

    _rewrite(ckpt, add)
    load_checkpoint(ckpt, progress=False)
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note:")]
    assert notes == [
        "note: skipping 3 unused tensor(s): layer(s) [3] >= num_hidden_layers=3 (MTP), rotary inv_freq caches"
    ]


KV_A = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
NORM = "model.layers.1.input_layernorm.weight"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.2.mlp.experts.5.up_proj.weight"),
         r"missing tensor 'model.layers.2.mlp.experts.5.up_proj.weight' \(expected shape \[128, 256\]\)"),
        (lambda t: t.update({NORM: np.ones(255, np.float32)}),
         r"model.safetensors: tensor 'model.layers.1.input_layernorm.weight' has shape \[255\], expected \[256\] from config.json"),
        (lambda t: t.update({NORM: np.ones(256, np.int32)}),
         r"tensor 'model.layers.1.input_layernorm.weight' has dtype I32, expected one of \['F32', 'BF16', 'F16'\]"),
        (lambda t: t.update({NORM: np.ones(256, ml_dtypes.float8_e4m3fn)}),
         r"tensor 'model.layers.1.input_layernorm.weight' has dtype F8_E4M3, expected one of \['F32', 'BF16', 'F16'\]"),
        (lambda t: t.pop(KV_A + "_scale_inv"),
         r"FP8 tensor '.*kv_a_proj_with_mqa.weight' has no '.*kv_a_proj_with_mqa.weight_scale_inv' beside it"),
        (lambda t: t.update({KV_A + "_scale_inv": np.ones((1, 2), np.float32)}),
         r"'.*kv_a_proj_with_mqa.weight_scale_inv' has shape \[1, 2\], expected \[2, 2\] \(\[144, 256\] in 128x128 blocks\)"),
        (lambda t: t.update({KV_A + "_scale_inv": np.ones((2, 2), BF16)}),
         r"'.*kv_a_proj_with_mqa.weight_scale_inv' has dtype BF16, expected F32"),
        (lambda t: t.update({"model.layers.1.mlp.experts.0.gate_proj.weight": np.ones((2, 2), np.float32)}),
         r"unexpected tensor 'model.layers.1.mlp.experts.0.gate_proj.weight' \(1 in all\); not part of a deepseek_v3 model"),
    ],
    ids=["missing", "shape", "dtype", "fp8-norm", "no-scale", "scale-grid", "scale-dtype", "unexpected"],
)  # fmt: skip
def test_bad_tensors(ckpt, edit, message):
    _rewrite(ckpt, edit)
    with pytest.raises(CheckpointError, match=message) as e:
        load_checkpoint(ckpt, progress=False)
    assert "\n" not in str(e.value) and str(ckpt) in str(e.value)


def test_fp8_without_quantization_config(ckpt):
    raw = json.loads((ckpt / "config.json").read_text())
    del raw["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"is F8_E4M3 but config.json has no quantization_config"):
        load_checkpoint(ckpt, progress=False)


def test_bad_layouts(tmp_path, src):
    with pytest.raises(CheckpointError, match=r"nowhere: checkpoint directory not found"):
        load_checkpoint(tmp_path / "nowhere", progress=False)
    d = tmp_path / "sharded"
    save_checkpoint(d, CFG, src, shard_bytes=2_000_000)
    shards = sorted(d.glob("model-*.safetensors"))
    assert len(shards) >= 3
    shards[1].unlink()
    with pytest.raises(
        CheckpointError, match=rf"index.json: lists shard '{shards[1].name}', which is not in"
    ):
        load_checkpoint(d, progress=False)
    (d / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(
        CheckpointError, match=r"not a valid index \(expected JSON with a 'weight_map' object"
    ):
        load_checkpoint(d, progress=False)
    (d / "model.safetensors.index.json").unlink()
    with pytest.raises(
        CheckpointError,
        match=rf"expected model.safetensors or model.safetensors.index.json, found {len(shards) - 1}",
    ):
        load_checkpoint(d, progress=False)
    e = tmp_path / "wrongmap"
    save_checkpoint(e, CFG, src, shard_bytes=2_000_000)
    idx = json.loads((e / "model.safetensors.index.json").read_text())
    first = sorted(e.glob("model-*.safetensors"))[0].name
    idx["weight_map"]["model.norm.weight"] = first
    (e / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=rf"maps 'model.norm.weight' to '{first}', but"):
        load_checkpoint(e, progress=False)


def test_truncated_and_config_errors(ckpt):
    path = ckpt / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    with pytest.raises(
        CheckpointError,
        match=r"model.safetensors: tensor '.*' ends at data byte \d+ but the file holds only \d+ data bytes \(truncated\)",
    ):
        load_checkpoint(ckpt, progress=False)
    raw = json.loads((ckpt / "config.json").read_text())
    raw["n_experts_routed"] = 16
    (ckpt / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"config.json: unknown config key\(s\) \['n_experts_routed'\]"):
        load_checkpoint(ckpt, progress=False)


def _anon_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="RssAnon is Linux-only")
def test_loading_reads_no_anonymous_copy(tmp_path):
    """A checkpoint dominated by non-expert bytes (embed + lm_head 2 x 64 MB f32): converting,
    loading and then reading leaves adds no anonymous memory for weights (the experts
    included: the old loader stacked them into anonymous buffers)."""
    cfg = dataclasses.replace(CFG, vocab_size=65536, num_hidden_layers=3)
    params = _f32_params(cfg)
    save_checkpoint(tmp_path, cfg, params)
    del params
    before = _anon_rss_bytes()
    _, loaded = load_checkpoint(tmp_path, progress=False)
    checksum = sum(float(np.asarray(x, np.float32).sum()) for x in (loaded.embed, loaded.lm_head))
    grown = _anon_rss_bytes() - before
    experts = sum(w.nbytes for w in _expert_leaves(loaded))
    big = loaded.embed.nbytes + loaded.lm_head.nbytes
    assert np.isfinite(checksum) and big == 2 * 65536 * 256 * 4
    checksum += sum(float(np.asarray(w).view(np.uint8).sum(dtype=np.uint64)) for w in _expert_leaves(loaded))
    grown = max(grown, _anon_rss_bytes() - before)
    # The astype(float32) temporaries above are freed; a loader that copied the file would
    # grow by >= 128 MB here, one that stacked the experts by `experts` (~1.6 MB x layers).
    assert grown < min(experts, 32 * 2**20), (
        f"anonymous memory grew {grown / 2**20:.1f} MB (experts {experts / 2**20:.1f} MB)"
    )
