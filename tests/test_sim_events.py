"""The simulator's discrete-event core (hmoe_jax/sim/events.py) against hand-computed
timelines: fair sharing of one resource, the roofline of a lone op, overhead phases,
dominant-resource fairness between ops bound on different resources, queues and deps."""

from __future__ import annotations

import pytest

from hmoe_jax.plan.format import PlanBuilder
from hmoe_jax.sim.events import Phase, SimError, Simulator


def _plan(*ops: tuple[str, tuple[int, ...]]):
    """ops: (resource, deps) in order; every op has kind "x"."""
    b = PlanBuilder("t", 1)
    for res, deps in ops:
        b.add("x", res, deps=deps)
    return b.build()


def _sim(phases_by_op, mode="pipelined"):
    """phases_by_op(plan, i) -> phases; the simulator's price hook."""
    return Simulator(lambda plan, i, devs: phases_by_op(plan, i), mode=mode)


def test_two_equal_streams_on_one_link_each_get_half():
    p1, p2 = _plan(("h2d:0", ())), _plan(("h2d:0", ()))
    sim = _sim(lambda plan, i: (Phase("link", {"h2d0": 1.0}),))
    sim.submit(p1)
    sim.submit(p2)
    sim.run_until()
    tl = sim.timeline()
    assert [r["end_s"] for r in tl] == pytest.approx([2.0, 2.0])
    assert all(r["bound"] == "h2d0" for r in tl)
    assert sim.busy_s["h2d0"] == pytest.approx(2.0)  # the link was full the whole time


def test_roofline_alone_is_the_slowest_resource():
    sim = _sim(lambda plan, i: (Phase("gemm", {"acc0": 2.0, "accmem0": 0.5}),))
    rid = sim.submit(_plan(("acc:0", ())))
    assert sim.run_until(rid=rid) == pytest.approx(2.0)
    (r,) = sim.timeline(rid)
    assert r["bound"] == "acc0" and r["alone_s"] == pytest.approx(2.0)


def test_overhead_phase_holds_the_queue_but_no_resource():
    # op A: 0.5 s overhead then 1 s on the link; op B on another queue uses the link at once:
    # B has the link alone for 0.5 s, then they share it.
    def price(plan, i):
        if plan.schedule == "a":
            return (Phase("link", {"h2d0": 1.0}, overhead_s=0.5),)
        return (Phase("link", {"h2d0": 1.0}),)

    sim = _sim(price)
    a = PlanBuilder("a", 1)
    a.add("x", "h2d:0")
    b = PlanBuilder("b", 1)
    b.add("x", "other:0")
    ra, rb = sim.submit(a.build()), sim.submit(b.build())
    sim.run_until()
    # B: 0.5 s alone (0.5 done), then half rate: 0.5 left -> 1.0 s more: ends at 1.5.
    # A: from 0.5 at half rate until 1.5 (0.5 done), then alone: 0.5 s more: ends at 2.0.
    assert sim.runs[rb].end_s == pytest.approx(1.5)
    assert sim.runs[ra].end_s == pytest.approx(2.0)
    (ta,) = sim.timeline(ra)
    assert ta["bound_s"]["overhead"] == pytest.approx(0.5)


def test_dominant_resource_fairness_is_work_conserving():
    # A needs 1 s of link and 0.5 s of DRAM, B 1 s of DRAM: DRF gives both 2/3 of their
    # dominant share until DRAM is full (1.5 s of DRAM work in all): both end at 1.5 s.
    def price(plan, i):
        return (
            (Phase("a", {"h2d0": 1.0, "dram0": 0.5}),)
            if plan.schedule == "a"
            else (Phase("b", {"dram0": 1.0}),)
        )

    sim = _sim(price)
    a, b = PlanBuilder("a", 1), PlanBuilder("b", 1)
    a.add("x", "q1")
    b.add("x", "q2")
    ra, rb = sim.submit(a.build()), sim.submit(b.build())
    sim.run_until()
    assert sim.runs[ra].end_s == pytest.approx(1.5)
    assert sim.runs[rb].end_s == pytest.approx(1.5)
    assert sim.timeline(ra)[0]["bound"] == "dram0"  # held back by DRAM, not its own link


def test_equal_dominant_shares_then_the_survivor_speeds_up():
    # A: 1 s of its link (dominant) and 0.25 s of DRAM; B: 1 s of DRAM, and C: 1 s of the
    # link of another accelerator. DRF: A and B grow at the same pace x until DRAM is full
    # (0.25 x + x = 1: x = 0.8), so both run at 0.8 and end at 1.25 s (DRAM busy throughout);
    # C shares nothing and runs at full speed (1 s).
    def price(plan, i):
        if plan.schedule == "a":
            return (Phase("a", {"h2d0": 1.0, "dram0": 0.25}),)
        return (Phase("b", {"dram0": 1.0}),)

    def price3(plan, i):
        return (Phase("c", {"h2d1": 1.0}),) if plan.schedule == "c" else price(plan, i)

    sim = _sim(price3)
    a, b, c = PlanBuilder("a", 1), PlanBuilder("b", 1), PlanBuilder("c", 1)
    a.add("x", "q1")
    b.add("x", "q2")
    c.add("x", "q3")
    ra, rb, rc = sim.submit(a.build()), sim.submit(b.build()), sim.submit(c.build())
    sim.run_until()
    assert sim.runs[ra].end_s == pytest.approx(1.25)
    assert sim.runs[rb].end_s == pytest.approx(1.25)
    assert sim.runs[rc].end_s == pytest.approx(1.0)
    assert sim.busy_s["dram0"] == pytest.approx(1.25)


def test_queue_runs_one_op_at_a_time_and_deps_order_queues():
    # op0 on acc (1 s), op1 on acc (1 s, same queue), op2 on link after op0 (1 s):
    # op1 starts at 1 (queue), op2 at 1 (dep) in parallel; total 2 s. Serial mode: 3 s.
    plan = _plan(("acc:0", ()), ("acc:0", ()), ("h2d:0", (0,)))

    def price(plan, i):
        return (Phase("p", {"acc0" if i < 2 else "h2d0": 1.0}),)

    sim = _sim(price)
    rid = sim.submit(plan)
    assert sim.run_until(rid=rid) == pytest.approx(2.0)
    starts = [r["start_s"] for r in sorted(sim.timeline(rid), key=lambda r: r["op"])]
    assert starts == pytest.approx([0.0, 1.0, 1.0])
    ser = _sim(price, mode="serial")
    rid = ser.submit(plan)
    assert ser.run_until(rid=rid) == pytest.approx(3.0)


def test_shared_group_queues_alternate_runs_and_later_submission():
    price = lambda plan, i: (Phase("p", {"acc0": 1.0}),)
    sim = _sim(price)
    r0 = sim.submit(_plan(("acc:0", ()), ("acc:0", (0,))), group="g")
    r1 = sim.submit(_plan(("acc:0", ())), group="g", at_s=0.5)
    sim.run_until()
    # one queue for both runs: r1 waits for r0's first op, then takes the queue before r0's
    # second op (ready first: at 0.5 s vs 1.0 s)
    assert sim.runs[r1].end_s == pytest.approx(2.0)
    assert sim.runs[r0].end_s == pytest.approx(3.0)
    with pytest.raises(SimError, match="before now"):
        sim.submit(_plan(("acc:0", ())), at_s=0.0)
