"""The latent KV cache of many sequences: a pool of fixed-length rows on the accelerator.

Design (slots, not pages): each MoE/dense layer has one array latent [rows, max_len, R] and
one rope [rows, max_len, dr]; a request owns one row from admission to finish, and its
tokens sit at positions 0..len-1 of that row. Attention takes the rows and per-row
positions of a step, so sequences at different lengths decode together, and reads only
a row's valid prefix (model/attention.py). Why slots: static shapes (one compiled step
per batch size and prefix bucket), no page table to gather through, and the in-place
donated updates XLA does well. The price is internal fragmentation: a row reserves
max_len tokens whatever the request uses; a paged pool would share that memory (left for
the serving work, which knows the request mix).

Sized from a byte budget (`rows_for_budget`); `alloc` raises PoolExhausted naming the
numbers when no row is free or a request needs more than max_len tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hmoe_jax.config import ModelConfig
from hmoe_jax.model.model import KVCache
from hmoe_jax.plan.buckets import cache_len


class PoolExhausted(RuntimeError):
    pass


@functools.partial(jax.jit, donate_argnums=0)
def _write_row(dst: jax.Array, src: jax.Array, row: jax.Array) -> jax.Array:
    """dst [rows, S, D] with src [s, D] (s <= S) written at [row, :s] (dst donated: in place)."""
    return jax.lax.dynamic_update_slice(dst, src[None].astype(dst.dtype), (row, 0, 0))


def bytes_per_row(cfg: ModelConfig, max_len: int, dtype: Any) -> int:
    return cfg.num_hidden_layers * max_len * cfg.cache_dim * np.dtype(dtype).itemsize


def rows_for_budget(cfg: ModelConfig, budget_bytes: int, max_len: int, dtype: Any) -> int:
    return int(budget_bytes // bytes_per_row(cfg, cache_len(max_len), dtype))


@dataclasses.dataclass
class KVPool:
    cfg: ModelConfig
    latent: list[jax.Array]  # L x [rows, max_len, kv_lora_rank]
    rope: list[jax.Array]  # L x [rows, max_len, qk_rope_head_dim]
    free_rows: list[int] = dataclasses.field(default_factory=list)
    lengths: dict[int, int] = dataclasses.field(default_factory=dict)  # row -> tokens reserved

    @staticmethod
    def create(
        cfg: ModelConfig, rows: int, max_len: int, device: jax.Device, dtype: Any = jnp.bfloat16
    ) -> KVPool:
        if rows < 1:
            raise PoolExhausted(f"KV pool: rows={rows} must be >= 1 (budget too small for one row?)")
        s = cache_len(max_len)
        # Made on `device` (committed; not under default_device, which leaves them
        # uncommitted): the plan's jitted pieces return committed caches, and an uncommitted
        # first cache made every piece that takes it compile a second time on the second
        # prefill (~0.8 s per piece on the bench twin).
        lat = [
            jnp.zeros((rows, s, cfg.kv_lora_rank), dtype, device=device) for _ in range(cfg.num_hidden_layers)
        ]
        rope = [
            jnp.zeros((rows, s, cfg.qk_rope_head_dim), dtype, device=device)
            for _ in range(cfg.num_hidden_layers)
        ]
        return KVPool(cfg, lat, rope, list(range(rows)))

    @property
    def rows(self) -> int:
        return int(self.latent[0].shape[0])

    @property
    def max_len(self) -> int:
        return int(self.latent[0].shape[1])

    @property
    def dtype(self) -> Any:
        return self.latent[0].dtype

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in (*self.latent, *self.rope))

    @property
    def in_use(self) -> int:
        return self.rows - len(self.free_rows)

    def alloc(self, tokens: int) -> int:
        """A free row for a sequence of up to `tokens` tokens (prompt + new)."""
        if tokens > self.max_len:
            raise PoolExhausted(
                f"KV pool: a sequence of {tokens} tokens (prompt + max new tokens) exceeds the pool's "
                f"row length of {self.max_len} tokens"
            )
        if not self.free_rows:
            row_mb = bytes_per_row(self.cfg, self.max_len, self.dtype) / 2**20
            raise PoolExhausted(
                f"KV pool exhausted: all {self.rows} rows in use ({self.max_len} tokens, {row_mb:.1f} MiB each); "
                "finish or cancel a sequence, or give the pool a larger byte budget"
            )
        row = self.free_rows.pop(0)
        self.lengths[row] = int(tokens)
        return row

    def free(self, row: int) -> None:
        if row not in self.lengths:
            raise ValueError(f"KV pool: row {row} is not allocated")
        del self.lengths[row]
        self.free_rows.append(row)
        self.free_rows.sort()

    def row_cache(self, row: int) -> KVCache:
        """One row as a model.KVCache [L, 1, max_len, ...] (a copy; the reference schedule)."""
        return KVCache(
            latent=jnp.stack([a[row : row + 1] for a in self.latent]),
            k_rope=jnp.stack([a[row : row + 1] for a in self.rope]),
        )

    def set_row(self, row: int, c: KVCache) -> None:
        for i in range(len(self.latent)):
            self.latent[i] = self.latent[i].at[row].set(c.latent[i, 0].astype(self.dtype))
            self.rope[i] = self.rope[i].at[row].set(c.k_rope[i, 0].astype(self.dtype))

    def copy_in(self, row: int, src: KVPool, src_row: int = 0) -> int:
        """Write src's row `src_row` (another pool, e.g. a prefill on another accelerator)
        into this pool's row `row`, moving it to this pool's device; returns bytes moved.
        The whole source row is copied (its unused tail is zeros, masked by attention)."""
        if src.max_len > self.max_len or len(src.latent) != len(self.latent):
            raise ValueError(
                f"KV pool: cannot copy a {len(src.latent)}-layer row of {src.max_len} tokens into "
                f"{len(self.latent)} layers of {self.max_len}"
            )
        dev = next(iter(self.latent[0].devices()))
        r = np.int32(row)
        moved = 0
        for i in range(len(self.latent)):
            lat, rope = jax.device_put((src.latent[i][src_row], src.rope[i][src_row]), dev)
            self.latent[i] = _write_row(self.latent[i], lat, r)
            self.rope[i] = _write_row(self.rope[i], rope, r)
            moved += int(lat.nbytes + rope.nbytes)
        return moved

    def to_kvcache(self) -> KVCache:
        """All rows as a model.KVCache [L, rows, max_len, ...] (tests)."""
        return KVCache(latent=jnp.stack(self.latent), k_rope=jnp.stack(self.rope))
