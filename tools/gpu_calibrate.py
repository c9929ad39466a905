"""The GPU part of `hmoe calibrate`, as one prepared script (a few minutes on one GPU): measure
the accelerator and its link, and write a simulator profile for the box from the
measurements plus a CPU-side profile of the same host (`hmoe calibrate --out BASE` run there
first: the CPU experts, DRAM and overheads are the host's).

    hmoe calibrate --out /tmp/host.toml                      # on the GPU host, ~2 min
    python tools/gpu_calibrate.py --base /tmp/host.toml --out configs/systems/gpu_here.toml
    python tools/gpu_calibrate.py --smoke                    # tiny sizes on any backend (CI-free check)

Measured (each a median of timed runs after one compile run; nothing typed in):
- h2d_gbps / d2h_gbps: host buffers of 8, 64 and 256 MiB to the device and back, from pinned
  host memory (jax memory kind "pinned_host") where the backend has it, else pageable; the
  largest size's median is the profile value, every size is in the JSON line.
- fp32 / bf16 / fp8 GEMM TFLOPS: jnp.dot of N x N x N (fp8: e4m3 x e4m3 with f32 results,
  what XLA lowers to the tensor cores' FP8 GEMM where the GPU has one).
- mem_gbps: one read of a large bf16 array (a sum), bytes / seconds.
- the engine's blocked MLA prefill attention (model.attention.prefill_attention, bf16) of one
  real DeepSeek-V3 layer at 4K tokens: seconds and TFLOPS by the cost model's attn_flops,
  written as attn_expanded_tflops (the rate expanded-form prefill attention is priced at) and
  reported next to the bf16 GEMM rate.
- acc_op_s: a tiny jitted op dispatched and waited for.
The profile takes compute_efficiency = mem_efficiency = 1.0: the rates above are effective
rates. One JSON line with every measurement ends stdout.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hmoe_jax.measure.timing import median_s as timed  # median of timed runs after one warm-up


def link_rates(sizes_mib: list[int], reps: int) -> dict:
    import jax
    import numpy as np

    dev = jax.devices()[0]
    out: dict = {"pinned": True, "h2d_gbps": {}, "d2h_gbps": {}}
    for mib in sizes_mib:
        host = np.ones(mib << 20, np.uint8)
        try:
            src = jax.device_put(host, jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host"))
            to_dev = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
            h2d = timed(lambda src=src, to_dev=to_dev: jax.device_put(src, to_dev), reps)
        except (ValueError, RuntimeError, NotImplementedError):  # no pinned host memory here
            out["pinned"] = False
            h2d = timed(lambda host=host: jax.device_put(host, dev), reps)
        on_dev = jax.device_put(host, dev)
        d2h = timed(lambda on_dev=on_dev: np.asarray(on_dev), reps)
        out["h2d_gbps"][mib] = host.nbytes / h2d / 1e9
        out["d2h_gbps"][mib] = host.nbytes / d2h / 1e9
    return out


def gemm_tflops(n: int, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    key = jax.random.PRNGKey(0)
    out = {}
    for name, dt in (("fp32", jnp.float32), ("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn)):
        a = jax.random.normal(key, (n, n), jnp.float32).astype(dt)
        b = jax.random.normal(key, (n, n), jnp.float32).astype(dt)
        f = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        try:
            s = timed(lambda f=f, a=a, b=b: f(a, b), reps)
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
    return nbytes / timed(lambda: f(x), reps) / 1e9


def attention_rate(tokens: int, reps: int, smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hmoe_jax.config import named_model_config
    from hmoe_jax.measure.compile_probe import abstract_mla
    from hmoe_jax.model import attention as A
    from hmoe_jax.model.precision import BF16
    from hmoe_jax.plan import costs

    cfg = named_model_config("deepseek_v3_tiny" if smoke else "deepseek_v3")
    rng = np.random.default_rng(0)

    def concrete(s):
        v = rng.standard_normal(s.shape, np.float32) * 0.02
        return jnp.asarray(v).astype(s.dtype)

    p = jax.tree.map(concrete, abstract_mla(cfg, BF16))
    x = jnp.asarray(rng.standard_normal((tokens, cfg.hidden_size), np.float32)).astype(jnp.bfloat16)
    lat = jnp.zeros((1, tokens, cfg.kv_lora_rank), jnp.bfloat16)
    rope = jnp.zeros((1, tokens, cfg.qk_rope_head_dim), jnp.bfloat16)
    f = jax.jit(lambda p, x, lat, rope: A.prefill_attention(p, cfg, x, lat, rope, 0, 0, prec=BF16))
    s = timed(lambda: f(p, x, lat, rope), reps)
    flops = costs.attn_flops(cfg, tokens, 0)
    name = "deepseek_v3_tiny" if smoke else "deepseek_v3"
    return {"tokens": tokens, "model": name, "seconds": s, "tflops": flops / s / 1e12}


def op_overhead_s(reps: int) -> float:
    import jax
    import jax.numpy as jnp

    x = jnp.ones((8,), jnp.float32)
    f = jax.jit(lambda x: x + 1)
    return timed(lambda: f(x), max(reps, 50))


def write(base_path: str, out: Path, m: dict) -> None:
    from hmoe_jax.sim.profile import load_profile

    base = load_profile(base_path)
    day = m["date_utc"]
    here = f"measured: tools/gpu_calibrate.py {day} on {m['device']}"
    big = max(m["link"]["h2d_gbps"], key=int)
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
        "mem_bytes": (m["mem_bytes"], f"{here}: memory_stats bytes_limit"),
        # the piece's own rate, which the simulator prices expanded-form prefill attention at
        # (>= 256 new tokens); absorbed-form chunks keep the GEMM rate (not measured here)
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
        "d2h_gbps": (m["link"]["d2h_gbps"][big], f"{here}: {big} MiB device -> host, median"),
        "interconnect": ("host", "assumed: no P2P between accelerators (not measured by this script)"),
    }
    sections = {s: {k: (v, base.src[s][k]) for k, v in kv.items()} for s, kv in base.values.items()}
    sections["accelerator"], sections["link"] = acc, link
    sections["overheads"]["acc_op_s"] = (
        m["acc_op_s"],
        f"{here}: a tiny jitted op dispatched and waited for, median",
    )
    lines = [
        f"# Written by tools/gpu_calibrate.py from {base_path} (CPU side) and measurements on {m['device']}.",
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
    out.write_text("\n".join(lines) + "\n")
    load_profile(str(out))  # what was written must load (strict keys and sources)


def main(argv: list[str] | None = None) -> dict:
    import datetime as dt

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", default="local", help="the host's CPU-side profile (hmoe calibrate)")
    ap.add_argument("--out", default=None, help="profile to write (default: print only)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: check the script on any backend")
    args = ap.parse_args(argv)
    import jax

    reps = 3 if args.smoke else 10
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    m: dict = {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "backend": jax.default_backend(),
        "device": dev.device_kind,
        "devices": len(jax.devices()),
        "mem_bytes": int(stats.get("bytes_limit", 0)),
        "gemm_n": 512 if args.smoke else 8192,
        "mem_bytes_read": (64 if args.smoke else 4096) << 20,
    }
    t0 = time.perf_counter()
    m["link"] = link_rates([1, 8] if args.smoke else [8, 64, 256], reps)
    m["gemm"] = gemm_tflops(m["gemm_n"], reps)
    m["mem_gbps"] = mem_gbps(m["mem_bytes_read"], reps)
    m["attention"] = attention_rate(256 if args.smoke else 4096, reps, args.smoke)
    m["acc_op_s"] = op_overhead_s(reps)
    m["seconds"] = time.perf_counter() - t0
    if args.out:
        if not m["mem_bytes"]:
            raise SystemExit(
                "gpu_calibrate: the backend reports no memory limit (not a GPU?): no profile written"
            )
        write(args.base, Path(args.out), m)
        m["profile"] = args.out
    print(json.dumps(m))
    return m


if __name__ == "__main__":
    main()
