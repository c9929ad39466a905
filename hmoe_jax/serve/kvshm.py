"""KV handover between OS processes through POSIX shared memory (multiprocessing.shared_memory).

A finished prefill's latent cache is the per-layer prefix [:T] of its pool row: latent
[T, kv_lora_rank] and rope [T, qk_rope_head_dim], in the pool dtype (bf16 serving, f32 with
the f32 policy). The prefill process copies it into ONE segment (layer by layer, latent
then rope), closes its mapping and passes the segment's name over a pipe; the decode
process maps it, writes it into a row of its own pool and unlinks it.

Who unlinks: the adopter, right after the copy (import_prefix), or whoever learns that
nobody will adopt it (discard: a cancelled request, a dead worker). Segment names are
chosen by the coordinator (segment_name), so it can discard a segment by name even when
the process that created it died before saying so.

Resource tracker: the workers are separate interpreters, each with its own tracker. The
creator unregisters its segment at once (the segment outlives the creator by design: it is
the adopter's to unlink); attaching registers and unlink unregisters, so the adopter's and
the discarder's tables stay balanced. A segment nobody unlinked (the coordinator itself
killed) is found by its prefix (leftover_segments) and removed by the next coordinator's
close (discard_all).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from multiprocessing import resource_tracker, shared_memory

import jax
import jax.numpy as jnp
import numpy as np

from hmoe_jax.plan.buckets import cache_len
from hmoe_jax.runtime.kvpool import KVPool

SHM_DIR = "/dev/shm"  # where Linux keeps POSIX shm segments (leftover checks)
SEGMENT_PREFIX = "hmoe_kv"


def segment_name(tag: str, rid: int) -> str:
    """The segment of request `rid` of the coordinator `tag` (its pid and a counter: two
    coordinators on one host never collide). POSIX names allow ~250 bytes; keep it short."""
    return f"{SEGMENT_PREFIX}_{tag}_{rid}"


@dataclasses.dataclass(frozen=True)
class HandoverMeta:
    """What the adopter needs besides the segment: its layout (plain data, pickled over a pipe)."""

    name: str
    tokens: int  # T: the prompt's cache positions 0..T-1
    layers: int
    latent_dim: int
    rope_dim: int
    dtype: str  # numpy name of the pool dtype ("bfloat16", "float32")
    export_s: float  # device -> shm copy time in the prefill process
    created_s: float  # time.perf_counter() when the copy began (CLOCK_MONOTONIC: one clock per host)

    @property
    def layer_bytes(self) -> int:
        return self.tokens * (self.latent_dim + self.rope_dim) * np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        return self.layers * self.layer_bytes


def _views(buf: memoryview, meta: HandoverMeta) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per layer (latent [T, R], rope [T, dr]) numpy views into the segment."""
    dt = np.dtype(meta.dtype)
    t, r, dr = meta.tokens, meta.latent_dim, meta.rope_dim
    flat = np.frombuffer(buf, dt, count=meta.layers * t * (r + dr))
    out, off = [], 0
    for _ in range(meta.layers):
        lat = flat[off : off + t * r].reshape(t, r)
        off += t * r
        rope = flat[off : off + t * dr].reshape(t, dr)
        off += t * dr
        out.append((lat, rope))
    return out


def _fill(buf: memoryview, meta: HandoverMeta, parts: list[tuple[np.ndarray, np.ndarray]]) -> None:
    # A function of its own so the views into the segment are gone when it returns: the
    # mapping cannot be closed while a numpy view exports its buffer.
    for (lat_dst, rope_dst), (lat, rope) in zip(_views(buf, meta), parts):
        lat_dst[...] = lat[: meta.tokens]
        rope_dst[...] = rope[: meta.tokens]


def _padded_copy(buf: memoryview, meta: HandoverMeta, b: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Private [b, D] copies (zero padded past T) of every layer's latent and rope."""
    dt = np.dtype(meta.dtype)
    lat_src, rope_src = [], []
    for lat, rope in _views(buf, meta):
        lp = np.zeros((b, meta.latent_dim), dt)
        rp = np.zeros((b, meta.rope_dim), dt)
        lp[: meta.tokens], rp[: meta.tokens] = lat, rope
        lat_src.append(lp)
        rope_src.append(rp)
    return lat_src, rope_src


def export_prefix(pool: KVPool, row: int, tokens: int, name: str) -> HandoverMeta:
    """Copy positions [:tokens] of `row` of every layer into a new segment `name`; the
    caller's mapping is closed, the segment stays until the adopter (or discard) unlinks it."""
    t0 = time.perf_counter()
    dt = np.dtype(pool.dtype)
    meta = HandoverMeta(
        name,
        int(tokens),
        len(pool.latent),
        pool.cfg.kv_lora_rank,
        pool.cfg.qk_rope_head_dim,
        dt.name,
        0.0,
        t0,
    )
    # Slice a bucketed prefix on the device (one compiled slice per 64-token bucket, not per
    # prompt length) and fetch all layers in one device_get; the host trims it to T.
    b = min(cache_len(tokens), pool.max_len)
    parts = jax.device_get([(lat[row, :b], rope[row, :b]) for lat, rope in zip(pool.latent, pool.rope)])
    shm = shared_memory.SharedMemory(name=name, create=True, size=max(meta.nbytes, 1))
    resource_tracker.unregister(shm._name, "shared_memory")  # the adopter unlinks it, not our exit
    try:
        _fill(shm.buf, meta, parts)
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    shm.close()
    return dataclasses.replace(meta, export_s=time.perf_counter() - t0)


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _write_prefix(lat: list[jax.Array], rope: list[jax.Array], lat_src, rope_src, row: jax.Array):
    """Every layer's [rows, S, D] pool array with its [b, D] source written at [row, :b], in
    place (donated): one dispatch for all layers, one compile per bucket b."""
    put = [
        jax.lax.dynamic_update_slice(d, s[None].astype(d.dtype), (row, 0, 0)) for d, s in zip(lat, lat_src)
    ]
    rput = [
        jax.lax.dynamic_update_slice(d, s[None].astype(d.dtype), (row, 0, 0)) for d, s in zip(rope, rope_src)
    ]
    return put, rput


def import_prefix(pool: KVPool, row: int, meta: HandoverMeta) -> int:
    """Write the segment into positions [:T] of pool row `row` (allocated by the caller),
    wait for the write, then unlink the segment. Returns the bytes moved."""
    if (len(pool.latent), pool.cfg.kv_lora_rank, pool.cfg.qk_rope_head_dim) != (
        meta.layers,
        meta.latent_dim,
        meta.rope_dim,
    ) or np.dtype(pool.dtype) != np.dtype(meta.dtype):
        discard(meta.name)
        raise ValueError(
            f"KV handover {meta.name}: {meta.layers} layers x (latent {meta.latent_dim}, rope {meta.rope_dim}) "
            f"{meta.dtype} does not fit this pool ({len(pool.latent)} layers x ({pool.cfg.kv_lora_rank}, "
            f"{pool.cfg.qk_rope_head_dim}) {np.dtype(pool.dtype).name}); both workers need one precision"
        )
    if meta.tokens > pool.max_len:
        discard(meta.name)
        raise ValueError(
            f"KV handover {meta.name}: {meta.tokens} tokens exceed the pool row ({pool.max_len})"
        )
    shm = shared_memory.SharedMemory(name=meta.name)
    try:
        # Pad to the same 64-token bucket on the host, so the device write compiles per
        # bucket; positions T..b-1 get zeros, which decode overwrites before it reads them
        # (a step writes position pos, then attends to <= pos).
        lat_src, rope_src = _padded_copy(shm.buf, meta, min(cache_len(meta.tokens), pool.max_len))
    finally:
        shm.close()
        shm.unlink()
    dev = next(iter(pool.latent[0].devices()))
    lat_src, rope_src = jax.device_put((lat_src, rope_src), dev)
    pool.latent, pool.rope = _write_prefix(pool.latent, pool.rope, lat_src, rope_src, jnp.int32(row))
    jax.block_until_ready((pool.latent, pool.rope))
    return meta.nbytes


def discard(name: str) -> bool:
    """Unlink segment `name` if it still exists (nobody will adopt it); True if it did."""
    try:
        shm = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return False
    shm.close()
    try:
        shm.unlink()
    except FileNotFoundError:  # unlinked by someone else in between
        return False
    return True


def leftover_segments(prefix: str = SEGMENT_PREFIX) -> list[str]:
    """Names of live segments starting with `prefix` (Linux: /dev/shm)."""
    if not os.path.isdir(SHM_DIR):
        return []
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def discard_all(prefix: str) -> list[str]:
    """Unlink every live segment whose name starts with `prefix`; the names removed."""
    return [n for n in leftover_segments(prefix) if discard(n)]
