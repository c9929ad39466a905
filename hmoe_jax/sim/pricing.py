"""What one plan op asks of the machine: its phases, each a fixed overhead and the seconds it
would take alone on each physical resource (sim/events.py shares them).

Physical resources of a profile (plan/profile.py):
  dram<n>, cpu<n>   host DRAM read bandwidth and the host cores' compute, per NUMA node
  xbw<n>            the CPU expert kernel's own read rate on node n (DRAM x expert efficiency):
                    alone an expert op reads at that rate; beside other DRAM users it also
                    shares dram<n> at the full rate
  acc<i>, accmem<i> accelerator i's GEMM rate (the plan's compute dtype; an op's fp8_flops at
                    the fp8 rate) and memory bandwidth
                    (placement "host", a stand-in XLA CPU device: its GEMMs run on cpu<n> at
                    the measured stand-in rate and its reads also use dram<n>, so its ops and
                    the CPU experts share the same cores and DRAM; the cores that stream its
                    weights also multiply them: its busy time is its read time plus the part of
                    its flops that gemm_read_slack does not hide; a decode attention piece
                    reads at decode_attn_mem_efficiency)
  h2d<i>, d2h<i>    accelerator i's own host link, each direction (PCIe is full duplex)
  p2p<i>            accelerator i's peer link (interconnect = "p2p" only)
  copy<i>           the staging ring's copy threads of the engine whose first accelerator is i

Effective rate = peak x efficiency. Host memory is interleaved over the NUMA nodes (the
expert op splits experts by node; copies and DMA touch every node evenly), so host bytes are
spread evenly over dram<n>. Op kinds, as runtime/executor.py and runtime/dist_exec.py run them:

- accelerator pieces (embed, attn, attn_route, route, shared, dense_ffn, combine, final,
  experts_acc, forward): acc_op_s, then flops on acc<i> and bytes on accmem<i>. An op's
  args.fp8_flops (int, 0 <= fp8_flops <= flops; absent = 0) is the part of its flops that
  runs as FP8 GEMMs (kernels/fp8_gemm.py: FP8 weights under the bf16 policy on a GPU): it is
  priced at the profile's fp8 rate, the rest at the plan's compute_dtype rate (both x
  compute_efficiency); the same for the dslp compute ops' per-rank flops. experts_acc
  on a stand-in computes its group's dense_rows (plan arg: the bucketed rows that every
  expert of the group runs over) instead of its routed rows, and also converts its slot's FP8 weights inside XLA (weight_convert_gbps, when the profile has
  one: the stand-in's dense_weight pass); a prefill attention piece (attn / attn_route without
  the fused shared expert, args.form absorbed or expanded) runs at the profile's
  attn_<form>_tflops when it has one (the piece's measured rate: not one GEMM; it was
  measured running the piece as it runs, FP8 GEMMs included, so fp8_flops does not split it);
- d2h / h2d (activation hops): hop_s, then bytes on the link and on host DRAM;
- experts_cpu: cpu_op_s, then bytes on xbw<n> (the kernel's read rate: expert_bw_efficiency
  at one row per touched expert, towards expert_bw_efficiency_batched at more rows) and
  dram<n> and on cpu<n> the longer of flops / (CPU peak x expert_compute_efficiency; with the
  profile's small-M point, the efficiency at the op's rows per touched expert:
  Rates.expert_flops_at) and its read time (the kernel's threads are every core of the node,
  busy while they stream: a concurrent user of those cores slows its reads), split evenly over
  the nodes (plan.meta["expert_format"] =
  "int4": the INT4 kernel's efficiency; the bytes are already INT4's, sim/reads.py);
- stage: stage_s, then bytes on copy<i> (the threads' own rate, when the profile has one) and
  2 x bytes on DRAM (a memcpy reads and writes); with cpu.copy_threads its threads' cores on
  cpu<n>, with cpu.xsocket_gbps the far node's share on "xsocket" (sim/interference.py; a
  d2h / h2d / load link phase pays the same cross-socket share of its host bytes);
- load: load_s, then bytes on h2d<i> and DRAM (placement "host": no bytes, the stand-in's
  ring aliases the host slot); without stage ops (double_buffer=False) the load
  first does the memcpy itself (a copy phase, as stage);
- unload / dslp_unload: unload_s only;
- dslp_load: a copy phase for the ring's expert bytes (staging = "ring"), then the link phase
  for everything the rank receives;
- dslp_embed / dslp_attn / dslp_ffn / dslp_moe / dslp_final (every rank in lock-step): the
  collectives named in args.comm as their own phases (comm_split: cp attention: all-gather
  before the compute; SmallEP: all-gather, compute, reduce-scatter; EP: all_to_all, compute,
  all_to_all), each priced by _collective; the compute phase: acc_op_s, per-rank flops and
  bytes on every rank's acc<i> / accmem<i>. The simulator runs a dslp plan split by rank
  (sim/ranks.split_ranks): such an op with args.rank = r is rank r's compute alone, on acc<r>;
- collective (a rank-split plan's barrier, args.collective and args.per_rank_bytes): one
  collective over every rank. Priced from the profile's measured model when [collectives] has
  the kind (latency_s, then per-rank bytes / rate on each rank's link, + host DRAM when
  staged); else collective_s and, per rank, its share of the bytes out over d2h<i> and in over
  h2d<i> plus 2 x bytes of host DRAM (interconnect = "host": no P2P, staged through host
  memory), or over p2p<i>.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hmoe_jax.config import ModelConfig
from hmoe_jax.plan import costs
from hmoe_jax.plan.format import Op, Plan
from hmoe_jax.plan.profile import COLLECTIVE_KINDS, Profile
from hmoe_jax.sim import interference
from hmoe_jax.sim.events import Phase, SimError

ACC_PIECES = frozenset(
    {
        "embed",
        "attn",
        "attn_route",
        "route",
        "shared",
        "dense_ffn",
        "combine",
        "final",
        "experts_acc",
        "forward",
    }
)
DSLP_COMPUTE = frozenset({"dslp_embed", "dslp_attn", "dslp_ffn", "dslp_moe", "dslp_final"})
PRICED_KINDS = ACC_PIECES | DSLP_COMPUTE | {"d2h", "h2d", "experts_cpu", "stage", "load", "unload"}
PRICED_KINDS |= {"dslp_load", "dslp_unload", "collective"}
GB, TERA = 1e9, 1e12


class Rates:
    """A profile's effective rates in bytes/s and flops/s."""

    def __init__(self, p: Profile):
        cpu, acc, link = p.values["cpu"], p.values["accelerator"], p.values["link"]
        self.nodes = int(cpu["numa_nodes"])
        self.dram = cpu["dram_gbps_per_node"] * cpu["dram_efficiency"] * GB  # per node
        self.expert_dram = {"fp8": self.dram * cpu["expert_bw_efficiency"]}
        # FP8 expert kernel at r rows per touched expert: 1/efficiency linear in r between 1
        # (expert_bw_efficiency) and the measured batched point, held beyond it
        self.expert_eff1 = cpu["expert_bw_efficiency"]
        self.expert_eff_b = cpu.get("expert_bw_efficiency_batched", self.expert_eff1)
        self.expert_rpe_b = cpu.get("expert_batched_rows_per_expert", 1.0)
        if "int4_expert_bw_efficiency" in cpu:
            self.expert_dram["int4"] = self.dram * cpu["int4_expert_bw_efficiency"]
        self.expert_flops = cpu["bf16_tflops_per_node"] * cpu["expert_compute_efficiency"] * TERA
        self.copy = cpu["copy_gbps"] * GB if "copy_gbps" in cpu else None
        self.copy_cap = p.link_cap_gbps * GB if p.link_cap_gbps else None  # an emulated link's pacing
        eff = acc["compute_efficiency"]
        self.acc = {d: acc[f"{d}_tflops"] * eff * TERA for d in ("fp32", "bf16", "fp8")}
        self.acc_mem = acc["mem_gbps"] * acc["mem_efficiency"] * GB
        # a stand-in's decode attention pieces read at their own measured rate, and its
        # pieces hide gemm_read_slack of their read time's worth of flops (plan/profile.py)
        self.decode_attn_mem = (
            acc["mem_gbps"] * acc.get("decode_attn_mem_efficiency", acc["mem_efficiency"]) * GB
        )
        self.read_slack = float(acc.get("gemm_read_slack", 0.0))
        self.h2d, self.d2h = link["h2d_gbps"] * GB, link["d2h_gbps"] * GB
        self.p2p = link["p2p_gbps"] * GB if link["interconnect"] == "p2p" else None
        self.overheads = dict(p.values["overheads"])
        # kind -> (latency_s, bytes/s): the measured collective model, where the profile has it
        coll = p.values.get("collectives", {})
        self.collective = {
            kind: (coll[f"{kind}_latency_s"], coll[f"{kind}_gbps"] * GB)
            for kind in COLLECTIVE_KINDS
            if f"{kind}_gbps" in coll and f"{kind}_latency_s" in coll
        }
        self.accelerators = int(acc["count"])
        self.on_host = acc["placement"] == "host"
        self.convert = acc["weight_convert_gbps"] * GB if "weight_convert_gbps" in acc else None
        # the prefill attention piece's own rate per form (effective: no compute_efficiency)
        self.attn = {
            f: acc[f"attn_{f}_tflops"] * TERA for f in ("absorbed", "expanded") if f"attn_{f}_tflops" in acc
        }
        # form -> (small tokens, small rate, tokens of attn_<form>_tflops), where measured
        self.attn_small = {
            f: (acc[f"attn_{f}_small_tokens"], acc[f"attn_{f}_tflops_small"] * TERA, acc[f"attn_{f}_tokens"])
            for f in self.attn
            if all(f"attn_{f}_{k}" in acc for k in ("small_tokens", "tflops_small", "tokens"))
        }
        # expert compute at prefill M: (rows per expert, efficiency) at two points, or None
        keys = ("expert_compute_small_rows_per_expert", "expert_compute_efficiency_small")
        self.expert_small = (
            (cpu[keys[0]], cpu[keys[1]], cpu["expert_compute_rows_per_expert"])
            if all(k in cpu for k in (*keys, "expert_compute_rows_per_expert"))
            else None
        )
        self.expert_eff = cpu["expert_compute_efficiency"]
        self.peak = cpu["bf16_tflops_per_node"] * TERA
        self.itf = interference.from_profile(p)  # copy threads' cores, cross-socket bytes

    def attn_rate(self, form: str, tokens: int) -> float:
        """The prefill attention piece's flops/s for a chunk of `tokens` new tokens in `form`:
        attn_<form>_tflops, or with a measured small-chunk point, time per flop linear in
        tokens between the two points, held outside them."""
        rate = self.attn[form]
        if form not in self.attn_small:
            return rate
        t_s, rate_s, t_l = self.attn_small[form]
        if t_l <= t_s:
            return rate
        x = (min(max(float(tokens), t_s), t_l) - t_s) / (t_l - t_s)  # 0 at the small point, 1 at the large
        return 1.0 / ((1 - x) / rate_s + x / rate)

    def expert_flops_at(self, rows_per_expert: float) -> float:
        """The expert kernel's flops/s per node at `rows_per_expert`: expert_flops, or with
        a measured small-M point, time per flop linear in 1 / rows between the two points
        (a fixed per-expert cost shared by its rows), held outside them."""
        if self.expert_small is None or self.expert_small[2] <= self.expert_small[0]:
            return self.expert_flops
        r_s, eff_s, r_l = self.expert_small
        r = min(max(rows_per_expert, r_s), r_l)
        x = (1.0 / r - 1.0 / r_l) / (1.0 / r_s - 1.0 / r_l)  # 0 at the large point, 1 at the small
        inv = (1 - x) / self.expert_eff + x / eff_s
        return self.peak / inv

    def expert_read_at(self, rows_per_expert: float) -> float:
        """The FP8 expert kernel's read bytes/s per node at `rows_per_expert`: 1 / efficiency
        linear in rows between 1 (expert_bw_efficiency) and the measured batched point, held
        beyond it."""
        if self.expert_rpe_b <= 1:
            return self.expert_dram["fp8"]
        x = (min(rows_per_expert, self.expert_rpe_b) - 1.0) / (self.expert_rpe_b - 1.0)
        return self.dram / ((1 - x) / self.expert_eff1 + x / self.expert_eff_b)


def _add(d: dict[str, float], r: str, s: float) -> None:
    if s > 0:
        d[r] = d.get(r, 0.0) + s


def _host(d: dict[str, float], rates: Rates, nbytes: float) -> None:
    """nbytes of host DRAM traffic, spread evenly over the nodes."""
    for n in range(rates.nodes):
        _add(d, f"dram{n}", nbytes / rates.nodes / rates.dram)


def _device(devices: tuple[int, ...], resource: str, rates: Rates) -> int:
    k = int(resource.split(":")[1])
    if k >= len(devices):
        raise SimError(f"op on {resource!r}: the run has accelerators {list(devices)}")
    dev = devices[k]
    if dev >= rates.accelerators:
        raise SimError(f"op on {resource!r} maps to accelerator {dev}; the profile has {rates.accelerators}")
    return dev


def _dtype(plan: Plan) -> str:
    # gemm_dtype_whatif (sim/run.price_gemms_as, `hmoe simulate --gemm-dtype`): the GEMMs
    # priced at another dtype; compute_dtype itself stays, since the cache reads follow it
    dt = str(plan.meta.get("gemm_dtype_whatif", plan.meta.get("compute_dtype", "bf16")))
    if dt not in ("fp32", "bf16", "fp8"):
        raise SimError(f"plan {plan.schedule!r}: compute_dtype {dt!r}, expected fp32, bf16 or fp8")
    return dt


def fp8_flops(plan: Plan, op: Op) -> int:
    """The op's args.fp8_flops (0 when absent), checked against its flops."""
    f = op.args.get("fp8_flops", 0)
    if isinstance(f, bool) or not isinstance(f, int) or not 0 <= f <= op.flops:
        raise SimError(
            f"plan {plan.schedule!r}: op {op.id} ({op.kind}) has fp8_flops={f!r}; expected an int in "
            f"[0, flops={op.flops}] (the part of its flops that runs as FP8 GEMMs)"
        )
    return f


def _compute(
    rates: Rates,
    dtype: str,
    devs: tuple[int, ...],
    flops: float,
    nbytes: float,
    label: str,
    convert: bool = False,
    rate: float | None = None,
    fp8: float = 0,
    mem: float | None = None,
) -> Phase:
    """convert: the piece dequantises its FP8 weights (nbytes) inside XLA first (experts_acc);
    rate: the piece's own flops/s for all its flops (default: `fp8` of the flops at the fp8
    GEMM rate, the rest at the GEMM rate of `dtype`); mem: a stand-in piece's own read rate
    (default acc_mem, the FP8 GEMV's)."""
    d: dict[str, float] = {}
    conv_s = nbytes / rates.convert if (convert and rates.convert) else 0.0
    if rate:
        flops_s = flops / rate
    else:
        flops_s = (flops - fp8) / rates.acc[dtype] + fp8 / rates.acc["fp8"]
    for i in devs:
        _add(d, f"accmem{i}", nbytes / (mem or rates.acc_mem))
        if rates.on_host:  # a stand-in: its GEMMs (and converts) use every core, its reads host DRAM
            # The same cores unpack and multiply the weights they stream: while they wait on
            # DRAM they do gemm_read_slack of the read time's worth of flops for free, and the
            # rest of the flops adds to the read. How much hides is the CPU's: on the AVX2 Zen
            # 3 VM none (the e03 twin's attn_route took 41 ms at B=1 and 54 ms at B=4, +13 ms
            # for 3 rows whose flops cost 15.5 ms at bf16_tflops; the roofline would stay at
            # 32 ms); on the AVX-512 Zen 5 VM about half (measured by hmoe calibrate on the
            # decode attention, measure/standin.decode_attention). Absent: 0, the sum.
            # A convert pass already reads the bytes (weight_convert_gbps is its whole rate).
            read_s = 0.0 if (convert and rates.convert) else nbytes / (mem or rates.acc_mem)
            busy_s = max(read_s, flops_s + (1.0 - rates.read_slack) * read_s) + conv_s
            for n in range(rates.nodes):
                _add(d, f"cpu{n}", busy_s)
            _host(d, rates, nbytes)
        else:
            _add(d, f"acc{i}", flops_s + conv_s)
    return Phase(label, d, rates.overheads["acc_op_s"])


def _copy(rates: Rates, nbytes: float, owner: int, overhead_s: float) -> Phase:
    d: dict[str, float] = {}
    if rates.copy is not None:
        _add(d, f"copy{owner}", nbytes / rates.copy)
    _host(d, rates, 2 * nbytes)
    # a memcpy reads and writes interleaved host memory: the far node's share crosses sockets
    interference.add_demand(d, interference.cross_socket_demand(rates.itf, 2 * nbytes))
    # its threads are busy cores for as long as the memcpy itself takes alone
    # (sim/interference.py); an emulated link's pacing stretches the copy, not that time
    busy_s = max(d.values(), default=0.0)
    if rates.copy_cap is not None:
        d[f"copy{owner}"] = max(d.get(f"copy{owner}", 0.0), nbytes / rates.copy_cap)
    interference.add_demand(d, interference.copy_core_demand(rates.itf, busy_s))
    return Phase("copy", d, overhead_s)


def _link(rates: Rates, dev: int, nbytes: float, direction: str, overhead_s: float, label: str) -> Phase:
    d: dict[str, float] = {}
    _add(d, f"{direction}{dev}", nbytes / (rates.h2d if direction == "h2d" else rates.d2h))
    _host(d, rates, nbytes)
    # the accelerator's DMA engine sits on one socket: the far node's bytes cross to it
    interference.add_demand(d, interference.cross_socket_demand(rates.itf, nbytes))
    return Phase(label, d, overhead_s)


def _collective(rates: Rates, devs: tuple[int, ...], per_rank_bytes: float, label: str) -> Phase:
    """One collective of kind `label` moving per_rank_bytes per rank. With the profile's
    measured model for the kind ([collectives], measure/collectives.py): latency_s as the
    phase's overhead, then per_rank_bytes / rate on each rank's link (both directions when
    staged through host memory, or its p2p link) and the host DRAM it passes (2 x bytes per
    rank, staged): alone it takes latency_s + bytes / rate (the staged copy's DRAM time binds
    only above half the DRAM rate). Without it: collective_s, then the bytes at the link's
    own rates (out over d2h, in over h2d, + host DRAM; or over p2p)."""
    d: dict[str, float] = {}
    model = rates.collective.get(label)
    for i in devs:
        if model is not None:
            link_s = per_rank_bytes / model[1]
            for r in (f"p2p{i}",) if rates.p2p is not None else (f"d2h{i}", f"h2d{i}"):
                _add(d, r, link_s)
        elif rates.p2p is not None:
            _add(d, f"p2p{i}", per_rank_bytes / rates.p2p)
        else:  # staged through host memory: out over the rank's d2h, in over its h2d
            _add(d, f"d2h{i}", per_rank_bytes / rates.d2h)
            _add(d, f"h2d{i}", per_rank_bytes / rates.h2d)
        if rates.p2p is None:
            _host(d, rates, 2 * per_rank_bytes)
    return Phase(label, d, rates.overheads["collective_s"] if model is None else model[0])


def comm_split(comm: dict[str, Any] | None, n_devices: int) -> tuple[list, list]:
    """([(kind, per-rank bytes)] before the compute, [...] after) of an op's args.comm:
    cp attention and SmallEP all-gather before, SmallEP reduce-scatters after, EP runs one
    all_to_all each side (half its bytes each). Nothing on one device."""
    if not comm or n_devices < 2:
        return [], []
    n = int(comm.get("n_ranks", n_devices))
    ag, rs, a2a = (
        float(comm.get(k, 0)) / n for k in ("all_gather_bytes", "reduce_scatter_bytes", "all_to_all_bytes")
    )
    before, after = [], []
    if ag:
        before.append(("all_gather", ag))
    if a2a:
        before.append(("all_to_all", a2a / 2))
        after.append(("all_to_all", a2a / 2))
    if rs:
        after.append(("reduce_scatter", rs))
    return before, after


def _comm_phases(rates: Rates, devs: tuple[int, ...], comm: dict[str, Any] | None) -> tuple[list, list]:
    """(phases before the compute, phases after) of an op's collectives (comm_split)."""
    before, after = comm_split(comm, len(devs))
    return (
        [_collective(rates, devs, b, k) for k, b in before],
        [_collective(rates, devs, b, k) for k, b in after],
    )


def price_op(
    rates: Rates, plan: Plan, op: Op, devices: tuple[int, ...], cfg: ModelConfig | None = None
) -> tuple[Phase, ...]:
    """The phases of `op` (see the module docstring)."""
    o, k = rates.overheads, op.kind
    if k in ACC_PIECES:
        dev = _device(devices, op.resource, rates)
        form, fp8 = op.args.get("form"), fp8_flops(plan, op)
        if k in ("attn", "attn_route") and form in rates.attn and not op.args.get("with_shared"):
            # a prefill attention piece at its own measured rate for its chunk size (the
            # router's flops ride along)
            t0, t1 = op.args.get("tokens", (0, plan.num_tokens))
            rate = rates.attn_rate(form, int(t1) - int(t0))
            return (_compute(rates, _dtype(plan), (dev,), op.flops, op.bytes, k, rate=rate),)
        convert = k == "experts_acc"
        flops = op.flops
        if convert and rates.on_host and op.args.get("rows"):
            # the stand-in's dense grouped GEMM pays every expert of the group over the
            # group's bucketed rows (the plan's dense_rows), not the routed rows alone
            scale = float(op.args.get("dense_rows", op.args["rows"])) / float(op.args["rows"])
            flops, fp8 = flops * scale, fp8 * scale
        t0, t1 = op.args.get("tokens", (0, plan.num_tokens))
        # a decode step's attention piece (one new token per row) reads at its own measured
        # rate on a stand-in; with the shared expert inside (decode's attn_route) its ~20% of
        # the bytes ride at that rate too, though alone they would run at the GEMV's
        mem = rates.decode_attn_mem if k in ("attn", "attn_route") and int(t1) - int(t0) == 1 else None
        return (_compute(rates, _dtype(plan), (dev,), flops, op.bytes, k, convert=convert, fp8=fp8, mem=mem),)
    if k in ("d2h", "h2d"):
        return (_link(rates, _device(devices, op.resource, rates), op.bytes, k, o["hop_s"], k),)
    if k == "experts_cpu":
        fmt = str(plan.meta.get("expert_format", "fp8"))
        if fmt not in rates.expert_dram:
            raise SimError(
                f"plan {plan.schedule!r}: expert_format {fmt!r}; the profile prices {sorted(rates.expert_dram)}"
            )
        t0, t1 = op.args.get("tokens", (0, plan.num_tokens))
        rows = (int(t1) - int(t0)) * int(plan.meta.get("batch", 1))
        rate = rates.expert_dram[fmt]
        flops_rate = rates.expert_flops
        if fmt == "fp8" and rows > 1 and cfg is not None and op.bytes:
            experts = op.bytes / costs.expert_bytes(cfg)  # expected distinct experts (sim/reads.py)
            rows_per_expert = max(rows * cfg.num_experts_per_tok / experts, 1.0)
            flops_rate = rates.expert_flops_at(rows_per_expert)
            rate = rates.expert_read_at(rows_per_expert)
        d: dict[str, float] = {}
        _host(d, rates, op.bytes)
        for n in range(rates.nodes):
            read_s = op.bytes / rates.nodes / rate
            _add(d, f"xbw{n}", read_s)
            # the kernel's threads are every core of the node, busy while they stream the
            # experts as while they compute: it holds the cores for the longer of the two, so
            # a concurrent host user (a stand-in's XLA pool, a second engine) slows its reads
            _add(d, f"cpu{n}", max(op.flops / rates.nodes / flops_rate, read_s))
        return (Phase(k, d, o["cpu_op_s"]),)
    if k == "stage":
        return (_copy(rates, op.bytes, devices[0], o["stage_s"]),)
    if k == "load":
        dev = _device(devices, op.resource, rates)
        # a stand-in's device ring aliases the host slot (runtime/staging.py "alias"): the
        # hand-off moves no bytes; an emulated link (--link-gbps) throttles the copy instead
        link = _link(rates, dev, 0 if rates.on_host else op.bytes, "h2d", o["load_s"], "link")
        if plan.meta.get("double_buffer", True) is False:  # the load fills its slot itself first
            return (_copy(rates, op.bytes, devices[0], 0.0), link)
        return (link,)
    if k in ("unload", "dslp_unload"):
        return (Phase("release", {}, o["unload_s"]),)
    if k == "dslp_load":
        dev = _device(devices, op.resource, rates)
        phases = []
        if int(op.args.get("slot", -1)) >= 0 and op.args.get("experts"):
            lo, hi = op.args["experts"]
            exp = (hi - lo) * costs.expert_bytes(cfg) if cfg is not None else op.bytes
            phases.append(_copy(rates, min(exp, op.bytes), devices[0], 0.0))
        phases.append(_link(rates, dev, op.bytes, "h2d", o["load_s"], "link"))
        return tuple(phases)
    if k == "collective":  # a barrier collective of a rank-split dslp plan (sim/ranks.py)
        n = int(plan.meta.get("devices", len(devices)))
        devs = tuple(_device(devices, f"acc:{r}", rates) for r in range(n))
        label, nbytes = op.args.get("collective"), op.args.get("per_rank_bytes")
        if label not in COLLECTIVE_KINDS or not isinstance(nbytes, (int, float)):
            raise SimError(f"plan {plan.schedule!r}: op {op.id} is a collective with args {op.args!r}")
        return (_collective(rates, devs, float(nbytes), label),)
    if k in DSLP_COMPUTE and "rank" in op.args:  # one rank's compute (sim/ranks.py)
        dev = _device(devices, f"acc:{int(op.args['rank'])}", rates)
        return (_compute(rates, _dtype(plan), (dev,), op.flops, op.bytes, k, fp8=fp8_flops(plan, op)),)
    if k in DSLP_COMPUTE:
        n = int(plan.meta.get("devices", len(devices)))
        devs = tuple(_device(devices, f"acc:{r}", rates) for r in range(n))
        before, after = _comm_phases(rates, devs, op.args.get("comm"))
        compute = _compute(rates, _dtype(plan), devs, op.flops, op.bytes, k, fp8=fp8_flops(plan, op))
        return (*before, compute, *after)
    raise SimError(
        f"plan {plan.schedule!r}: op {op.id} has kind {k!r}, which the simulator does not price "
        f"(known: {sorted(PRICED_KINDS)}); add it to hmoe_jax/sim/pricing.py"
    )


def pricer(profile: Profile, cfg: ModelConfig | None = None) -> Callable[[Plan, int, tuple[int, ...]], tuple]:
    """price(plan, op_index, devices) for sim/events.Simulator."""
    rates = Rates(profile)
    return lambda plan, i, devices: price_op(rates, plan, plan.ops[i], devices, cfg)
