"""The side-by-side compute probe (measure/probes.ReadProbe.tflops, xla_ffi/src/moe_peak*.cc)
and how a validation run re-bases the host-core rates on it (Profile.with_host_state)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from hmoe_jax.kernels import ffi
from hmoe_jax.plan.profile import load_profile


def _avx2() -> bool:
    return bool(ffi.cpu_features()["avx2"])


@pytest.mark.skipif(not _avx2(), reason="the f32 FMA probe needs AVX2 + FMA")
def test_fma_probe_counts_its_flops():
    import jax
    import jax.numpy as jnp
    import numpy as np

    from hmoe_jax.kernels.moe import fma_peak_flops

    ffi.register_all()
    call = jax.ffi.ffi_call("hmoe_fma_peak", jax.ShapeDtypeStruct((2,), jnp.float32), has_side_effect=True)
    rate, checksum = np.asarray(call(iters=np.int64(200_000), num_threads=np.int64(1)))
    assert checksum == 1  # one thread ran its loop, and its sums are nonzero
    assert math.isfinite(rate) and rate > 1e8  # 12 x 8-lane FMA chains: far above 0.1 GFLOP/s
    assert fma_peak_flops(iters=200_000, repeats=1) > 1e8
    with pytest.raises(Exception, match="iters must be >= 1"):
        np.asarray(call(iters=np.int64(0), num_threads=np.int64(1)))


def test_read_probe_names_the_loop_it_ran():
    from hmoe_jax.measure.probes import ReadProbe

    probe = ReadProbe.__new__(ReadProbe)  # no 1 GiB buffer: only the compute probe is used
    probe.all_tflops, probe.tflops_kind = [], None
    t = probe.tflops()
    feats = ffi.cpu_features()
    if not (feats["avx512"] or feats["avx2"]):
        assert t is None and probe.tflops_kind is None
        return
    assert probe.tflops_kind == ("bf16_dot" if feats["avx512"] else "fma_f32")
    assert t is not None and t > 0 and probe.all_tflops == [t]


def _with_cpu(prof, **kv):
    values = {s: dict(v) for s, v in prof.values.items()}
    src = {s: dict(v) for s, v in prof.src.items()}
    for k, v in kv.items():
        values["cpu"][k], src["cpu"][k] = v, "test"
    return dataclasses.replace(prof, values=values, src=src)


def test_host_rates_rebase_on_the_probe_over_its_calibration_reading():
    base = load_profile("paper_epyc9355_rtx5090")
    # a host-placed stand-in accelerator, as local.toml describes this machine
    values = {s: dict(v) for s, v in base.values.items()}
    values["accelerator"]["placement"] = "host"
    values["accelerator"]["attn_absorbed_tflops"] = 0.2
    prof = _with_cpu(dataclasses.replace(base, values=values), compute_probe_tflops=0.4)
    got = prof.with_host_state(100.0, 0.3, "test probe")  # the probe reads 0.75 of calibration
    for s, k in (
        ("cpu", "bf16_tflops_per_node"),
        ("accelerator", "fp32_tflops"),
        ("accelerator", "attn_absorbed_tflops"),
    ):
        assert got.values[s][k] == pytest.approx(0.75 * prof.values[s][k])
    for s, k in (("cpu", "expert_compute_efficiency"), ("accelerator", "compute_efficiency")):
        assert got.values[s][k] == prof.values[s][k]  # efficiencies stay as calibrated
    cpu = got.values["cpu"]  # the read probe re-bases the sustained read rate per node
    assert cpu["dram_gbps_per_node"] * cpu["dram_efficiency"] == pytest.approx(100.0 / prof.numa_nodes)
    # without the probe's calibrated reading: the read probe alone (no compute re-basing)
    old = dataclasses.replace(prof, values=values)
    got_old = old.with_host_state(100.0, 0.01, "test probe")
    assert got_old.values["cpu"]["bf16_tflops_per_node"] == old.values["cpu"]["bf16_tflops_per_node"]
    assert got_old.values["accelerator"]["fp32_tflops"] == old.values["accelerator"]["fp32_tflops"]
    no_probe = prof.with_host_state(100.0, None, "no probe")
    assert no_probe.values["cpu"]["bf16_tflops_per_node"] == prof.values["cpu"]["bf16_tflops_per_node"]


def test_the_read_rate_rebases_on_the_stream_probe_over_its_calibration_reading():
    """With cpu.stream_probe_gbps and a stream reading, the re-based read rate is the
    calibrated one x stream / calibrated stream (the bare read probe's reading unused); a
    stand-in's memory rate follows. Without either, the read probe's reading as before."""
    base = load_profile("paper_epyc9355_rtx5090")
    values = {s: dict(v) for s, v in base.values.items()}
    values["accelerator"]["placement"] = "host"
    prof = _with_cpu(dataclasses.replace(base, values=values), stream_probe_gbps=36.0)
    cpu = prof.values["cpu"]
    calibrated = cpu["dram_gbps_per_node"] * prof.numa_nodes * cpu["dram_efficiency"]
    got = prof.with_host_state(70.0, None, "test probe", stream_gbps=27.0)  # stream at 0.75
    g = got.values["cpu"]
    assert g["dram_gbps_per_node"] * g["dram_efficiency"] * prof.numa_nodes == pytest.approx(
        0.75 * calibrated
    )
    assert got.values["accelerator"]["mem_gbps"] == pytest.approx(0.75 * calibrated)
    for old in (
        prof.with_host_state(70.0, None, "no stream"),
        base.with_host_state(70.0, None, "x", stream_gbps=27.0),
    ):
        c = old.values["cpu"]
        assert c["dram_gbps_per_node"] * c["dram_efficiency"] * old.numa_nodes == pytest.approx(70.0)


def test_stream_probe_reads_the_read_probes_bytes_as_fp8_matrices():
    from hmoe_jax.measure.probes import STREAM_K, STREAM_N, ReadProbe, stream_matrices

    pytest.importorskip("_hmoe_ffi", reason="the stream probe runs the compiled FP8 GEMV")
    per = STREAM_N * STREAM_K
    probe = ReadProbe(nbytes=2 * per + 4096)  # two whole matrices and a tail
    mats = stream_matrices(probe.buf)
    assert len(mats) == 2
    base = probe.buf.ctypes.data
    assert [m.w.unsafe_buffer_pointer() for m in mats] == [base, base + per]  # zero-copy views
    g = probe.stream_gbps()
    assert math.isfinite(g) and g > 0 and probe.all_stream_gbps == [g]
    with pytest.raises(ValueError, match="holds no 2048 x 7168 FP8 matrix"):
        stream_matrices(probe.buf[: per - 1])


def test_the_read_rate_rebases_as_a_dram_part_and_a_fixed_part():
    """cpu.read_fixed_share u: the re-based read rate is 1 / ((1 - u) / probe + u /
    calibrated read): the calibrated rate at the calibrated probe, the probe itself at u = 0,
    and a probe 1.6x the calibration gives 1 / (0.6 / 1.6 + 0.4) = 1.29x at u = 0.4 (after
    the stream probe's mapping when the row has one)."""
    base = load_profile("paper_epyc9355_rtx5090")
    cpu = base.values["cpu"]
    cal = cpu["dram_gbps_per_node"] * base.numa_nodes * cpu["dram_efficiency"]

    def read(prof, p, stream=None):
        c = prof.with_host_state(p, None, "test", stream_gbps=stream).values["cpu"]
        return c["dram_gbps_per_node"] * c["dram_efficiency"] * prof.numa_nodes

    u4 = _with_cpu(base, read_fixed_share=0.4)
    assert read(u4, cal) == pytest.approx(cal)
    assert read(u4, 1.6 * cal) == pytest.approx(cal / (0.6 / 1.6 + 0.4))
    assert read(u4, 0.5 * cal) == pytest.approx(cal / (0.6 / 0.5 + 0.4))
    assert read(_with_cpu(base, read_fixed_share=0.0), 1.6 * cal) == pytest.approx(1.6 * cal)
    both = _with_cpu(base, read_fixed_share=0.4, stream_probe_gbps=40.0)
    assert read(both, 999.0, stream=64.0) == pytest.approx(cal / (0.6 / 1.6 + 0.4))  # stream 1.6x
