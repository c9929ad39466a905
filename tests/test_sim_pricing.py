"""Profiles (every number sourced), op pricing against hand arithmetic, and whole plans of
the engine's schedules timed on the paper machine against closed-form bounds."""

from __future__ import annotations

import pytest

from hmoe_jax.config import ConfigError, named_model_config
from hmoe_jax.plan import costs
from hmoe_jax.plan.format import PlanBuilder
from hmoe_jax.plan.profile import SOURCE_KINDS, load_profile, profile_from_dict, profile_names
from hmoe_jax.plan.system import SystemSpec
from hmoe_jax.sim.events import Simulator
from hmoe_jax.sim.pricing import Rates, price_op, pricer
from hmoe_jax.sim.reads import expected_experts, with_reads
from hmoe_jax.sim.run import build_plan, critical_path, simulate_request, time_plan

PAPER = "paper_epyc9355_rtx5090"


@pytest.fixture(scope="module")
def paper():
    return load_profile(PAPER)


def test_every_profile_loads_and_every_number_has_a_source():
    names = profile_names()
    assert {PAPER, "xeon8480_rtx4090"} <= set(names)
    for n in names:
        p = load_profile(n)
        for key, leaf in p.provenance().items():
            kind = leaf["src"].split(":", 1)[0]
            assert kind in SOURCE_KINDS, (n, key, leaf)
        assert SystemSpec.from_profile(p).num_accelerators == p.accelerators


def test_profile_rejects_unknown_keys_and_unsourced_values(paper):
    raw = {"format": "hmoe-sim-profile/1", "name": "x", "cpu": {"numa_nodes": 2}}
    with pytest.raises(ConfigError, match="value = ..., src"):
        profile_from_dict(raw)
    raw["cpu"] = {"numa_nodez": {"value": 2, "src": "spec: x"}}
    with pytest.raises(ConfigError, match="unknown key"):
        profile_from_dict(raw)
    raw["cpu"] = {"numa_nodes": {"value": 2, "src": "guess: x"}}
    with pytest.raises(ConfigError, match="src kind"):
        profile_from_dict(raw)


def test_paper_profile_system_spec_carries_the_rtx5090_numbers(paper):
    s = SystemSpec.from_profile(paper)
    # PAPER.md's box: 2 GPUs, PCIe 5.0 x16 ~56 GB/s, RTX 5090 dense BF16 209 TFLOPS, 32 GiB
    want = dict(num_accelerators=2, h2d_gbps=56.0, acc_bf16_tflops=209.0, acc_mem_bytes=32 * 2**30)
    assert {k: getattr(s, k) for k in want} == want
    assert s.auto_slp_min_tokens == 4096


def test_link_op_is_bytes_over_the_link_plus_its_overhead(paper):
    rates = Rates(paper)
    b = PlanBuilder("t", 1)
    b.add("h2d", "h2d:0", bytes=56_000_000)
    plan = b.build()
    (ph,) = price_op(rates, plan, plan.ops[0], (0,))
    assert ph.overhead_s == paper["overheads.hop_s"]
    assert ph.demand_s["h2d0"] == pytest.approx(1e-3)  # 56 MB at 56 GB/s
    # host DRAM: the same bytes spread over the 2 nodes at 0.8 x 614.4 GB/s each
    assert ph.demand_s["dram0"] == pytest.approx(28e6 / (614.4e9 * 0.8))


def test_cpu_experts_bound_by_the_kernels_read_rate(paper):
    rates = Rates(paper)
    cfg = named_model_config("deepseek_v3")
    b = PlanBuilder("t", 1)
    nbytes = 8 * costs.expert_bytes(cfg)
    b.add("experts_cpu", "cpu_experts", bytes=nbytes, flops=costs.expert_flops(cfg, 8))
    plan = b.build()
    (ph,) = price_op(rates, plan, plan.ops[0], (0,))
    per_node = nbytes / 2 / (614.4e9 * 0.8 * 0.93)
    assert ph.demand_s["xbw0"] == pytest.approx(per_node)
    assert max(ph.demand_s, key=ph.demand_s.get) in ("xbw0", "xbw1")
    assert ph.alone_s == pytest.approx(paper["overheads.cpu_op_s"] + per_node)


def test_expected_distinct_experts():
    cfg = named_model_config("deepseek_v3")  # 256 experts, top-8
    assert expected_experts(cfg, 1) == pytest.approx(8.0)
    assert expected_experts(cfg, 4) == pytest.approx(256 * (1 - (1 - 8 / 256) ** 4))
    assert expected_experts(cfg, 4096) == pytest.approx(256.0)


def test_decode_step_is_expert_reads_plus_gpu_reads_plus_overheads(paper):
    """Batch-1 DeepSeek-V3 decode on the paper machine: the step is a chain per layer
    (attention on the GPU, hop, CPU experts, hop back), so it is at least the sum of the
    expert reads and the GPU's weight reads, and at most that plus every op's overhead."""
    cfg = named_model_config("deepseek_v3")
    p1 = paper.with_accelerators(1)
    plan, msg = build_plan(cfg, p1, "cpu", 1, start_pos=1024, batch=1, kv_rows=1, max_len=2048)
    assert msg is None
    t = time_plan(plan, cfg, p1)
    read = with_reads(plan, cfg)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    experts_s = moe_layers * 8 * costs.expert_bytes(cfg) / (2 * 614.4e9 * 0.8 * 0.93)
    gpu_s = sum(o.bytes for o in read.ops if o.resource == "acc:0") / (1792e9 * 0.85)
    o = paper.values["overheads"]
    ovh = sum(
        {"acc": o["acc_op_s"], "d2h": o["hop_s"], "h2d": o["hop_s"], "cpu_experts": o["cpu_op_s"]}[
            op.resource.split(":")[0]
        ]
        for op in plan.ops
    )
    hops_s = sum(op.bytes for op in plan.ops if op.kind in ("d2h", "h2d")) / 56e9
    lo = experts_s + gpu_s - sum(op.bytes for op in read.ops if op.kind == "shared") / (1792e9 * 0.85)
    assert lo <= t.total_s <= experts_s + gpu_s + ovh + hops_s + 1e-9
    assert t.bound == "xbw0" or t.bound == "xbw1"  # the CPU experts' reads decide decode
    path = critical_path(t.timeline)
    assert path[-1]["op"] == 0 and path[0]["end_s"] == pytest.approx(t.total_s)


def test_slp_prefill_at_4k_is_link_bound(paper):
    """At 4K tokens a layer's experts take longer to cross PCIe than the GPU takes to
    compute them, so the prefill is the expert bytes over the link, plus the dense layers
    before the first load and the last layer's compute after it."""
    cfg = named_model_config("deepseek_v3")
    r = simulate_request(cfg, paper.with_accelerators(1), "slp", 4096)
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    link_s = moe_layers * cfg.n_routed_experts * costs.expert_bytes(cfg) / 56e9
    assert r["fits"] and r["binding"]["prefill"] == "h2d0"
    assert link_s <= r["ttft_s"] <= 1.1 * link_s


def test_two_prefills_sharing_one_link_take_twice_as_long(paper):
    """Two SLP prefills submitted together as separate runs on the same accelerator (own
    queues, one physical link and GPU): they share every resource fairly, so the pair takes
    longer than one alone and at most twice as long."""
    cfg = named_model_config("deepseek_v3_tiny")
    p1 = paper.with_accelerators(1)
    plan, _ = build_plan(cfg, p1, "slp", 512)
    plan = with_reads(plan, cfg)
    alone = Simulator(pricer(p1, cfg))
    alone.submit(plan)
    one = alone.run_until()
    both = Simulator(pricer(p1, cfg))
    both.submit(plan, devices=(0,))
    both.submit(plan, devices=(0,))
    two = both.run_until()
    assert one < two <= 2.0 * one + 1e-9


def test_batched_expert_efficiency_interpolates_time_per_expert(paper):
    """Between one row per touched expert and the calibrated batched point, the expert
    kernel's time per byte (1 / efficiency) is linear in rows per expert; beyond it, held."""
    import dataclasses

    cfg = named_model_config("deepseek_v3")
    cpu = {**paper.values["cpu"], "expert_bw_efficiency_batched": 0.5, "expert_batched_rows_per_expert": 3.0}
    prof = dataclasses.replace(paper, values={**paper.values, "cpu": cpu})
    rates = Rates(prof)
    one = costs.expert_bytes(cfg)

    def xbw_s(rows: int, experts: int) -> float:
        b = PlanBuilder("t", 1)
        b.add("experts_cpu", "cpu_experts", bytes=experts * one, tokens=[0, rows])
        plan = b.build(batch=1)
        (ph,) = price_op(rates, plan, plan.ops[0], (0,), cfg)
        return ph.demand_s["xbw0"]

    per_node = 614.4e9 * 0.8  # each node's sustained read rate; it reads half of the op's bytes
    base = 16 * one / per_node / 2
    # 2 rows x top-8 over 8 distinct experts: 2 rows per expert, halfway: 1/eff = (1/0.93 + 1/0.5) / 2
    assert xbw_s(2, 8) == pytest.approx(8 * one / per_node / 2 * (1 / 0.93 + 1 / 0.5) / 2)
    assert xbw_s(1, 8) == pytest.approx(8 * one / per_node / 2 / 0.93)  # one row: M = 1 efficiency
    assert xbw_s(64, 16) == pytest.approx(base / 0.5)  # 32 rows per expert: held at the batched point


def test_link_emulation_and_read_rebase_change_only_their_inputs(paper):
    capped = paper.with_link(1.0)
    assert capped["link.h2d_gbps"] == capped["link.d2h_gbps"] == 1.0
    # the engine's link cap paces the ring's copies; the measured memcpy rate stays (its
    # threads are busy only for that long: tests/test_sim_interference.py)
    assert capped.link_cap_gbps == 1.0 and paper.link_cap_gbps is None
    assert capped.get("cpu", "copy_gbps") == paper.get("cpu", "copy_gbps")
    assert capped.src["link"]["h2d_gbps"].startswith("derived:")
    re = paper.with_read_gbps(500.0, "measured: a probe")
    # 500 GB/s sustained over 2 nodes at efficiency 0.8: 312.5 GB/s peak per node
    assert re["cpu.dram_gbps_per_node"] == pytest.approx(312.5)
    assert re["cpu.expert_bw_efficiency"] == paper["cpu.expert_bw_efficiency"]
    assert re["accelerator.mem_gbps"] == paper["accelerator.mem_gbps"]  # a GPU's own memory


def test_int4_experts_read_fewer_bytes_and_decode_faster(paper):
    from hmoe_jax.sim.reads import int4_expert_bytes
    from hmoe_jax.sim.run import simulate_decode_step

    cfg = named_model_config("deepseek_v3")
    assert int4_expert_bytes(cfg) / costs.expert_bytes(cfg) == pytest.approx(0.531, abs=0.002)
    p1 = paper.with_accelerators(1)
    fp8 = simulate_decode_step(cfg, p1, 1024)
    int4 = simulate_decode_step(cfg, p1, 1024, expert_format="int4")
    assert int4["step_s"] < fp8["step_s"]
    with pytest.raises(ValueError):
        simulate_decode_step(cfg, p1, 1024, expert_format="int3")


def test_prefill_expert_compute_efficiency_follows_rows_per_expert(paper):
    """With a measured small-M point, the expert kernel's time per flop is linear in 1 / rows
    per expert between the two points and held outside them (hand arithmetic below)."""
    import dataclasses

    cfg = named_model_config("deepseek_v3")
    cpu = {
        **paper.values["cpu"],
        "expert_compute_efficiency": 0.8,
        "expert_compute_rows_per_expert": 64.0,
        "expert_compute_efficiency_small": 0.5,
        "expert_compute_small_rows_per_expert": 16.0,
    }
    rates = Rates(dataclasses.replace(paper, values={**paper.values, "cpu": cpu}))
    one = costs.expert_bytes(cfg)
    peak = 14.5e12  # per node

    def cpu_s(rows: int, experts: int) -> float:
        b = PlanBuilder("t", 1)
        b.add("experts_cpu", "cpu_experts", bytes=experts * one, flops=1e12, tokens=[0, rows])
        plan = b.build(batch=1)
        (ph,) = price_op(rates, plan, plan.ops[0], (0,), cfg)
        return ph.demand_s["cpu0"]

    half = 0.5e12  # each node runs half the flops
    # 1024 rows x top-8 over 256 experts = 32 rows per expert: x = (1/32 - 1/64) / (1/16 - 1/64)
    # = 1/3, so 1/eff = (2/3) / 0.8 + (1/3) / 0.5 = 1.5
    assert cpu_s(1024, 256) == pytest.approx(half / peak * 1.5)
    assert cpu_s(4096, 256) == pytest.approx(half / peak / 0.8)  # 128 per expert: held at the large point
    assert cpu_s(256, 256) == pytest.approx(half / peak / 0.5)  # 8 per expert: held at the small point
    flat = Rates(paper)  # no small point: one efficiency at every M
    b = PlanBuilder("t", 1)
    b.add("experts_cpu", "cpu_experts", bytes=256 * one, flops=1e12, tokens=[0, 1024])
    plan = b.build(batch=1)
    (ph,) = price_op(flat, plan, plan.ops[0], (0,), cfg)
    assert ph.demand_s["cpu0"] == pytest.approx(half / peak / paper["cpu.expert_compute_efficiency"])


def test_prefill_attention_runs_at_its_measured_form_rate(paper):
    """A prefill attention piece with a measured rate for its form takes flops / that rate
    (not scaled by compute_efficiency); without one, or fused with the shared expert (a decode
    piece), the GEMM rate x compute_efficiency."""
    import dataclasses

    acc = {**paper.values["accelerator"], "attn_absorbed_tflops": 50.0}
    rates = Rates(dataclasses.replace(paper, values={**paper.values, "accelerator": acc}))
    gemm = paper["accelerator.bf16_tflops"] * paper["accelerator.compute_efficiency"] * 1e12

    def acc_s(kind: str, **args) -> float:
        b = PlanBuilder("t", 1)
        b.add(kind, "acc:0", flops=1e13, tokens=[0, 128], **args)
        plan = b.build(batch=1, compute_dtype="bf16")
        (ph,) = price_op(rates, plan, plan.ops[0], (0,), None)
        return ph.demand_s["acc0"]

    assert acc_s("attn", form="absorbed") == pytest.approx(1e13 / 50e12)
    assert acc_s("attn_route", form="absorbed", with_shared=False) == pytest.approx(1e13 / 50e12)
    assert acc_s("attn_route", form="absorbed", with_shared=True) == pytest.approx(1e13 / gemm)
    assert acc_s("attn", form="expanded") == pytest.approx(1e13 / gemm)  # no expanded rate measured
    assert acc_s("shared") == pytest.approx(1e13 / gemm)
    # the engine's plans say which form each prefill attention op runs (model/attention.py's rule)
    from hmoe_jax.schedules.registry import get_schedule

    cfg = named_model_config("deepseek_v3_tiny")
    for sched in ("cpu", "slp"):
        for n, form in ((64, "absorbed"), (256, "expanded")):
            plan = get_schedule(sched).plan(cfg, SystemSpec(), n, devices=1)
            forms = {o.args.get("form") for o in plan.ops if o.kind in ("attn", "attn_route")}
            assert forms == {form}, (sched, n, forms)


def test_a_prefill_attention_rate_follows_its_chunk_size_between_two_measured_points(paper):
    """With a small-chunk point, a form's time per flop is linear in tokens between the two
    measured chunk sizes and held outside them (hand arithmetic); the calibrated leaves of
    measure/local_profile load as those keys; and a profile whose form has a measured rate
    but no points lists the points as assumed, one without the rate does not."""
    from hmoe_jax.measure.local_profile import _attention_leaves

    one = {"model": "deepseek_v3", "seconds": 0.1}
    leaves = _attention_leaves(
        "absorbed",
        {**one, "tokens": 128, "tflops": 50.0, "small": {**one, "tokens": 64, "tflops": 20.0}},
        "measured: t",
    )
    prof = paper.with_values({f"accelerator.{k}": v for k, (v, _) in leaves.items()}, "measured: t")
    rates = Rates(prof)

    def acc_s(t0: int, t1: int) -> float:
        b = PlanBuilder("t", 1)
        b.add("attn", "acc:0", flops=1e13, tokens=[t0, t1], form="absorbed")
        plan = b.build(batch=1, compute_dtype="bf16")
        (ph,) = price_op(rates, plan, plan.ops[0], (0,), None)
        return ph.demand_s["acc0"]

    assert acc_s(0, 64) == pytest.approx(1e13 / 20e12)
    assert acc_s(0, 128) == pytest.approx(1e13 / 50e12)
    assert acc_s(0, 96) == pytest.approx(1e13 * (0.5 / 20e12 + 0.5 / 50e12))  # time per flop halfway
    assert acc_s(512, 624) == pytest.approx(1e13 * (0.25 / 20e12 + 0.75 / 50e12))  # the chunk, not its start
    assert acc_s(0, 32) == pytest.approx(1e13 / 20e12)  # held below the small point
    assert acc_s(0, 200) == pytest.approx(1e13 / 50e12)  # and above the large one
    # without the small point: one rate
    flat = Rates(prof.with_values({"accelerator.attn_absorbed_tflops_small": None}))
    assert flat.attn_rate("absorbed", 64) == pytest.approx(50e12)
    # assumed inputs: listed where the form has a rate and no points, not where it has none
    absent = prof.with_values(
        {f"accelerator.{k}": None for k in leaves if k != "attn_absorbed_tflops"}
    ).absent()
    assert "accelerator.attn_absorbed_small_tokens" in absent
    assert "accelerator.attn_expanded_small_tokens" not in paper.absent()


def test_a_reading_expert_op_holds_the_cores_it_streams_with(paper):
    """The expert kernel's threads are every core of a node: while it streams experts the
    cores are busy, so its cpu<n> demand is the longer of compute and reads, and a concurrent
    compute-bound host user halves its read speed (on a stand-in box, the XLA pool)."""
    cfg = named_model_config("deepseek_v3")
    rates = Rates(paper)
    b = PlanBuilder("t", 1)
    b.add("experts_cpu", "cpu_experts", bytes=8 * costs.expert_bytes(cfg), flops=1e6, tokens=[0, 1])
    plan = b.build(batch=1)
    (ph,) = price_op(rates, plan, plan.ops[0], (0,), cfg)
    assert ph.demand_s["cpu0"] == pytest.approx(ph.demand_s["xbw0"])  # read-bound: cores held as long
    alone = ph.alone_s

    hog = PlanBuilder("hog", 1)
    hog.add("experts_cpu", "cpu_experts", flops=1e15, tokens=[0, 4096])  # compute-bound, no reads
    sim = Simulator(pricer(paper, cfg))
    sim.submit(hog.build(batch=1))
    r = sim.submit(plan)
    sim.run_until(rid=r)
    # two users of cpu0 and cpu1 at equal dominant share: the reader gets half of each core set
    assert sim.runs[r].end_s == pytest.approx(2 * alone - paper["overheads.cpu_op_s"], rel=1e-6)


def test_fp8_flops_run_at_the_fp8_rate_and_the_rest_at_the_plans_dtype(paper):
    """args.fp8_flops: that part of an accelerator op's flops at the profile's fp8 rate, the
    rest at the plan's compute_dtype rate, both x compute_efficiency (hand arithmetic from
    the profile's numbers); absent = all at compute_dtype; out of [0, flops]: a SimError
    naming the op. The dslp compute ops split the same way."""
    from hmoe_jax.sim.events import SimError

    rates = Rates(paper)
    eff = paper["accelerator.compute_efficiency"]
    bf16, fp8 = paper["accelerator.bf16_tflops"] * 1e12 * eff, paper["accelerator.fp8_tflops"] * 1e12 * eff

    def acc_s(kind: str, flops: int, dtype: str = "bf16", **args) -> float:
        b = PlanBuilder("t", 1)
        b.add(kind, "acc:0", flops=flops, tokens=[0, 128], **args)
        plan = b.build(batch=1, compute_dtype=dtype, devices=1)
        phases = price_op(rates, plan, plan.ops[0], (0,), None)
        return sum(ph.demand_s.get("acc0", 0.0) for ph in phases)

    assert acc_s("shared", 10**13) == pytest.approx(1e13 / bf16)
    # 209 x 0.7 and 419 x 0.7 TFLOPS: 4e12 flops of bf16 and 6e12 of FP8
    assert acc_s("shared", 10**13, fp8_flops=6 * 10**12) == pytest.approx(
        4e12 / (209e12 * 0.7) + 6e12 / (419e12 * 0.7)
    )
    assert acc_s("experts_acc", 10**13, fp8_flops=10**13) == pytest.approx(1e13 / fp8)
    fp32 = paper["accelerator.fp32_tflops"] * 1e12 * eff
    assert acc_s("attn", 10**13, "fp32", fp8_flops=10**12) == pytest.approx(9e12 / fp32 + 1e12 / fp8)
    assert acc_s("dslp_ffn", 10**13, fp8_flops=5 * 10**12) == pytest.approx(5e12 / bf16 + 5e12 / fp8)
    for bad in (10**13 + 1, -1, 0.5):
        with pytest.raises(SimError, match=r"op 0 \(shared\) has fp8_flops"):
            acc_s("shared", 10**13, fp8_flops=bad)


def test_a_stand_in_piece_hides_its_read_slack_of_flops_a_gpu_piece_takes_the_longer():
    """On a stand-in (placement "host") the same cores stream and multiply a piece's weights:
    its cpu demand is max(read, flops + (1 - gemm_read_slack) x read), read = bytes /
    (mem_gbps x mem_efficiency), or decode_attn_mem_efficiency for a decode step's attention
    piece (one new token per row); slack absent = 0: reads and flops add up, every extra row
    its flops; slack 1: the longer of the two. A convert piece (experts_acc) reads through
    its convert pass (no second read) and computes its plan's dense_rows (the bucketed
    rows of its group) where the plan gives them. On a GPU the roofline, each on its own resource.
    Hand arithmetic from local.toml's and the paper profile's numbers."""
    local = load_profile("local")
    acc = local.values["accelerator"]
    gemm = acc["bf16_tflops"] * acc["compute_efficiency"] * 1e12
    mem = acc["mem_gbps"] * acc["mem_efficiency"] * 1e9
    mem_dec = acc["mem_gbps"] * acc["decode_attn_mem_efficiency"] * 1e9
    assert mem_dec != mem  # measured apart: the test tells the two rates apart
    nbytes, per_row = 187e6, 2 * 187e6

    def price(r: Rates, kind: str, n: int, decode: bool, **args):
        b = PlanBuilder("t", 1)
        b.add(kind, "acc:0", flops=n * per_row, bytes=nbytes, tokens=[0, 1 if decode else n], **args)
        plan = b.build(batch=n if decode else 1, compute_dtype="bf16")
        (ph,) = price_op(r, plan, plan.ops[0], (0,), None)
        return ph

    for slack in (0.0, acc["gemm_read_slack"], 1.0):
        rates = Rates(local.with_values({"accelerator.gemm_read_slack": slack}))
        for rows in (1, 2, 4):
            read, flops = nbytes / mem_dec, rows * per_row / gemm
            ph = price(rates, "attn_route", rows, decode=True)
            assert ph.demand_s["cpu0"] == pytest.approx(max(read, flops + (1 - slack) * read))
            assert ph.demand_s["accmem0"] == pytest.approx(read)
        chunk = price(rates, "attn_route", 16, decode=False)  # a prefill chunk: the GEMV's rate
        assert chunk.demand_s["cpu0"] == pytest.approx(
            max(nbytes / mem, 16 * per_row / gemm + (1 - slack) * nbytes / mem)
        )
        conv = price(rates, "experts_acc", 16, decode=False)
        assert conv.demand_s["cpu0"] == pytest.approx(16 * per_row / gemm + nbytes / rates.convert)
        # a group planned at 16 routed rows that the dense grouped GEMM runs over 40
        dense = price(rates, "experts_acc", 16, decode=False, rows=16, dense_rows=40.0)
        assert dense.demand_s["cpu0"] == pytest.approx(40 * per_row / gemm + nbytes / rates.convert)
    add = Rates(local.with_values({"accelerator.gemm_read_slack": None}))  # absent: they add up
    four, one = price(add, "attn_route", 4, True), price(add, "attn_route", 1, True)
    assert four.demand_s["cpu0"] - one.demand_s["cpu0"] == pytest.approx(3 * per_row / gemm)
    plain = Rates(local.with_values({"accelerator.decode_attn_mem_efficiency": None}))
    assert price(plain, "attn_route", 1, True).demand_s["accmem0"] == pytest.approx(nbytes / mem)

    paper = load_profile(PAPER)
    pr = Rates(paper)
    g = price(pr, "attn_route", 4, True)
    assert "cpu0" not in g.demand_s
    # the GPU's grouped kernel skips padded tiles: dense_rows does not apply there
    gpu = price(pr, "experts_acc", 16, decode=False, rows=16, dense_rows=40.0)
    assert gpu.demand_s["acc0"] == price(pr, "experts_acc", 16, decode=False).demand_s["acc0"]
    assert g.demand_s["acc0"] == pytest.approx(4 * per_row / pr.acc["bf16"])
    assert g.demand_s["accmem0"] == pytest.approx(nbytes / pr.acc_mem)
