"""Bytes and FLOPs of the model's pieces, for plans and for the SLP ring policy.
FLOPs count a multiply-add as 2. Weight bytes are as stored (FP8: 1 byte/weight plus the
f32 block scales; f32 models: 4 bytes/weight)."""

from __future__ import annotations

from hmoe_jax.config import ModelConfig


def _w_bytes(cfg: ModelConfig, n: int, k: int) -> int:
    if cfg.quant is None:
        return 4 * n * k
    q = cfg.quant
    return n * k + 4 * (-(-n // q.block_n)) * (-(-k // q.block_k))


def expert_bytes(cfg: ModelConfig) -> int:
    """One routed expert: gate, up [I, D] and down [D, I]."""
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    return 2 * _w_bytes(cfg, i, d) + _w_bytes(cfg, d, i)


def shared_bytes(cfg: ModelConfig) -> int:
    d, i = cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts
    return 0 if not cfg.n_shared_experts else 2 * _w_bytes(cfg, i, d) + _w_bytes(cfg, d, i)


def expert_flops(cfg: ModelConfig, rows: int) -> int:
    """`rows` token-expert assignments through one expert's SwiGLU."""
    return 2 * rows * 3 * cfg.hidden_size * cfg.moe_intermediate_size


def dense_ffn_flops(cfg: ModelConfig, tokens: int) -> int:
    return 2 * tokens * 3 * cfg.hidden_size * cfg.intermediate_size


def shared_flops(cfg: ModelConfig, tokens: int) -> int:
    return 2 * tokens * 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.n_shared_experts


def attn_flops(cfg: ModelConfig, tokens: int, start_pos: int = 0) -> int:
    """MLA projections plus causal attention over the (latent-expanded) keys."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    qk, v, r = cfg.qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        proj = d * h * qk
    else:
        proj = d * cfg.q_lora_rank + cfg.q_lora_rank * h * qk
    proj += d * cfg.cache_dim + r * h * (cfg.qk_nope_head_dim + v) + h * v * d
    # average causal context per query token
    ctx = start_pos + (tokens + 1) / 2
    core = h * (qk + v) * ctx
    return int(2 * tokens * (proj + core))


def router_flops(cfg: ModelConfig, tokens: int) -> int:
    return 2 * tokens * cfg.hidden_size * cfg.n_routed_experts


def lm_head_flops(cfg: ModelConfig, tokens: int) -> int:
    return 2 * tokens * cfg.hidden_size * cfg.vocab_size


def hidden_bytes(cfg: ModelConfig, tokens: int) -> int:
    """f32 hidden states of `tokens` tokens."""
    return 4 * tokens * cfg.hidden_size


def route_bytes(cfg: ModelConfig, tokens: int) -> int:
    """ids (int32) + weights (f32) of `tokens` tokens."""
    return 8 * tokens * cfg.num_experts_per_tok


def _stored_bytes(cfg: ModelConfig, shape: tuple[int, ...], quantized: bool) -> int:
    """A checkpoint tensor's bytes as placed: quantized matrices FP8 + f32 block scales
    (_w_bytes), everything else f32."""
    if quantized and cfg.quant is not None:
        return _w_bytes(cfg, *shape)
    n = 1
    for s in shape:
        n *= int(s)
    return 4 * n


def layer_rest_bytes(cfg: ModelConfig, layer: int) -> int:
    """Bytes of a layer's non-expert weights as stored (FP8 + f32 scales for quantized
    tensors, f32 for the rest): what dslp streams to every rank per layer."""
    from hmoe_jax.plan.tensors import expected_tensors

    prefix = f"model.layers.{layer}."
    return sum(
        _stored_bytes(cfg, s.shape, s.quantized)
        for s in expected_tensors(cfg)
        if s.name.startswith(prefix) and ".mlp.experts." not in s.name
    )


# Sub-array alignment inside a staging-ring slot (>= 64 for zero-copy device_put on CPU);
# runtime/staging.py lays slots out with this value.
SLOT_ALIGN_BYTES = 256


def slot_bytes(cfg: ModelConfig, experts_per_slot: int) -> int:
    """Bytes of one ring slot holding `experts_per_slot` routed experts, laid out as
    runtime/staging.slot_layout does: each stacked array (w and scale of gate, up, down)
    rounded up to SLOT_ALIGN_BYTES."""
    d, i = cfg.hidden_size, cfg.moe_intermediate_size
    arrays: list[int] = []
    for n, k in ((i, d), (i, d), (d, i)):
        if cfg.quant is None:
            arrays.append(4 * n * k)
        else:
            q = cfg.quant
            arrays += [n * k, 4 * (-(-n // q.block_n)) * (-(-k // q.block_k))]
    a = SLOT_ALIGN_BYTES
    return sum(-(-(b * experts_per_slot) // a) * a for b in arrays)
