"""FP8: an f32 HF checkpoint converted by OUR writer (`hmoe convert --format fp8`), loaded by
us (FP8 leaves, dequantized inside the forward) and by HF transformers (which dequantizes
the same e4m3 codes x float32 scales to float32 weights on CPU).

Tolerance: both sides multiply the same e4m3 value by the same f32 scale in f32, so the
dequantized weights are bit-identical (checked below); what remains is f32 accumulation
order, the same as the f32 parity tests: max abs err <= 1e-4 x max |logit|. Every matrix
has dims that are multiples of 128, because HF infers the block size from the scale grid
(shared/NOTES.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hmoe_jax.cli import main
from hmoe_jax.io.loader import load_checkpoint
from hmoe_jax.quant.fp8 import Fp8Tensor, dequantize_np
from tests.hf_ref import build_hf_model, hf_logits, tiny_config

pytest.importorskip("accelerate", reason="HF loads FP8 checkpoints only with accelerate (test extra)")

# kv_a [256, 256], q_b [2*(64+128), 128] = [384, 128], kv_b [256, 128], o [256, 128]:
# every FP8 matrix is whole 128x128 blocks.
CFG = tiny_config(
    "deepseek_v3_tiny",
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    qk_nope_head_dim=64,
    qk_rope_head_dim=128,
    v_head_dim=64,
    kv_lora_rank=128,
    q_lora_rank=128,
)


def test_fp8_checkpoint_matches_hf(tmp_path, capsys):
    from transformers import DeepseekV3ForCausalLM

    model, _ = build_hf_model(CFG, seed=7)
    model.save_pretrained(tmp_path / "f32")
    assert (
        main(["convert", "--checkpoint", str(tmp_path / "f32"), "--out", str(tmp_path / "fp8"), "--quiet"])
        == 0
    )
    hf8, info = DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "fp8", dtype=torch.float32, output_loading_info=True
    )
    hf8.eval()
    hf8.config._attn_implementation = "eager"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info

    cfg, params = load_checkpoint(tmp_path / "fp8", progress=False)
    # Same weights on both sides: HF's dequantized q_b and routed experts vs ours.
    q_b = params.layers[0].attn.q_b
    assert isinstance(q_b, Fp8Tensor)
    hf_q_b = hf8.model.layers[0].self_attn.q_b_proj.weight.detach().numpy()
    assert np.array_equal(hf_q_b, dequantize_np(q_b))
    ex = params.layers[2].ffn.experts
    hf_gate_up = hf8.model.layers[2].mlp.experts.gate_up_proj.detach().numpy()  # [E, 2I, D]
    assert np.array_equal(hf_gate_up[:, : CFG.moe_intermediate_size], dequantize_np(ex.gate))

    ids = [int(t) for t in np.random.default_rng(8).integers(0, CFG.vocab_size, size=20)]
    out = tmp_path / "logits.npy"
    assert (
        main(
            [
                "logits",
                "--checkpoint",
                str(tmp_path / "fp8"),
                "--tokens",
                ",".join(map(str, ids)),
                "--out",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    ours = np.load(out)
    ref = hf_logits(hf8, np.asarray([ids]))[0]
    tol = 1e-4 * np.abs(ref).max()
    err = np.abs(ours - ref).max()
    assert err <= tol, f"FP8: max abs err {err:.3g} > {tol:.3g}"
    # The test would notice a writer that forgot to quantize: FP8 moves logits far more.
    f32_ref = hf_logits(model, np.asarray([ids]))[0]
    assert np.abs(f32_ref - ref).max() > 100 * tol
