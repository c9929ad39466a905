"""The shipped model's architecture and training recipe (one place, so the trained
default, the reproduction test and docs/training.md agree).

The model is DeepSeek-V3's architecture at a few million parameters: MLA with q/kv LoRA and
decoupled RoPE (YaRN), one dense layer then MoE layers with one shared expert and 16 routed
experts (4 groups, keep 2, top-4, sigmoid scores, normalised, x2.5), aux-loss-free balancing
through `e_score_correction_bias`. Sizes are picked so that training fits in ~20 minutes on
2 CPU cores (the routed experts run densely in training: `loop.experts_dense`, exact but 4x the
routed FLOPs of top-4 of 16).
"""

from __future__ import annotations

import dataclasses

from hmoe_jax.config import ModelConfig, config_from_dict

MODEL_NAME = "deepseek_v3_stdlib"

MODEL_CONFIG = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 768,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "moe_layer_freq": 1,
    "hidden_act": "silu",
    "attention_bias": False,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,  # serving limit; the rope (YaRN over 256) does not use it
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 4,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "bos_token_id": 0,
    "eos_token_id": 1,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
}


@dataclasses.dataclass(frozen=True)
class Recipe:
    seed: int = 0
    steps: int = 500
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    init_std: float = 0.02
    # bias += gamma * sign(mean load - load_e) per step. DeepSeek-V3 uses 1e-3 over ~10^5 steps;
    # in 500 steps that moves a bias by at most 0.5, and in one layer one expert took every token
    # (max/mean load 4.0 = E/k at step 200 of a run with 1e-3), so 1e-2 here.
    bias_update_speed: float = 1e-2
    eval_every: int = 100
    eval_windows: int = 64
    heldout_per_mille: int = 50  # 5% of files held out
    vocab_size: int = 2048

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len


def model_config(vocab_size: int = 2048, **overrides) -> ModelConfig:
    raw = dict(MODEL_CONFIG, vocab_size=vocab_size, **overrides)
    return config_from_dict(raw, where=MODEL_NAME)
