"""What a plan runs against: the placed weights and the per-layer latent cache."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.model import KVCache
from hmoe_jax.model.params import ExpertsParams, ModelParams
from hmoe_jax.runtime import placement as P


@dataclasses.dataclass
class PlacedWeights:
    """One host copy of everything; non-expert weights placed on the first accelerator."""

    cfg: ModelConfig
    placement: P.Placement
    host: ModelParams  # every leaf: aligned host numpy (the one copy)
    acc: ModelParams  # routed experts removed, the rest on placement.acc
    host_experts: list[ExpertsParams | None]  # per layer, numpy (SLP streams these)
    host_experts_dev: list[ExpertsParams | None]  # the same buffers as host-device jax arrays
    host_copied_bytes: int = 0  # bytes host_params had to re-align (0 for an aligned arena)
    _acc_full: ModelParams | None = None

    @staticmethod
    def place(params: ModelParams, cfg: ModelConfig, placement: P.Placement) -> PlacedWeights:
        host, copied = P.host_params(params)
        rest, experts = P.split_experts(host)
        acc = P.put(rest, placement.acc)
        experts_dev = [None if e is None else P.put(e, placement.host) for e in experts]
        return PlacedWeights(cfg, placement, host, acc, experts, experts_dev, copied)

    def acc_full(self) -> ModelParams:
        """All weights on the accelerator (the reference schedule; zero-copy on stand-ins,
        a full VRAM copy on a GPU, so only for models that fit)."""
        if self._acc_full is None:
            self._acc_full = P.put(self.host, self.placement.acc)
        return self._acc_full


@dataclasses.dataclass
class LayerCache:
    """The MLA latent cache as one array per layer on the accelerator, so a layer's
    attention updates its own buffer in place (donated) instead of the stacked [L, ...]."""

    latent: list[jax.Array]  # L x [B, S_max, kv_lora_rank]
    rope: list[jax.Array]  # L x [B, S_max, qk_rope_head_dim]

    @staticmethod
    def zeros(cfg: ModelConfig, batch: int, max_len: int, device: jax.Device) -> LayerCache:
        with jax.default_device(device):
            lat = [
                jnp.zeros((batch, max_len, cfg.kv_lora_rank), jnp.float32)
                for _ in range(cfg.num_hidden_layers)
            ]
            rope = [
                jnp.zeros((batch, max_len, cfg.qk_rope_head_dim), jnp.float32)
                for _ in range(cfg.num_hidden_layers)
            ]
        return LayerCache(lat, rope)

    @property
    def max_len(self) -> int:
        return int(self.latent[0].shape[1])

    def to_kvcache(self) -> KVCache:
        return KVCache(latent=jnp.stack(self.latent), k_rope=jnp.stack(self.rope))

    @staticmethod
    def from_kvcache(c: KVCache) -> LayerCache:
        return LayerCache(list(c.latent), list(c.k_rope))
