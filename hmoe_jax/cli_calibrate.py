"""`hmoe calibrate`: measure this machine and write its simulator profile
(configs/systems/local.toml, every value with "measured: ..." and how).

  hmoe calibrate [--out PATH] [--quick] [--json]

What is measured (about 1-2 minutes on 2 cores), each a median of repeated calls:
- host DRAM read bandwidth: the hmoe_read_bytes probe over 1 GiB (all pool threads);
- the fused FP8 MoE op (our CPU expert kernel) at M = 1 and 4 on DeepSeek-V3 expert shapes
  (7168 x 2048), experts rotated over > 1 GiB so each call reads DRAM: bytes/s over the read
  probe = expert_bw_efficiency; the INT4 op likewise; at prefill M = 256 and 64 (top-8 of
  32 experts: 64 and 16 rows per expert) flops/s over the measured VDPBF16PS peak =
  expert_compute_efficiency and expert_compute_efficiency_small;
- the stand-in accelerator: its pieces' FP8 weight matmuls go through our FP8 GEMM kernel
  (model/precision.py hooks), so its bf16 GEMM rate is that kernel at M = 512 on 7168 x 2048,
  its weight-read rate the same kernel at M = 1 over rotated matrices; fp32: an XLA f32 dot;
  the engine's prefill attention piece on one DeepSeek-V3 layer in each form (absorbed at
  128 tokens, expanded at 512) = attn_absorbed_tflops / attn_expanded_tflops
  (calibrate_standin.py);
- the staging ring's copy threads (StagingRing, 2 threads, 256 MiB slots) and a hop
  (jax.device_put between two CPU devices, 8 MiB);
- per-op overheads from the engine's own traces on the tiny model (weights in cache, so a
  slice is dispatch + completion): acc pieces, hops, the CPU expert op, stage/load/unload.

Nothing measured here is fitted to a number the simulator later predicts: the validation
(tests/test_sim_validate.py, experiments e03-e05) compares against separate engine runs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

GIB = 1 << 30


def _median_s(fn, repeats: int, warmup: int = 1, probe: ReadProbe | None = None) -> float:
    """Median wall time of fn(); with a probe, a compute probe before each timed call (the
    compute rates are then predicted relative to the probes' median, like the reads)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    ts = []
    for _ in range(repeats):
        if probe is not None:
            probe.tflops()
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


class ReadProbe:
    """The hmoe_read_bytes probe over 1 GiB (all pool threads). This VM's read rate moves
    by 2x within minutes (other tenants), so every efficiency below is measured SIDE BY
    SIDE: a probe before each round of kernel calls, efficiency = kernel rate / the median
    of the probes taken in its own rounds."""

    def __init__(self) -> None:
        from hmoe_jax.kernels.gemm import device_put_zero_copy
        from hmoe_jax.quant.hostmem import aligned_empty

        buf = aligned_empty((GIB,), np.uint8)
        buf[:] = 1  # touch every page
        self.arr = device_put_zero_copy(buf)
        self.all_gbps: list[float] = []
        self.all_tflops: list[float] = []

    def gbps(self) -> float:
        import jax

        from hmoe_jax.kernels.gemm import read_bytes

        t = time.perf_counter()
        jax.block_until_ready(read_bytes(self.arr))
        g = GIB / (time.perf_counter() - t) / 1e9
        self.all_gbps.append(g)
        return g

    def tflops(self) -> float | None:
        """A short bf16 dot-product peak probe (~60 ms; None without AVX-512-BF16): the same
        estimator experiments/common/simval.py uses, so their ratio measures the neighbours."""
        from hmoe_jax.kernels.moe import bf16_dot_peak_flops

        try:
            t = bf16_dot_peak_flops(iters=2_000_000, repeats=1) / 1e12
        except RuntimeError:
            return None
        self.all_tflops.append(t)
        return t


def side_by_side(probe: ReadProbe, fn, calls: int, rounds: int) -> tuple[float, float]:
    """(median seconds per fn() call, median probe GB/s of the same rounds)."""
    import jax

    for _ in range(calls):
        jax.block_until_ready(fn())
    ts, bws = [], []
    for _ in range(rounds):
        bws.append(probe.gbps())
        probe.tflops()
        t = time.perf_counter()
        for _ in range(calls):
            jax.block_until_ready(fn())
        ts.append((time.perf_counter() - t) / calls)
    return statistics.median(ts), statistics.median(bws)


def _fp8_stack(rng, e: int, n: int, k: int):
    import ml_dtypes

    from hmoe_jax.kernels.gemm import device_put_zero_copy
    from hmoe_jax.quant.fp8 import Fp8Tensor
    from hmoe_jax.quant.hostmem import aligned_empty

    w = aligned_empty((e, n, k), np.uint8)
    w.reshape(-1)[:] = np.frombuffer(rng.bytes(w.size), np.uint8)
    w[(w & 0x7F) == 0x7F] = 0  # no NaN codes
    s = aligned_empty((e, -(-n // 128), -(-k // 128)), np.float32)  # 128 x 128 blocks, edges partial
    s[...] = 1e-3
    return Fp8Tensor(
        w=device_put_zero_copy(w.view(ml_dtypes.float8_e4m3fn)), scale_inv=device_put_zero_copy(s)
    )


def _int4_stack(rng, e: int, n: int, k: int, group: int = 64):
    import ml_dtypes

    from hmoe_jax.kernels.gemm import device_put_zero_copy
    from hmoe_jax.quant.hostmem import aligned_empty
    from hmoe_jax.quant.int4 import Int4Tensor

    q = aligned_empty((e, n, k // 2), np.uint8)
    q.reshape(-1)[:] = np.frombuffer(rng.bytes(q.size), np.uint8)
    s = aligned_empty((e, n, k // group), ml_dtypes.bfloat16)
    s[...] = 1e-2
    return Int4Tensor(q=device_put_zero_copy(q), scale=device_put_zero_copy(s), group=group)


def expert_kernel(rng, probe: ReadProbe, fmt: str, n_experts: int, repeats: int) -> dict[str, float]:
    """Fused MoE op: GB/s at M = 1 and 4 (experts rotated), flops/s at M = 256 (top-8)."""
    import jax
    import jax.numpy as jnp

    from hmoe_jax.kernels.moe import moe_experts
    from hmoe_jax.model.params import ExpertsParams

    d, i, k = 7168, 2048, 8
    mk = _fp8_stack if fmt == "fp8" else _int4_stack
    ex = ExpertsParams(
        gate=mk(rng, n_experts, i, d), up=mk(rng, n_experts, i, d), down=mk(rng, n_experts, d, i)
    )
    one = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(ex)) / n_experts
    fn = jax.jit(moe_experts)
    out: dict[str, float] = {"expert_bytes": one}
    for m in (1, 4):
        groups = n_experts // k  # each call reads k distinct experts per row block, rotated
        calls = []
        for g in range(groups):
            ids = np.stack([(np.arange(k) + g * k + r) % n_experts for r in range(m)]).astype(np.int32)
            x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
            calls.append((x, jnp.asarray(ids), jnp.full((m, k), 1.0 / k, jnp.float32)))
        distinct = [len(np.unique(np.asarray(c[1]))) for c in calls]
        it = iter(range(10**9))

        def call(it=it, calls=calls, groups=groups):  # bound now: called within this iteration
            j = next(it) % groups
            return fn(*calls[j], ex)

        t, bw = side_by_side(probe, call, groups, repeats)
        out[f"m{m}_gbps"] = statistics.mean(distinct) * one / t / 1e9
        out[f"m{m}_probe_gbps"] = bw
        out[f"m{m}_rows_per_expert"] = m * k / statistics.mean(distinct)
    # prefill sizes: the kernel's flops/s grows with rows per expert (each expert's weights
    # are unpacked once per call, whatever its rows): measured at two points
    for key, m in (("prefill_small", 64), ("prefill", 256)):
        ids = np.stack([rng.permutation(n_experts)[:k] for _ in range(m)]).astype(np.int32)
        x = jnp.asarray(rng.standard_normal((m, d)), jnp.float32)
        t = _median_s(
            lambda x=x, ids=ids, m=m: fn(x, jnp.asarray(ids), jnp.full((m, k), 1.0 / k, jnp.float32), ex),
            max(3, repeats // 2),
            probe=probe,
        )
        out[f"{key}_tflops"] = 2 * 3 * d * i * m * k / t / 1e12
        out[f"{key}_rows_per_expert"] = m * k / n_experts
    return out


def copy_rates(repeats: int) -> dict[str, float]:
    import jax

    from hmoe_jax.quant.hostmem import aligned_empty
    from hmoe_jax.runtime.staging import StagingRing

    nbytes = 256 << 20
    src = aligned_empty((nbytes,), np.uint8)
    src[:] = 3
    ring = StagingRing(2, nbytes, copy_threads=2)

    seg = 16 << 20  # copies are queued per segment (a layer's expert arrays), as the engine does

    def fill():
        ring.fill(0, [(src[o : o + seg], o) for o in range(0, nbytes, seg)])
        ring.wait(0)
        ring.release(0)

    t = _median_s(fill, repeats)
    ring.close()
    devs = jax.devices("cpu")
    hop = jax.device_put(np.ones((8 << 20) // 4, np.float32), devs[-1])
    th = _median_s(lambda: jax.device_put(hop, devs[0]), repeats * 2)
    return {"copy_gbps": nbytes / t / 1e9, "hop_gbps": (8 << 20) / th / 1e9}


def engine_overheads() -> dict[str, Any]:
    """Median slice durations per op kind on the tiny model (weights cache-resident)."""
    from hmoe_jax.engine.engine import Engine
    from hmoe_jax.io.loader import load_checkpoint
    from hmoe_jax.io.synthetic import ensure_default_checkpoint
    from hmoe_jax.model.sampling import SamplingParams
    from hmoe_jax.plan.system import SystemSpec
    from hmoe_jax.plan.trace import TraceRecorder

    cfg, params = load_checkpoint(ensure_default_checkpoint(progress=False), progress=False)
    eng = Engine(params, cfg, system=SystemSpec(), precision="bf16", max_batch=2, max_len=128)
    ids = np.arange(3, 35, dtype=np.int32)
    slices: dict[str, list[float]] = {}
    for sched, mode in (("cpu", "serial"), ("slp", "pipelined")):
        for rep in range(3):
            tr = TraceRecorder()
            eng.prefill(ids, eng.new_cache(128), schedule=sched, mode=mode, trace=tr if rep else None)
            for s in tr.slices:
                kind = s["name"].split(" ")[0]
                slices.setdefault(kind, []).append((s["end_ns"] - s["start_ns"]) / 1e9)
    seq = eng.start(list(ids[:8]), SamplingParams(max_new_tokens=64, stop_ids=()), schedule="cpu")
    gaps, outside = [], []
    for rep in range(8):
        tr = TraceRecorder()
        t0 = time.perf_counter()
        toks, rows, pos = eng.step_inputs([seq])
        t1 = time.perf_counter()
        logits = eng.decode_rows(toks, rows, pos, eng.pool, tr, mode="serial")
        t2 = time.perf_counter()
        eng.take_step([seq], logits, 0.0)
        t3 = time.perf_counter()
        if rep < 2:  # compiles
            continue
        busy = sum(s["end_ns"] - s["start_ns"] for s in tr.slices) / 1e9
        gaps.append((t2 - t1 - busy) / len(tr.slices))  # executor work between two ops' slices
        outside.append((t1 - t0) + (t3 - t2))  # inputs and sampling: host work outside the plan
        for s in tr.slices:
            slices.setdefault("decode_" + s["name"].split(" ")[0], []).append(
                (s["end_ns"] - s["start_ns"]) / 1e9
            )
    eng.close()
    med = {k: statistics.median(v) for k, v in slices.items()}
    acc_kinds = ["embed", "attn", "attn_route", "route", "shared", "dense_ffn", "combine", "final"]
    acc = [v for k in acc_kinds for v in slices.get(k, []) + slices.get("decode_" + k, [])]
    hops = [v for k in ("d2h", "h2d", "decode_d2h", "decode_h2d") for v in slices.get(k, [])]
    cpu = slices.get("experts_cpu", []) + slices.get("decode_experts_cpu", [])
    gap = max(0.0, statistics.median(gaps))
    return {
        "acc_op_s": statistics.median(acc) + gap,
        "hop_s": statistics.median(hops) + gap,
        "cpu_op_s": statistics.median(cpu) + gap,
        "stage_s": med.get("stage", 0.0) + gap,
        "load_s": med.get("load", 0.0) + gap,
        "unload_s": med.get("unload", 0.0) + gap,
        "step_s": statistics.median(outside),
        "gap_s": gap,
        "slices": {k: {"median_s": v, "n": len(slices[k])} for k, v in sorted(med.items())},
    }


def _leaf(v: Any, src: str) -> str:
    val = json.dumps(v) if not isinstance(v, float) else repr(float(f"{v:.4g}"))
    return f"{{ value = {val}, src = {json.dumps(src)} }}"


def write_profile(path: Path, m: dict[str, Any]) -> str:
    import os

    day = m["date_utc"]
    here = f"measured: hmoe calibrate {day} on {m['cpu_model']}"
    cores = os.cpu_count() or 1
    fx, ix, g = m["fp8_experts"], m["int4_experts"], m["gemm"]
    # a loaded neighbour can hold the peak loop below the kernel's own rate: the peak is then
    # the kernel's rate (the product rate x efficiency is what prices an op)
    peak = max(m["bf16_peak_tflops"], fx["prefill_tflops"])
    peak_how = m["bf16_peak_how"] + (
        ""
        if peak == m["bf16_peak_tflops"]
        else f" gave {m['bf16_peak_tflops']:.3f}, below the expert op's own rate, which stands for it"
    )
    sec = {
        "cpu": {
            "numa_nodes": (1, "measured: one NUMA node (os view of this VM)"),
            "cores_per_node": (cores, "measured: os.cpu_count()"),
            "dram_gbps_per_node": (
                m["read_gbps"],
                f"{here}: hmoe_read_bytes over 1 GiB, median of {m['probes']} probes during calibration",
            ),
            "dram_efficiency": (1.0, "derived: dram_gbps_per_node is already the sustained read rate"),
            "bf16_tflops_per_node": (peak, f"{here}: {peak_how}"),
            "expert_bw_efficiency": (
                min(1.0, fx["m1_gbps"] / fx["m1_probe_gbps"]),
                f"{here}: fused FP8 MoE op M=1 {fx['m1_gbps']:.1f} GB/s over its side-by-side read probe "
                f"{fx['m1_probe_gbps']:.1f} GB/s (M=4: {fx['m4_gbps']:.1f} of {fx['m4_probe_gbps']:.1f})",
            ),
            "expert_bw_efficiency_batched": (
                min(1.0, fx["m4_gbps"] / fx["m4_probe_gbps"]),
                f"{here}: fused FP8 MoE op M=4 (rows overlapping) {fx['m4_gbps']:.1f} GB/s over its side-by-side read probe {fx['m4_probe_gbps']:.1f} GB/s",
            ),
            "expert_batched_rows_per_expert": (
                fx["m4_rows_per_expert"],
                f"{here}: rows per touched expert of that M=4 measurement (4 rows x top-8 over its distinct experts)",
            ),
            "expert_compute_efficiency": (
                min(1.0, fx["prefill_tflops"] / peak),
                f"{here}: fused FP8 MoE op M=256 top-8 of 32, {fx['prefill_tflops']:.3f} TFLOPS over the peak",
            ),
            "expert_compute_rows_per_expert": (
                fx["prefill_rows_per_expert"],
                f"{here}: rows per expert of that M=256 measurement (256 rows x top-8 of 32)",
            ),
            "expert_compute_efficiency_small": (
                min(1.0, fx["prefill_small_tflops"] / peak),
                f"{here}: fused FP8 MoE op M=64 top-8 of 32, {fx['prefill_small_tflops']:.3f} TFLOPS over the peak",
            ),
            "expert_compute_small_rows_per_expert": (
                fx["prefill_small_rows_per_expert"],
                f"{here}: rows per expert of that M=64 measurement (64 rows x top-8 of 32)",
            ),
            "int4_expert_bw_efficiency": (
                min(1.0, ix["m1_gbps"] / ix["m1_probe_gbps"]),
                f"{here}: fused INT4 MoE op M=1 {ix['m1_gbps']:.1f} GB/s over its side-by-side read probe {ix['m1_probe_gbps']:.1f} GB/s",
            ),
            "copy_gbps": (m["copy_gbps"], f"{here}: StagingRing fill of 256 MiB, 2 copy threads, median"),
        },
        "accelerator": {
            "count": (m["devices"], "measured: stand-in XLA CPU devices the engine uses here (--devices)"),
            "kind": ("xla-cpu-standin", "measured: no GPU on this machine; accelerators are XLA CPU devices"),
            "placement": ("host", "measured: the stand-in runs on the host's cores and reads host DRAM"),
            "fp32_tflops": (m["gemm"]["fp32_tflops"], f"{here}: XLA f32 dot 512 x 7168 x 2048, median"),
            "bf16_tflops": (
                m["gemm"]["bf16_tflops"],
                f"{here}: our FP8 GEMM kernel (the bf16 policy's hook) M=512 on 2048 x 7168",
            ),
            "fp8_tflops": (
                m["gemm"]["bf16_tflops"],
                "derived: no FP8 GEMM runs on the stand-in; = bf16_tflops (the same kernel)",
            ),
            "compute_efficiency": (1.0, "derived: the rates above are measured effective rates"),
            "mem_gbps": (
                m["read_gbps"],
                "derived: the stand-in's memory is host DRAM (= dram_gbps_per_node)",
            ),
            "mem_efficiency": (
                min(1.0, g["gemv_gbps"] / g["gemv_probe_gbps"]),
                f"{here}: our FP8 GEMV (M=1) {g['gemv_gbps']:.1f} GB/s over 48 rotated 2048 x 7168 matrices, over its side-by-side read probe {g['gemv_probe_gbps']:.1f} GB/s",
            ),
            "mem_bytes": (m["mem_bytes"], "measured: host RAM (os.sysconf), the stand-in's memory"),
            **{
                f"attn_{form}_tflops": (
                    a["tflops"],
                    f"{here}: the engine's blocked MLA prefill attention ({form} form, FP8 weights through the "
                    f"bf16 policy's hooks) on one {a['model']} layer, {a['tokens']} new tokens, "
                    f"plan.costs.attn_flops over {a['seconds']:.3f} s, median",
                )
                for form, a in m["attention"].items()
            },
            "weight_convert_gbps": (
                g["convert_gbps"],
                f"{here}: the experts_acc piece (XLA dequantises the slot's FP8 weights, then ragged dots) on one 7168 x 2048 expert, 16 rows, median",
            ),
        },
        "link": {
            "h2d_gbps": (m["hop_gbps"], f"{here}: jax.device_put of 8 MiB between two CPU devices, median"),
            "d2h_gbps": (m["hop_gbps"], f"{here}: as h2d_gbps (the same copy)"),
            "interconnect": ("host", "measured: stand-ins share host memory"),
        },
        "overheads": {
            k: (
                max(m["overheads"][k], 0.0),
                f"{here}: engine trace of the tiny model, median slice of {what} + the median gap between "
                f"two ops' slices ({m['overheads']['gap_s'] * 1e6:.0f} us: the executor's own work)",
            )
            for k, what in (
                ("acc_op_s", "accelerator pieces"),
                ("cpu_op_s", "experts_cpu"),
                ("hop_s", "d2h/h2d"),
                ("stage_s", "stage (slp)"),
                ("load_s", "load (slp)"),
                ("unload_s", "unload (slp)"),
            )
        },
        "schedule": {
            "auto_slp_min_tokens": (4096, "paper: PAPER.md default (= plan.system.SystemSpec)"),
            "auto_dslp_min_tokens": (4096, "paper: PAPER.md default (= plan.system.SystemSpec)"),
            "cpu_prefill_chunk_tokens": (2048, "paper: PAPER.md default (= plan.system.SystemSpec)"),
            "slp_experts_per_slot": (1, "paper: PAPER.md default (= plan.system.SystemSpec)"),
        },
    }
    sec["overheads"]["step_s"] = (
        m["overheads"]["step_s"],
        f"{here}: tiny-model decode steps, median host time outside the plan (step inputs + sampling)",
    )
    sec["overheads"]["collective_s"] = (
        m["overheads"]["acc_op_s"],
        "derived: = acc_op_s (a stand-in collective is one more XLA computation; not traced here)",
    )
    lines = [
        "# This machine, written by `hmoe calibrate` (hmoe_jax/cli_calibrate.py): every value measured",
        "# here or derived from a measurement. Re-run it to refresh; do not edit by hand.",
        'format = "hmoe-sim-profile/1"',
        'name = "local"',
        f"comment = {json.dumps('this machine, ' + m['cpu_model'] + ', calibrated ' + day)}",
    ]
    for s, kv in sec.items():
        lines += ["", f"[{s}]"] + [f"{k} = {_leaf(v, src)}" for k, (v, src) in kv.items()]
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def calibrate(quick: bool = False, devices: int = 2) -> dict[str, Any]:
    import os

    import jax

    rng = np.random.default_rng(0)
    reps = 5 if quick else 9
    t0 = time.perf_counter()
    m: dict[str, Any] = {
        "date_utc": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "devices": devices,
    }
    try:
        m["cpu_model"] = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        m["cpu_model"] = "unknown CPU"
    probe = ReadProbe()
    probe.gbps()
    m["fp8_experts"] = expert_kernel(rng, probe, "fp8", 32, reps)
    print(f"[calibrate] fp8 experts {m['fp8_experts']}", flush=True)
    m["int4_experts"] = expert_kernel(rng, probe, "int4", 48, reps)
    print(f"[calibrate] int4 experts {m['int4_experts']}", flush=True)
    from hmoe_jax.calibrate_standin import convert_gbps, standin_attention, standin_gemm

    m["gemm"] = standin_gemm(rng, probe, reps)
    m["gemm"]["convert_gbps"] = convert_gbps(rng, probe, reps)
    m["attention"] = standin_attention(rng, probe, reps)
    print(f"[calibrate] stand-in attention {m['attention']}", flush=True)
    if probe.all_tflops:
        m["bf16_peak_tflops"] = statistics.median(probe.all_tflops)
        m["bf16_peak_how"] = (
            f"register-resident VDPBF16PS loop on all pool threads (hmoe_bf16_dot_peak, 2M iterations), "
            f"median of {len(probe.all_tflops)} probes taken between the kernel measurements"
        )
    else:
        m["bf16_peak_tflops"] = m["fp8_experts"]["prefill_tflops"]
        m["bf16_peak_how"] = "no AVX-512-BF16: the expert op's own prefill rate stands for the peak"
    m["read_gbps"] = statistics.median(probe.all_gbps)
    m["probes"] = len(probe.all_gbps)
    print(f"[calibrate] read {m['read_gbps']:.1f} GB/s (median of {m['probes']} probes)", flush=True)
    print(f"[calibrate] stand-in gemm {m['gemm']}", flush=True)
    m.update(copy_rates(reps))
    m["overheads"] = engine_overheads()
    m["mem_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    m["backend"] = jax.default_backend()
    m["calibrate_s"] = time.perf_counter() - t0
    return m


def add_calibrate_parser(sub: Any) -> None:
    p = sub.add_parser("calibrate", help="measure this machine and write its simulator profile (local.toml)")
    p.add_argument(
        "--out",
        default=None,
        help="profile path (default: configs/systems/local.toml of the checkout in the current directory, else the package's)",
    )
    p.add_argument("--quick", action="store_true", help="fewer repeats")
    p.add_argument("--json", action="store_true", help="print the measurements as one JSON line")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    from hmoe_jax.runtime.placement import configure_stand_ins
    from hmoe_jax.sim.profile import load_profile, profiles_dir

    try:  # two stand-in devices (host + acc) for the hop measurement, before jax starts
        configure_stand_ins(1)
    except Exception:
        pass
    m = calibrate(quick=args.quick, devices=1)
    # inside a source checkout, its configs/ (what its experiments read, also when the
    # package is a plain `pip install .` whose own configs are a copy in site-packages)
    from hmoe_jax.cli_reproduce import find_root

    here = find_root() / "configs" / "systems"
    out = Path(args.out) if args.out else (here if here.is_dir() else profiles_dir()) / "local.toml"
    write_profile(out, m)
    load_profile(str(out))  # what was written must load
    print(f"[calibrate] wrote {out} in {m['calibrate_s']:.0f} s", flush=True)
    if args.json:
        print(json.dumps(m))
    return 0
