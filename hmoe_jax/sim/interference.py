"""Interference between concurrent work beyond fair sharing (issue 27, item 1): four small
mechanisms, each driven by one optional, sourced profile input (plan/profile.py; absent, the
mechanism is off and the simulator shares resources fairly as before).

- copy_core_demand (cpu.copy_threads): a staging copy's memcpy threads are busy cores. A copy
  phase also holds cpu<n> for its own duration, in proportion to its threads over the node's
  cores, so a concurrent CPU expert op (or a stand-in's XLA pool) gets fewer cores.
- dram_capacity (cpu.dram_corun_efficiency): two streams reading DRAM at once move less than
  one stream alone (bank / row-buffer conflicts, prefetchers defeated). When more than one
  phase uses a dram<n> resource at once, its capacity drops to that efficiency (measured by
  `hmoe calibrate`: total read rate of two concurrent readers over one alone).
- serialised_resources (cpu.expert_op_serialised = "process"): the CPU MoE op holds one
  process-wide mutex for its whole run (xla_ffi/src/moe_exec.cc, run_moe: `std::lock_guard
  <std::mutex> lock(sc.mu)` on the static Scratch), so experts_cpu ops of different engines
  (runs) in one process queue one after the other instead of sharing the cores fairly.
- cross_socket_demand (cpu.xsocket_gbps): host memory is interleaved over the NUMA nodes, so a
  copy thread or a DMA engine on one socket finds (nodes - 1) / nodes of the host bytes it
  touches on another node; those bytes cross the inter-socket link (one shared resource,
  "xsocket", at xsocket_gbps both directions together). The expert op splits experts by node
  (local reads) and is not charged.

Pure functions over plain data (no jax); sim/pricing.py and sim/events.py call them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from hmoe_jax.plan.profile import Profile

GB = 1e9
XSOCKET = "xsocket"  # the inter-socket link's resource name in a phase's demand
CPU_EXPERTS = "cpu_experts"  # the plan resource of the CPU expert op (plan/format.py)


@dataclasses.dataclass(frozen=True)
class Interference:
    """The interference inputs of a profile (None / False: that mechanism is off)."""

    nodes: int
    cores_per_node: int
    copy_threads: int | None = None
    dram_corun_efficiency: float | None = None
    xsocket_bps: float | None = None
    expert_op_serialised: bool = False


def from_profile(p: Profile) -> Interference:
    cpu = p.values["cpu"]
    xs = cpu.get("xsocket_gbps")
    return Interference(
        nodes=int(cpu["numa_nodes"]),
        cores_per_node=int(cpu["cores_per_node"]),
        copy_threads=cpu.get("copy_threads"),
        dram_corun_efficiency=cpu.get("dram_corun_efficiency"),
        xsocket_bps=float(xs) * GB if xs is not None else None,
        expert_op_serialised=cpu.get("expert_op_serialised", "none") == "process",
    )


def copy_core_demand(itf: Interference, copy_s: float) -> dict[str, float]:
    """cpu<n> seconds of a copy that takes copy_s alone: a memcpy thread is a busy core for
    the whole copy (it spins on loads and stores, it does not sleep on DRAM), so the copy
    holds threads / cores of the machine's cores, spread evenly over the nodes (the OS
    places the ring's threads; host memory is interleaved, so no node is preferred)."""
    if itf.copy_threads is None or copy_s <= 0:
        return {}
    frac = min(1.0, itf.copy_threads / (itf.nodes * itf.cores_per_node))
    return {f"cpu{n}": frac * copy_s for n in range(itf.nodes)}


def dram_capacity(itf: Interference, resource: str, users: int) -> float:
    """The fraction of `resource`'s capacity left when `users` phases use it at once: a
    dram<n> resource with more than one user delivers dram_corun_efficiency of what one
    stream alone gets (it only binds when the users together ask for more than that)."""
    if itf.dram_corun_efficiency is None or users < 2 or not resource.startswith("dram"):
        return 1.0
    return itf.dram_corun_efficiency


def cross_socket_demand(itf: Interference, host_bytes: float) -> dict[str, float]:
    """Seconds on the inter-socket link of `host_bytes` a copy or DMA touches, spread evenly
    over the nodes like the memory they live in: the far (nodes - 1) / nodes of them cross."""
    if itf.xsocket_bps is None or itf.nodes < 2 or host_bytes <= 0:
        return {}
    return {XSOCKET: host_bytes * (itf.nodes - 1) / itf.nodes / itf.xsocket_bps}


def serialised_resources(itf: Interference) -> frozenset[str]:
    """Plan resources whose ops every run (engine) of one process queues on together: the CPU
    expert op when the runtime serialises it behind its process-wide mutex."""
    return frozenset({CPU_EXPERTS}) if itf.expert_op_serialised else frozenset()


def sim_options(p: Profile) -> dict[str, object]:
    """Keyword arguments for sim/events.Simulator from a profile's interference inputs:
    capacity (dram co-run) and shared_resources (serialised ops). Empty when all are absent,
    so a profile without them times exactly as before."""
    itf = from_profile(p)
    out: dict[str, object] = {}
    if itf.dram_corun_efficiency is not None:
        cap: Callable[[str, int], float] = lambda r, n: dram_capacity(itf, r, n)  # noqa: E731
        out["capacity"] = cap
    if shared := serialised_resources(itf):
        out["shared_resources"] = shared
    return out


def add_demand(d: dict[str, float], extra: Mapping[str, float]) -> None:
    for r, s in extra.items():
        if s > 0:
            d[r] = d.get(r, 0.0) + s
