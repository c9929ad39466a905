"""The embedded default checkpoint (deterministic synthetic FP8 weights, cached once) and
the loader against the REAL DeepSeek-V3 / Kimi-K2 tensor inventories (header-level: names,
shapes, FP8 scale grids incl. partial edge blocks, the MTP layer), without their data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from hmoe_jax.config import named_model_config
from hmoe_jax.io.errors import CheckpointError
from hmoe_jax.io.format import Catalog, validate
from hmoe_jax.io.names import expected_tensors
from hmoe_jax.io.safetensors_io import SafetensorsFile, TensorInfo
from hmoe_jax.io.synthetic import cache_root, ensure_default_checkpoint
from hmoe_jax.quant.fp8 import Fp8Tensor, dequantize_np, scale_grid_shape


def test_default_checkpoint_is_deterministic_and_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HMOE_CACHE", str(tmp_path / "a"))
    assert cache_root() == tmp_path / "a"
    a = ensure_default_checkpoint()
    assert "creating the embedded default checkpoint" in capsys.readouterr().err
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_default_checkpoint() == a  # second call: no rewrite, no message
    assert (a / "model.safetensors").stat().st_mtime_ns == mtime and capsys.readouterr().err == ""
    monkeypatch.setenv("HMOE_CACHE", str(tmp_path / "b"))
    b = ensure_default_checkpoint(progress=False)
    assert a.name == b.name and a.name.startswith("deepseek_v3_tiny-")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert not [p for p in (tmp_path / "a").iterdir() if p.name.startswith(".tmp")]
    # DeepSeek's release format: FP8 experts/attention with scales, bf16 embed, f32 bias.
    cfg = json.loads((a / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "fp8"
    f = SafetensorsFile(a / "model.safetensors")
    assert f.tensors["model.layers.2.mlp.experts.0.gate_proj.weight"].dtype == "F8_E4M3"
    assert f.tensors["model.layers.2.mlp.experts.0.gate_proj.weight_scale_inv"].dtype == "F32"
    assert f.tensors["model.embed_tokens.weight"].dtype == "BF16"
    assert f.tensors["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == "F32"
    up = "model.layers.2.mlp.experts.0.up_proj.weight"
    w = dequantize_np(Fp8Tensor(w=f.tensor(up), scale_inv=f.tensor(up + "_scale_inv")))
    assert 0.5 < w.std() * np.sqrt(w.shape[1]) < 2.0  # N(0, 1/fan_in) survives FP8


class _HeaderOnly(SafetensorsFile):
    """A parsed header without a file: enough for validate(), which reads no data."""

    def __init__(self, tensors: dict[str, TensorInfo]):
        self.tensors, self.metadata, self.data_start, self._mm = tensors, {}, 0, None


def _release_catalog(cfg, mtp_layers: int = 1, drop: str | None = None, grid_fix=None) -> Catalog:
    """The tensor inventory DeepSeek's FP8 release has for cfg, including its MTP layer."""
    tensors: dict[str, TensorInfo] = {}

    def add(name, tag, shape):
        tensors[name] = TensorInfo(name, tag, tuple(shape), 0, 0)

    for s in expected_tensors(cfg):
        if s.quantized:
            add(s.name, "F8_E4M3", s.shape)
            add(s.name + "_scale_inv", "F32", (grid_fix or scale_grid_shape)(s.shape))
        else:
            add(s.name, "F32" if s.name.endswith("bias") else "BF16", s.shape)
    d = cfg.hidden_size
    for k in range(mtp_layers):  # model.layers.{L}: enorm, hnorm, eh_proj, shared_head + a layer
        p = f"model.layers.{cfg.num_hidden_layers + k}"
        add(f"{p}.enorm.weight", "BF16", (d,))
        add(f"{p}.hnorm.weight", "BF16", (d,))
        add(f"{p}.eh_proj.weight", "BF16", (d, 2 * d))
        add(f"{p}.shared_head.head.weight", "BF16", (cfg.vocab_size, d))
        add(f"{p}.mlp.experts.0.gate_proj.weight", "F8_E4M3", (cfg.moe_intermediate_size, d))
    if drop:
        del tensors[drop]
    f = _HeaderOnly(tensors)
    where = dict.fromkeys(tensors, "model.safetensors")
    return Catalog(root=Path("/release"), files={"model.safetensors": f}, where=where, unused=[])


@pytest.mark.parametrize("name", ["deepseek_v3", "kimi_k2"])
def test_real_release_inventory_validates(name):
    cfg = named_model_config(name)
    cat = _release_catalog(cfg)
    specs = validate(cfg, cat)
    assert len(specs) == len(expected_tensors(cfg))
    assert cat.unused and all(t.startswith(f"model.layers.{cfg.num_hidden_layers}.") for t in cat.unused)
    if name == "deepseek_v3":  # kv_a_proj_with_mqa [576, 7168]: 4.5 row blocks -> 5 x 56
        kv_a = cat.info("model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv")
        assert kv_a.shape == (5, 56)
        assert sum(s.name.endswith("experts.255.down_proj.weight") for s in specs) == 58


def test_real_release_floor_division_grid_is_rejected():
    """A writer that floors the grid (576 // 128 = 4 rows) instead of ceiling it."""
    cfg = named_model_config("deepseek_v3")
    cat = _release_catalog(cfg, grid_fix=lambda s: (*s[:-2], s[-2] // 128, s[-1] // 128))
    with pytest.raises(
        CheckpointError, match=r"kv_a_proj_with_mqa.weight_scale_inv' has shape \[4, 56\], expected \[5, 56\]"
    ):
        validate(cfg, cat)
