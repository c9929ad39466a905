"""`hmoe calibrate`'s measurements (measure/calibrate.py) written as this machine's simulator
profile, configs/systems/local.toml: every value with its "measured: ..." or "derived: ..."
source (the format plan/profile.py reads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _leaf(v: Any, src: str) -> str:
    val = json.dumps(v) if not isinstance(v, float) else repr(float(f"{v:.4g}"))
    return f"{{ value = {val}, src = {json.dumps(src)} }}"


def _blocks_note(vals: list[float] | None) -> str:
    """ ", median of N blocks spread over the calibration (a-b)" for a value calibrate took in
    blocks (the blocks' values, measure/calibrate.combine_blocks); "" for one taken once."""
    vals = vals or []
    if len(vals) < 2:
        return ""
    return f", median of {len(vals)} blocks spread over the calibration ({min(vals):.3g}-{max(vals):.3g})"


def write_profile(path: Path, m: dict[str, Any]) -> str:
    import os

    day = m["date_utc"]
    here = f"measured: hmoe calibrate {day} on {m['cpu_model']}"
    cores = os.cpu_count() or 1
    fx, ix, g = m["fp8_experts"], m["int4_experts"], m["gemm"]
    co = m["dram_corun"]
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
            **(
                {
                    "compute_probe_tflops": (
                        m["compute_probe_tflops"],
                        f"{here}: {m['compute_probe_how']} (the reference a validation run's own probe "
                        "re-bases the host-core rates on)",
                    )
                }
                if "compute_probe_tflops" in m
                else {}
            ),
            **(
                {
                    "read_fixed_share": (
                        min(0.9, m["gemm"]["gemv_gbps"] / m["gemm"]["gemv_l3_gbps"]),
                        f"{here}: our FP8 GEMV (M=1) from DRAM {m['gemm']['gemv_gbps']:.1f} GB/s over the same GEMV on "
                        f"one L3-resident matrix {m['gemm']['gemv_l3_gbps']:.1f} GB/s (medians of the blocks): the share "
                        "of a streaming kernel's time per byte that a faster DRAM does not shorten",
                    )
                }
                if "gemv_l3_gbps" in m.get("gemm", {})
                else {}
            ),
            **(
                {
                    "stream_probe_gbps": (
                        m["stream_probe_gbps"],
                        f"{here}: {m['stream_probe_how']} (the reference a validation run's own stream "
                        "probe re-bases the host read rate on)",
                    )
                }
                if "stream_probe_gbps" in m
                else {}
            ),
            "expert_bw_efficiency": (
                min(1.0, fx["m1_gbps"] / fx["m1_probe_gbps"]),
                f"{here}: fused FP8 MoE op M=1 {fx['m1_gbps']:.1f} GB/s over its side-by-side read probe "
                f"{fx['m1_probe_gbps']:.1f} GB/s (M=4: {fx['m4_gbps']:.1f} of {fx['m4_probe_gbps']:.1f})"
                + _blocks_note(fx.get("m1_gbps_ratios")),
            ),
            "expert_bw_efficiency_batched": (
                min(1.0, fx["m4_gbps"] / fx["m4_probe_gbps"]),
                f"{here}: fused FP8 MoE op M=4 (rows overlapping) {fx['m4_gbps']:.1f} GB/s over its side-by-side read probe {fx['m4_probe_gbps']:.1f} GB/s"
                + _blocks_note(fx.get("m4_gbps_ratios")),
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
            "copy_gbps": (
                m["copy_gbps"],
                f"{here}: StagingRing fill of 256 MiB, 2 copy threads, median"
                + _blocks_note(m["copy_blocks"]["copy_gbps"]),
            ),
            "copy_threads": (
                m["copy_threads"],
                f"{here}: runtime/staging.size_copy_threads: {m['copy_threads_why']}",
            ),
            "dram_corun_efficiency": (
                min(1.0, co["efficiency"]),
                f"{here}: measure/probes.dram_corun, {co['readers']} readers of {co['mib_per_reader']} MiB "
                f"({co['threads_per_reader']} thread(s) each) at once {co['corun_gbps']:.1f} GB/s over one "
                f"alone on all threads {co['alone_gbps']:.1f} GB/s, side by side, median of {co['rounds']} rounds"
                + (" (above 1: noise, held at 1)" if co["efficiency"] > 1 else ""),
            ),
            "expert_op_serialised": (
                "process",
                "spec: the CPU MoE op holds a process-wide mutex for its whole run (xla_ffi/src/moe_exec.cc "
                "run_moe: std::lock_guard on the static Scratch's mu), so engines in one process take turns",
            ),
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
                f"{here}: our FP8 GEMV (M=1) {g['gemv_gbps']:.1f} GB/s over 48 rotated 2048 x 7168 matrices, over its side-by-side read probe {g['gemv_probe_gbps']:.1f} GB/s"
                + _blocks_note(g.get("gemv_gbps_ratios")),
            ),
            "mem_bytes": (m["mem_bytes"], "measured: host RAM (os.sysconf), the stand-in's memory"),
            **_decode_attention_leaves(m["decode_attention"], here),
            **{
                k: v
                for form, a in m["attention"].items()
                for k, v in _attention_leaves(form, a, here).items()
            },
            "weight_convert_gbps": (
                g["convert_gbps"],
                f"{here}: the experts_acc piece (XLA dequantises the slot's FP8 weights, then ragged dots) on one 7168 x 2048 expert, 16 rows, median"
                + _blocks_note(g.get("convert_gbps_blocks")),
            ),
        },
        "link": {
            "h2d_gbps": (
                m["hop_gbps"],
                f"{here}: jax.device_put of 8 MiB between two CPU devices, median"
                + _blocks_note(m["copy_blocks"]["hop_gbps"]),
            ),
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
    if m.get("collectives"):
        from hmoe_jax.measure.collectives import collective_leaves

        sec["collectives"] = collective_leaves(m["collectives"], here)
    lines = [
        "# This machine, written by `hmoe calibrate` (hmoe_jax/measure/): every value measured",
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


def _attention_leaves(form: str, a: dict, here: str) -> dict:
    """A form's prefill attention rate at its large and at its small chunk size
    (measure/standin.standin_attention)."""

    def src(x: dict) -> str:
        return (
            f"{here}: the engine's blocked MLA prefill attention ({form} form, FP8 weights through the "
            f"bf16 policy's hooks) on one {x['model']} layer, {x['tokens']} new tokens, "
            f"plan.costs.attn_flops over {x['seconds']:.3f} s, median" + _blocks_note(x.get("tflops_blocks"))
        )

    small = a["small"]
    return {
        f"attn_{form}_tflops": (a["tflops"], src(a)),
        f"attn_{form}_tokens": (
            float(a["tokens"]),
            f"{here}: the chunk size attn_{form}_tflops was timed at",
        ),
        f"attn_{form}_tflops_small": (small["tflops"], src(small)),
        f"attn_{form}_small_tokens": (
            float(small["tokens"]),
            f"{here}: the chunk size attn_{form}_tflops_small was timed at",
        ),
    }


def _decode_attention_leaves(da: dict, here: str) -> dict:
    """The stand-in's decode attention inputs (measure/standin.decode_attention), medians of
    calibrate's blocks (each block's own times are not the value's)."""
    how = (
        f"the engine's decode attention (decode_attention_unwritten, FP8 weights through the bf16 policy's "
        f"hooks) on one {da['model']} layer, {da['weight_bytes'] / 1e6:.0f} MB read per call"
    )
    return {
        "decode_attn_mem_efficiency": (
            min(1.0, da["mem_efficiency"]),
            f"{here}: {how}: 1 row, its read rate over its side-by-side read probe"
            + _blocks_note(da["blocks"]["mem_efficiency"]),
        ),
        "gemm_read_slack": (
            da["read_slack"],
            f"{here}: {how}: {da['rows']} rows against its read (that efficiency on the round's probe) + "
            f"its flops (at bf16_tflops): (read + flops - t) / read, in [0, 1]"
            + _blocks_note(da["blocks"]["read_slack"]),
        ),
    }
