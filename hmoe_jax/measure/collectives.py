"""The collectives dslp / ep run (parallel/moe.py, parallel/attention.py), timed on this
machine's devices and fitted as latency_s + bytes / rate per kind: the [collectives] keys of a
simulator profile (plan/profile.py; sim/pricing.py prices a collective from them).

Per kind, the same jax call the parallel code makes, inside jax.shard_map over a 1-D mesh of
`n` devices (parallel/mesh.make_mesh), bf16 payloads:
  all_gather      lax.all_gather(x, axis, tiled=True)          (SmallEP's hidden states, cp's latent)
  reduce_scatter  lax.psum_scatter(x, axis, 0, tiled=True)     (SmallEP's partials)
  all_to_all      lax.all_to_all(x[N, cap, D], axis, 0, 0)     (EP's dispatch and combine)
at 2-3 payload sizes. `bytes` is what sim/pricing.py charges one rank per collective
(CommVolume's total over N): the bytes a rank receives from the others (all_gather), sends
to the others (reduce_scatter), sends off-rank (all_to_all): (N - 1) shards in each case.
Each point is a median of repeated calls (measure/timing.median_time); the fit is ordinary
least squares of seconds on bytes, and every point goes into the profile's src.

On the stand-ins (XLA CPU devices sharing host memory) this is a host copy between two XLA
computations; on GPUs without P2P it is whatever XLA's collective does (tools/gpu_check.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from hmoe_jax.plan.profile import COLLECTIVE_KINDS

# per-rank bytes of the timed points: quick mode takes two sizes, the full run three
SIZES_BYTES = (1 << 20, 4 << 20, 16 << 20)
QUICK_SIZES_BYTES = (1 << 20, 4 << 20)
HIDDEN = 7168  # DeepSeek-V3's hidden size: a row of bf16 is 14 KiB


def fit_latency_rate(points: list[tuple[float, float]]) -> dict[str, Any]:
    """Least-squares t = latency_s + bytes / rate over points [(bytes, seconds), ...]:
    {latency_s, gbps, intercept_s (the raw fit; latency_s is it clamped at 0),
    max_rel_residual (the worst point's |fit - time| / time), points}.
    Needs two distinct sizes and a positive slope (more bytes took longer), else ValueError."""
    if len(points) < 2:
        raise ValueError(f"fit_latency_rate: {len(points)} point(s); need two payload sizes")
    x = np.array([float(b) for b, _ in points])
    y = np.array([float(t) for _, t in points])
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y)) and np.all(x > 0) and np.all(y > 0)):
        raise ValueError(f"fit_latency_rate: bytes and seconds must be finite and > 0, got {points}")
    if np.ptp(x) <= 0:
        raise ValueError(f"fit_latency_rate: every point has {x[0]:.0f} bytes; need two payload sizes")
    slope, intercept = np.polyfit(x, y, 1)
    if not slope > 0:
        raise ValueError(
            f"fit_latency_rate: seconds do not grow with bytes (slope {slope:.3g} s/B) over {points}: "
            "too noisy or too small payloads to fit a rate"
        )
    # how well a line fits: the stand-ins' in-process collectives grow faster than linearly
    # over 1-16 MiB here, which the src then shows instead of hiding
    resid = float(np.max(np.abs(intercept + slope * x - y) / y))
    return {
        "latency_s": max(float(intercept), 0.0),
        "intercept_s": float(intercept),
        "max_rel_residual": resid,
        "gbps": 1.0 / float(slope) / 1e9,
        "points": [[int(b), float(t)] for b, t in points],
    }


def _bodies(n: int, axis: str) -> dict[str, Any]:
    from jax import lax

    return {
        "all_gather": lambda xb: lax.all_gather(xb, axis, tiled=True),
        "reduce_scatter": lambda xb: lax.psum_scatter(xb, axis, scatter_dimension=0, tiled=True),
        "all_to_all": lambda xb: lax.all_to_all(xb.reshape(n, -1, xb.shape[-1]), axis, 0, 0).reshape(
            -1, xb.shape[-1]
        ),
    }


def _rows_per_rank(kind: str, n: int, per_rank_bytes: int) -> int:
    """Rows of HIDDEN bf16 each rank holds so that the collective moves per_rank_bytes per
    rank ((N - 1) shards of the N the rank sends or receives)."""
    shard_rows = max(1, round(per_rank_bytes / (n - 1) / (HIDDEN * 2)))
    return shard_rows if kind == "all_gather" else n * shard_rows


def measure_collectives(
    n: int = 2, *, quick: bool = False, repeats: int = 5, devices: list | None = None
) -> dict[str, Any]:
    """{kind: fit_latency_rate(...) + n_ranks, device}, timing each kind at SIZES_BYTES (or
    QUICK_SIZES_BYTES) per rank on the first `n` devices (jax.devices() by default)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from hmoe_jax.measure.timing import median_time
    from hmoe_jax.parallel.mesh import AXIS, make_mesh

    if n < 2:
        raise ValueError(f"measure_collectives: n={n}; a collective needs two ranks")
    mesh = make_mesh(n, devices)
    out: dict[str, Any] = {}
    for kind, body in _bodies(n, AXIS).items():
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
        points = []
        for per_rank in QUICK_SIZES_BYTES if quick else SIZES_BYTES:
            rows = _rows_per_rank(kind, n, per_rank)
            x = jax.device_put(jnp.ones((n * rows, HIDDEN), jnp.bfloat16), NamedSharding(mesh, P(AXIS)))
            moved = (n - 1) * (rows if kind == "all_gather" else rows // n) * HIDDEN * 2
            points.append((moved, median_time(lambda fn=fn, x=x: fn(x), repeats).median_s))
        out[kind] = {**fit_latency_rate(points), "n_ranks": n, "device": mesh.devices.flat[0].platform}
    return out


def collective_leaves(fits: dict[str, Any], here: str) -> dict[str, tuple[float, str]]:
    """The [collectives] leaves of a profile ({key: (value, src)}) from measure_collectives'
    fits, each src naming the points it was fitted to. `here` opens each src ("measured: ...
    on <machine> <date>")."""
    out: dict[str, tuple[float, str]] = {}
    for kind in COLLECTIVE_KINDS:
        if kind not in fits:
            continue
        f = fits[kind]
        pts = ", ".join(f"{b / 2**20:.1f} MiB {t * 1e6:.0f} us" for b, t in f["points"])
        how = (
            f"{here}: jax {kind} (shard_map, the call parallel/ uses) over {f['n_ranks']} {f['device']} "
            f"devices, bf16, per-rank bytes vs median seconds [{pts}], least-squares latency + bytes/rate "
            f"(largest residual {f['max_rel_residual']:.0%} of a point's time)"
        )
        clamp = (
            f" (fit intercept {f['intercept_s'] * 1e6:.1f} us clamped at 0)" if f["intercept_s"] < 0 else ""
        )
        out[f"{kind}_latency_s"] = (f["latency_s"], how + clamp)
        out[f"{kind}_gbps"] = (f["gbps"], how)
    return out
