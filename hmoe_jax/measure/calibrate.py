"""What `hmoe calibrate` (cli/calibrate.py) measures on this machine; measure/local_profile.py
writes it as the simulator profile configs/systems/local.toml (every value with "measured:
..." and how).

What is measured (about 2-3 minutes on 2 cores), each a median of repeated calls; the FP8 op
and the stand-in's in-XLA convert also in 3 blocks (2 with --quick) spread over the run,
combined by their medians (combine_blocks):
- host DRAM read bandwidth: the hmoe_read_bytes probe over 1 GiB (all pool threads);
- the fused FP8 MoE op (our CPU expert kernel) at M = 1 and 4 on DeepSeek-V3 expert shapes
  (7168 x 2048), experts rotated over > 1 GiB so each call reads DRAM: bytes/s over the read
  probe = expert_bw_efficiency; the INT4 op likewise; at prefill M = 256 and 64 (top-8 of
  32 experts: 64 and 16 rows per expert) flops/s over the measured VDPBF16PS peak =
  expert_compute_efficiency and expert_compute_efficiency_small;
- the stand-in accelerator: its pieces' FP8 weight matmuls go through our FP8 GEMM kernel
  (model/precision.py hooks), so its bf16 GEMM rate is that kernel at M = 512 on 7168 x 2048,
  its weight-read rate the same kernel at M = 1 over rotated matrices; fp32: an XLA f32 dot;
  the engine's prefill attention piece on one DeepSeek-V3 layer in each form at two chunk
  sizes (absorbed at 64 and 128 tokens, expanded at 256 and 512) = attn_<form>_tflops at the
  large one, attn_<form>_tflops_small at the small one (measure/standin.py); its decode attention at 1 and 4 rows: the piece's own read
  efficiency and the share of its read time that hides its rows' flops (read_slack);
- the staging ring's copy threads (StagingRing, 2 threads, 256 MiB slots) and a hop
  (jax.device_put between two CPU devices, 8 MiB); the copy threads the engine sizes here
  (runtime/staging.size_copy_threads against the hop rate) = copy_threads;
- DRAM co-run (measure/probes.dram_corun, ~0.5 s): two readers at once over one alone,
  side by side, median of 9 rounds = dram_corun_efficiency (sim/interference.py);
- the collectives dslp / ep run (all_gather, reduce_scatter, all_to_all under shard_map)
  between two stand-in devices at 2 (quick) or 3 payload sizes, fitted as latency + bytes /
  rate (measure/collectives.py): the profile's [collectives];
- per-op overheads from the engine's own traces on the tiny model (weights in cache, so a
  slice is dispatch + completion): acc pieces, hops, the CPU expert op, stage/load/unload.

Nothing measured here is fitted to a number the simulator later predicts: the validation
(tests/test_sim_validate.py, experiments e03-e05) compares against separate engine runs.
"""

from __future__ import annotations

import datetime as dt
import statistics
import time
from typing import Any

import numpy as np

from hmoe_jax.measure.probes import ReadProbe
from hmoe_jax.measure.stacks import fp8_stack, int4_stack
from hmoe_jax.measure.timing import median_time, side_by_side


def expert_kernel(rng, probe: ReadProbe, fmt: str, n_experts: int, repeats: int) -> dict[str, float]:
    """Fused MoE op: GB/s at M = 1 and 4 (experts rotated), flops/s at M = 256 (top-8)."""
    import jax
    import jax.numpy as jnp

    from hmoe_jax.kernels.moe import moe_experts
    from hmoe_jax.model.params import ExpertsParams

    d, i, k = 7168, 2048, 8
    mk = fp8_stack if fmt == "fp8" else int4_stack
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
        t = median_time(
            lambda x=x, ids=ids, m=m: fn(x, jnp.asarray(ids), jnp.full((m, k), 1.0 / k, jnp.float32), ex),
            max(3, repeats // 2),
            between=probe.tflops,
        ).median_s
        out[f"{key}_tflops"] = 2 * 3 * d * i * m * k / t / 1e12
        out[f"{key}_rows_per_expert"] = m * k / n_experts
    return out


# (rate, its side-by-side read probe) pairs of expert_kernel's result: combined as a ratio
RATIO_PAIRS = (("m1_gbps", "m1_probe_gbps"), ("m4_gbps", "m4_probe_gbps"))


def combine_blocks(blocks: list[dict[str, float]], ratio_pairs=RATIO_PAIRS) -> dict[str, Any]:
    """Several blocks of one measurement, taken at different times of a calibration, as one:
    each key the median over the blocks, except a (rate, probe) pair, whose ratio (what the
    profile keeps: an efficiency) is the median of the blocks' ratios, written back as
    median ratio x median probe so that rate / probe gives it. One block of the FP8 op's M=1
    read ran at 0.59-0.71 of its probe within one minute on the Zen 3 VM, and the in-XLA
    convert at 0.22-0.44 GB/s between two calibrations: one block lands whole in a profile."""
    if not blocks:
        raise ValueError("combine_blocks: no blocks")
    out: dict[str, Any] = {k: statistics.median(b[k] for b in blocks) for k in blocks[0]}
    for rate, probe in ratio_pairs:
        if rate in out and probe in out:
            ratios = [b[rate] / b[probe] for b in blocks]
            out[rate] = statistics.median(ratios) * out[probe]
            out[f"{rate}_ratios"] = ratios
    out["blocks"] = len(blocks)
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

    t = median_time(fill, repeats).median_s
    ring.close()
    devs = jax.devices("cpu")
    hop = jax.device_put(np.ones((8 << 20) // 4, np.float32), devs[-1])
    th = median_time(lambda: jax.device_put(hop, devs[0]), repeats * 2).median_s
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
    from hmoe_jax.measure.standin import (
        combine_attention,
        convert_gbps,
        decode_attention,
        standin_attention,
        standin_gemm,
    )

    # every rate that a validation row leans on, in blocks spread over the calibration,
    # each combined by its median (combine_blocks): one block of the decode attention's read
    # efficiency read 0.42 and 0.67 in two calibrations ten minutes apart on the Zen 5 VM,
    # the expanded attention at 512 tokens 0.16 and 0.28 TFLOPS, the hop 10 and 26 GB/s
    n_blocks = 2 if quick else 3
    m["int4_experts"] = expert_kernel(rng, probe, "int4", 48, reps)
    print(f"[calibrate] int4 experts {m['int4_experts']}", flush=True)
    fp8_blocks, conv_blocks, gemm_blocks, attn_blocks, dec_blocks, copy_blocks = [], [], [], [], [], []
    for _ in range(n_blocks):
        fp8_blocks.append(expert_kernel(rng, probe, "fp8", 32, reps))
        conv_blocks.append(convert_gbps(rng, probe, reps))
        gemm_blocks.append(standin_gemm(rng, probe, reps))
        attn_blocks.append(standin_attention(rng, probe, reps))
        dec_blocks.append(decode_attention(rng, probe, reps, gemm_blocks[-1]["bf16_tflops"] * 1e12))
        copy_blocks.append(copy_rates(reps))
    m["gemm"] = combine_blocks(gemm_blocks, (("gemv_gbps", "gemv_probe_gbps"),))
    m["attention"] = combine_attention(attn_blocks)
    print(f"[calibrate] stand-in attention, median of {n_blocks} blocks {m['attention']}", flush=True)
    m["decode_attention"] = {
        **dec_blocks[0],
        **{k: statistics.median(b[k] for b in dec_blocks) for k in ("mem_efficiency", "read_slack")},
        "blocks": {k: [b[k] for b in dec_blocks] for k in ("mem_efficiency", "read_slack")},
    }
    print(
        f"[calibrate] stand-in decode attention: read efficiency {m['decode_attention']['mem_efficiency']:.3f}, "
        f"read slack {m['decode_attention']['read_slack']:.3f} (medians of {n_blocks} blocks: "
        f"{m['decode_attention']['blocks']})",
        flush=True,
    )
    copies = combine_blocks(copy_blocks)
    m.update({k: copies[k] for k in ("copy_gbps", "hop_gbps")})
    m["copy_blocks"] = {k: [b[k] for b in copy_blocks] for k in ("copy_gbps", "hop_gbps")}
    m["fp8_experts"] = combine_blocks(fp8_blocks)
    print(f"[calibrate] fp8 experts, median of {n_blocks} blocks {m['fp8_experts']}", flush=True)
    m["gemm"]["convert_gbps"] = statistics.median(conv_blocks)
    m["gemm"]["convert_gbps_blocks"] = conv_blocks
    if probe.all_tflops:
        # the compute probe's own reading, the reference a validation run re-bases on
        # (plan/profile.Profile.with_host_state); it is the bf16 peak only where it measures it
        m["compute_probe_tflops"] = statistics.median(probe.all_tflops)
        loop = {
            "bf16_dot": "register-resident VDPBF16PS loop on all pool threads (hmoe_bf16_dot_peak, 2M iterations)",
            "fma_f32": "register-resident 8-lane f32 FMA loop on all pool threads (hmoe_fma_peak, 8M iterations)",
        }[probe.tflops_kind]
        m["compute_probe_how"] = (
            f"{loop}, median of {len(probe.all_tflops)} probes taken between the kernel measurements"
        )
    if probe.tflops_kind == "bf16_dot":
        m["bf16_peak_tflops"] = m["compute_probe_tflops"]
        m["bf16_peak_how"] = m["compute_probe_how"]
    else:
        m["bf16_peak_tflops"] = m["fp8_experts"]["prefill_tflops"]
        m["bf16_peak_how"] = "no AVX-512-BF16: the expert op's own prefill rate stands for the peak"
    m["read_gbps"] = statistics.median(probe.all_gbps)
    m["probes"] = len(probe.all_gbps)
    if probe.all_stream_gbps:
        # the stream probe's own reading at calibration: a validation run re-bases the host
        # read rate on its stream probe over this (plan/profile.Profile.with_host_state)
        m["stream_probe_gbps"] = statistics.median(probe.all_stream_gbps)
        m["stream_probe_how"] = (
            "our FP8 GEMV (M=1) through the read probe's 1 GiB as 64 [2048, 7168] FP8 matrices, "
            f"median of {len(probe.all_stream_gbps)} probes taken between the kernel measurements"
        )
    print(
        f"[calibrate] read {m['read_gbps']:.1f} GB/s (median of {m['probes']} probes), "
        f"stream probe {m.get('stream_probe_gbps', float('nan')):.1f} GB/s",
        flush=True,
    )
    print(f"[calibrate] stand-in gemm {m['gemm']}", flush=True)
    from hmoe_jax.measure.probes import dram_corun
    from hmoe_jax.runtime.staging import size_copy_threads

    # the copy threads the engine's ring takes on this box against its host link (the hop
    # rate stands for h2d_gbps here), as Engine(copy_threads=None) sizes them
    m["copy_threads"], m["copy_threads_why"] = size_copy_threads(None, m["hop_gbps"])
    m["dram_corun"] = dram_corun(rounds=9)
    print(f"[calibrate] dram co-run {m['dram_corun']}", flush=True)
    cpus = jax.devices("cpu")
    if len(cpus) >= 2:  # the stand-ins' collectives (measure/collectives.py): a few seconds
        from hmoe_jax.measure.collectives import measure_collectives

        m["collectives"] = measure_collectives(2, quick=quick, repeats=reps, devices=cpus)
        print(
            "[calibrate] collectives "
            + ", ".join(
                f"{k} {f['latency_s'] * 1e6:.0f} us + B / {f['gbps']:.3f} GB/s"
                for k, f in m["collectives"].items()
            ),
            flush=True,
        )
    m["overheads"] = engine_overheads()
    m["mem_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    m["backend"] = jax.default_backend()
    m["calibrate_s"] = time.perf_counter() - t0
    return m
