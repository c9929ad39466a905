"""The GPU half of a simulator profile: measure the accelerator and its link, and write a
profile for the box from those measurements plus a CPU-side profile of the SAME host
(`hmoe calibrate --out BASE` run there: the CPU experts, DRAM and overheads are the host's).
tools/gpu_calibrate.py and tools/gpu_check.py both call this module.

Measured (each a median of timed runs after one untimed run; nothing typed in):
- link: host buffers to the device and back at several sizes. h2d from pinned host memory
  (jax memory kind "pinned_host") where the backend has it, else pageable. d2h copies a
  FRESH device array every rep (np.asarray of an array caches its host copy: timing one
  array again times that cache, ~15 us), both into pageable numpy memory and, where the
  backend has it, into pinned_host memory (what the engine's decode hops use on a GPU,
  runtime/hops.py). The largest size's median is the profile value.
- gemm: jnp.dot of N x N x N in f32, bf16 and e4m3 (f32 results).
- mem_gbps: one read of a large bf16 array (a sum).
- attention: the engine's blocked MLA prefill attention (model.attention.prefill_attention,
  bf16) of one real DeepSeek-V3 layer at T tokens, TFLOPS by plan.costs.attn_flops.
- acc_op_s: a tiny jitted op dispatched and waited for.
- collectives: all_gather / reduce_scatter / all_to_all under shard_map between the first two
  accelerators, fitted as latency + bytes / rate (measure/collectives.py); skipped (absent from
  the profile: the simulator's host-staged price) with one accelerator.
- mem_bytes: the card's PHYSICAL memory (nvidia-smi, engine/gpu.py), not JAX's allocator
  limit (0.75 of the card by default): the plan sizes its own fraction from the card.
"""

from __future__ import annotations

import datetime as dt
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from hmoe_jax.measure.timing import median_time


class BaseProfileMissing(ValueError):
    """A GPU profile needs the CPU side of the same host; none was given or it is absent."""


def check_base(base: str | None) -> str:
    """The CPU-side profile path/name a GPU profile is written over, checked to load."""
    from hmoe_jax.plan.profile import load_profile

    if not base:
        raise BaseProfileMissing(
            "--base is required: a GPU profile takes its CPU side (expert kernels, DRAM, overheads) "
            "from a profile of the SAME host; run `hmoe calibrate --out host.toml` on this machine "
            "first and pass --base host.toml (this VM's configs/systems/local.toml is another machine)"
        )
    try:
        load_profile(base)
    except (FileNotFoundError, ValueError) as e:
        raise BaseProfileMissing(f"--base {base}: {e}") from None
    return base


def _pinned(dev) -> Any | None:
    import jax

    if "pinned_host" not in {m.kind for m in dev.addressable_memories()}:
        return None
    return jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")


def link_rates(sizes_mib: list[int], reps: int) -> dict:
    import jax

    dev = jax.devices()[0]
    pinned = _pinned(dev)
    out: dict = {"pinned": pinned is not None, "h2d_gbps": {}, "d2h_gbps": {}, "d2h_pinned_gbps": {}}
    for mib in sizes_mib:
        host = np.ones(mib << 20, np.uint8)
        if pinned is not None:
            src = jax.device_put(host, pinned)
            to_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
            h2d = median_time(lambda src=src, to_dev=to_dev: jax.device_put(src, to_dev), reps).median_s
        else:
            h2d = median_time(lambda host=host: jax.device_put(host, dev), reps).median_s
        out["h2d_gbps"][mib] = host.nbytes / h2d / 1e9

        def make(i: int, host=host):
            return jax.device_put(host + np.uint8(i % 7), dev)

        out["d2h_gbps"][mib] = host.nbytes / fresh_copy_s(make, np.asarray, reps) / 1e9
        if pinned is not None:
            d2h_p = fresh_copy_s(make, lambda a: jax.device_put(a, pinned), reps)
            out["d2h_pinned_gbps"][mib] = host.nbytes / d2h_p / 1e9
    return out


def fresh_copy_s(make: Callable[[int], Any], copy: Callable[[Any], Any], reps: int) -> float:
    """Median seconds of copy(a) over `reps` timed calls, each on a FRESH array make(i) (the
    warm-up call takes one too): a jax array caches its host copy, so copying one array
    again would time that cache, not the link."""
    arrays = iter([make(i) for i in range(reps + 1)])
    return median_time(lambda: copy(next(arrays)), reps).median_s


def gemm_tflops(n: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    out: dict = {}
    for name, dtype in (("fp32", jnp.float32), ("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
        a = jax.random.normal(key, (n, n), jnp.float32).astype(dtype)
        b = jax.random.normal(key, (n, n), jnp.float32).astype(dtype)
        f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        try:
            s = median_time(lambda f=f, a=a, b=b: f(a, b), reps).median_s
            out[name] = 2 * n**3 / s / 1e12
        except Exception as e:  # noqa: BLE001 (a backend without that dot: say so)
            out[name] = None
            out[f"{name}_error"] = f"{type(e).__name__}: {e}"[:200]
    return out


def mem_gbps(nbytes: int, reps: int) -> float:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((nbytes // 2,), jnp.bfloat16)
    f = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
    return nbytes / median_time(lambda: f(x), reps).median_s / 1e9


def attention_rate(tokens: int, reps: int, model: str = "deepseek_v3") -> dict:
    """Blocked MLA prefill attention (bf16) of one `model` layer at `tokens` tokens."""
    import jax
    import jax.numpy as jnp

    from hmoe_jax.config import named_model_config
    from hmoe_jax.measure.compile_probe import abstract_mla
    from hmoe_jax.model import attention as A
    from hmoe_jax.model.precision import BF16, BF16_CPU
    from hmoe_jax.plan import costs

    # XLA:CPU has no bf16 x bf16 -> f32 dot: the stand-in runs the policy's CPU form
    prec = BF16_CPU if jax.default_backend() == "cpu" else BF16
    cfg = named_model_config(model)
    rng = np.random.default_rng(0)

    def concrete(s):
        return jnp.asarray(rng.standard_normal(s.shape, np.float32) * 0.02).astype(s.dtype)

    p = jax.tree.map(concrete, abstract_mla(cfg, prec))
    x = jnp.asarray(rng.standard_normal((tokens, cfg.hidden_size), np.float32)).astype(jnp.bfloat16)
    lat = jnp.zeros((1, tokens, cfg.kv_lora_rank), jnp.bfloat16)
    rope = jnp.zeros((1, tokens, cfg.qk_rope_head_dim), jnp.bfloat16)
    f = jax.jit(lambda p, x, lat, rope: A.prefill_attention(p, cfg, x, lat, rope, 0, 0, prec=prec))
    s = median_time(lambda: f(p, x, lat, rope), reps).median_s
    flops = costs.attn_flops(cfg, tokens, 0)
    return {"tokens": tokens, "model": model, "seconds": s, "tflops": flops / s / 1e12}


def op_overhead_s(reps: int) -> float:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((8,), jnp.float32)
    f = jax.jit(lambda x: x + 1)
    return median_time(lambda: f(x), max(reps, 50)).median_s


def collectives(smoke: bool, reps: int) -> dict:
    """The collectives dslp / ep run, between the first two accelerators
    (measure/collectives.py), or {"skipped": why} with fewer than two."""
    import jax

    devs = jax.devices()
    if len(devs) < 2:
        return {"skipped": f"{len(devs)} {devs[0].platform} device(s): a collective needs two"}
    from hmoe_jax.measure.collectives import measure_collectives

    return measure_collectives(2, quick=smoke, repeats=reps, devices=devs)


def card_memory(allow_cpu: bool = False) -> tuple[int, str]:
    """(bytes, source) of the accelerator's physical memory: nvidia-smi's total for the
    first visible GPU. With allow_cpu and no GPU (the CPU stand-in), the host's RAM."""
    from hmoe_jax.engine.gpu import query_gpu_mem_bytes

    cards = query_gpu_mem_bytes()
    if cards:
        return cards[0], "nvidia-smi memory.total (physical)"
    if not allow_cpu:
        raise RuntimeError("no GPU memory size: nvidia-smi is absent or failed (not a GPU host?)")
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "host RAM (CPU stand-in, --allow-cpu)"


def measure(*, smoke: bool, allow_cpu: bool, reps: int | None = None) -> dict:
    """Every measurement of the GPU profile (smoke: tiny sizes, for the CPU stand-in)."""
    import time

    import jax

    reps = reps or (3 if smoke else 10)
    dev = jax.devices()[0]
    mem, mem_src = card_memory(allow_cpu)
    m: dict = {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "backend": jax.default_backend(),
        "device": dev.device_kind,
        "devices": len(jax.devices()),
        "mem_bytes": mem,
        "mem_bytes_src": mem_src,
        "gemm_n": 512 if smoke else 8192,
        "mem_bytes_read": (64 if smoke else 4096) << 20,
    }
    t0 = time.perf_counter()
    m["link"] = link_rates([1, 8] if smoke else [8, 64, 256], reps)
    m["gemm"] = gemm_tflops(m["gemm_n"], reps)
    m["mem_gbps"] = mem_gbps(m["mem_bytes_read"], reps)
    m["attention"] = attention_rate(
        256 if smoke else 4096, reps, "deepseek_v3_tiny" if smoke else "deepseek_v3"
    )
    m["acc_op_s"] = op_overhead_s(reps)
    m["collectives"] = collectives(smoke, reps)
    m["seconds"] = time.perf_counter() - t0
    return m


def write_profile(base_path: str, out: Path, m: dict) -> None:
    """The profile: the base's sections with accelerator, link and acc_op_s measured here."""
    from hmoe_jax.plan.profile import load_profile

    base = load_profile(check_base(base_path))
    day = m["date_utc"]
    here = f"measured: hmoe_jax/measure/gpu_profile.py {day} on {m['device']}"
    big = max(m["link"]["h2d_gbps"], key=int)
    pinned_d2h = m["link"]["d2h_pinned_gbps"].get(big)
    acc = {
        "count": (m["devices"], f"{here}: jax.devices()"),
        "kind": (m["device"], f"{here}: device kind"),
        "placement": ("device", "measured: a discrete accelerator with its own memory"),
        "fp32_tflops": (m["gemm"]["fp32"], f"{here}: jnp.dot f32 {m['gemm_n']}^3, median"),
        "bf16_tflops": (m["gemm"]["bf16"], f"{here}: jnp.dot bf16 {m['gemm_n']}^3 (f32 results), median"),
        "fp8_tflops": (
            m["gemm"]["fp8"] or m["gemm"]["bf16"],
            f"{here}: jnp.dot e4m3 {m['gemm_n']}^3 (f32 results), median"
            if m["gemm"]["fp8"]
            else "derived: no FP8 dot on this backend; = bf16_tflops",
        ),
        "compute_efficiency": (1.0, "derived: the rates above are measured effective rates"),
        "mem_gbps": (m["mem_gbps"], f"{here}: one read of a {m['mem_bytes_read'] >> 20} MiB bf16 array"),
        "mem_efficiency": (1.0, "derived: mem_gbps is a measured effective rate"),
        "mem_bytes": (m["mem_bytes"], f"{here}: {m['mem_bytes_src']}"),
        # the piece's own rate, which the simulator prices expanded-form prefill attention at
        "attn_expanded_tflops": (
            m["attention"]["tflops"],
            f"{here}: the engine's blocked MLA prefill attention (bf16) of one {m['attention']['model']} "
            f"layer at {m['attention']['tokens']} tokens, plan.costs.attn_flops over its median seconds",
        ),
    }
    link = {
        "h2d_gbps": (
            m["link"]["h2d_gbps"][big],
            f"{here}: {big} MiB {'pinned' if m['link']['pinned'] else 'pageable'} host -> device, median",
        ),
        "d2h_gbps": (
            pinned_d2h or m["link"]["d2h_gbps"][big],
            f"{here}: {big} MiB device -> {'pinned host (the decode hops)' if pinned_d2h else 'host'}, "
            "a fresh device array per rep, median",
        ),
        "interconnect": ("host", "assumed: no P2P between accelerators (not measured here)"),
    }
    sections = {s: {k: (v, base.src[s][k]) for k, v in kv.items()} for s, kv in base.values.items()}
    sections["accelerator"], sections["link"] = acc, link
    # the base's [collectives] are its stand-ins' (host copies), not this box's accelerators:
    # this box's measured ones, else none (the simulator's host-staged price)
    coll = m.get("collectives") or {}
    if "skipped" in coll:
        sections["collectives"] = {}
    else:
        from hmoe_jax.measure.collectives import collective_leaves

        sections["collectives"] = collective_leaves(coll, here)
    sections["overheads"]["acc_op_s"] = (
        m["acc_op_s"],
        f"{here}: a tiny jitted op dispatched and waited for, median",
    )
    lines = [
        f"# Written by hmoe_jax/measure/gpu_profile.py from {base_path} (CPU side) and measurements on {m['device']}.",
        f"# Blocked MLA prefill attention at {m['attention']['tokens']} tokens: {m['attention']['tflops']:.1f} TFLOPS"
        f" (bf16 GEMM {m['gemm']['bf16']:.1f}).",
        'format = "hmoe-sim-profile/1"',
        f"name = {json.dumps(out.stem)}",
        f"comment = {json.dumps(base.comment + '; accelerator ' + m['device'] + ', calibrated ' + day)}",
    ]
    for s, kv in sections.items():
        lines += ["", f"[{s}]"]
        for k, (v, src) in kv.items():
            val = repr(float(f"{v:.4g}")) if isinstance(v, float) else json.dumps(v)
            lines.append(f"{k} = {{ value = {val}, src = {json.dumps(src)} }}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    load_profile(str(out))  # what was written must load (strict keys and sources)
