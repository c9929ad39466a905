"""Write a trained model the way DeepSeek releases theirs: block-FP8 safetensors (bf16
embed / lm_head / norms / router, f32 score-correction bias) + config.json, beside a bf16
master copy; tokenizer.json / tokenizer_config.json and the training record go with both."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np

from hmoe_jax.config import ModelConfig, QuantConfig
from hmoe_jax.io.writer import save_checkpoint
from hmoe_jax.model.params import ModelParams, MoEParams

BF16 = np.dtype(ml_dtypes.bfloat16)
RECORD_FILE = "train_record.json"


def bf16_master(params: ModelParams) -> ModelParams:
    """numpy leaves: bf16, except each router's e_score_correction_bias (f32, as released)."""
    host = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
    cast = jax.tree_util.tree_map(lambda x: x.astype(BF16), host)
    layers = []
    for ly, orig in zip(cast.layers, host.layers):
        if isinstance(ly.ffn, MoEParams):
            ly = ly.replace(ffn=ly.ffn.replace(router_bias=orig.ffn.router_bias))
        layers.append(ly)
    return cast.replace(layers=tuple(layers))


def export(
    params: ModelParams, cfg: ModelConfig, tok, record: dict, fp8_dir: Path, bf16_dir: Path | None
) -> None:
    """FP8 checkpoint into fp8_dir (quantized from the bf16 master, as DeepSeek's FP8 release
    derives from its bf16 weights); the bf16 master into bf16_dir when given."""
    from hmoe_jax.train.data import save_tokenizer

    master = bf16_master(params)
    fp8_cfg = dataclasses.replace(cfg, quant=cfg.quant or QuantConfig())
    targets = [(Path(fp8_dir), fp8_cfg, True)]
    if bf16_dir is not None:
        targets.append((Path(bf16_dir), dataclasses.replace(cfg, quant=None), False))
    for out, c, fp8 in targets:
        save_checkpoint(out, c, master, fp8=fp8)
        save_tokenizer(tok, out)
        (out / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
