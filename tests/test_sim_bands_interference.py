"""Bands vary the interference inputs (sim/interference.py) when a profile leaves them out,
over the ends sim/bands.ABSENT_RANGES states (worked out by hand here for the paper box)."""

from __future__ import annotations

from hmoe_jax.plan.profile import load_profile
from hmoe_jax.sim.bands import band_inputs

PAPER = "paper_epyc9355_rtx5090"
KEYS = ("cpu.copy_threads", "cpu.dram_corun_efficiency", "cpu.expert_op_serialised", "cpu.xsocket_gbps")


def test_absent_interference_inputs_are_varied_over_their_stated_ends():
    prof = load_profile(PAPER).with_values({k: None for k in KEYS})
    got = {i.key: i for i in band_inputs(prof)[0]}
    assert set(KEYS) <= set(got)
    for k in KEYS:
        assert got[k].kind == "absent" and got[k].central is None and got[k].range_src
    # 56 GB/s PCIe over 7.9 GB/s a memcpy thread: ceil(7.09) = 8 threads, within min(64 cores, 8)
    assert got["cpu.copy_threads"].high == {"cpu.copy_threads": 8} and got["cpu.copy_threads"].low == {}
    assert got["cpu.expert_op_serialised"].high == {"cpu.expert_op_serialised": "process"}
    # rates: the pessimistic end is the low one
    assert got["cpu.dram_corun_efficiency"].low == {"cpu.dram_corun_efficiency": 0.75}
    # 0.4 x 614.4 GB/s x 0.8
    assert abs(got["cpu.xsocket_gbps"].low["cpu.xsocket_gbps"] - 196.608) < 1e-9
    # each end is a value the profile accepts
    for k in KEYS:
        prof.with_values(got[k].low or got[k].high)


def test_xsocket_not_varied_on_one_node_and_present_keys_not_absent():
    local = load_profile("local")  # one NUMA node; the other three measured there
    assert not {i.key for i in band_inputs(local)[0]} & set(KEYS)
    paper = load_profile(PAPER)  # states xsocket_gbps with its own range
    kinds = {i.key: i.kind for i in band_inputs(paper)[0]}
    assert kinds["cpu.xsocket_gbps"] != "absent"
