"""The paper's headline projections (decode FP8 / INT4, SLP at 20K and its 32K TTFT, DSLP at
32K, and the concurrency claims: P/D's worst TTFT and TPOT inflation, the batch-4 decode
gain) as the experiments compute them, with their sensitivity bands (sim/bands.py), and the
statement of which measured CPU kernel efficiency a decode projection carries over.

Each headline is computed by the same call its experiment makes (e03: simulate_decode_step
at 1K context, batch 1, one GPU; e04: simulate_request of slp on one GPU; e05: of dslp on
two; e06: sim/mixes.pd_worst and decode_step_s / decode_arms on two), so its central value
is the experiment's summary value on the same simulator and profile. `hmoe reproduce` writes headline_bands() as results/bands_<stamp>.json and draws a
tornado per headline from it (paper_figs/fig_bands.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from hmoe_jax.config import named_model_config
from hmoe_jax.plan.format import Plan
from hmoe_jax.plan.profile import Profile, load_profile
from hmoe_jax.sim.bands import METHOD, band
from hmoe_jax.sim.run import decode_step_plan, request_plans, simulate_decode_step, simulate_request

PAPER_MACHINE = "paper_epyc9355_rtx5090"


@dataclasses.dataclass(frozen=True)
class Headline:
    name: str  # the experiment's summary key
    experiment: str
    label: str
    schedule: str  # "cpu" for a decode step
    tokens: int  # decode context, or prompt length
    devices: int
    metric: str  # the simulate_* record key
    expert_format: str = "fp8"

    @property
    def decode(self) -> bool:
        return self.metric.startswith("decode")

    @property
    def serving(self) -> bool:  # e06's claims: served mixes and batched decode (sim/serve.py)
        return self.schedule in ("pd_mix", "batch")


HEADLINES = (
    Headline(
        "decode_fp8_tok_per_s",
        "e03_decode",
        "FP8 decode tok/s, 1K ctx, B=1",
        "cpu",
        1024,
        1,
        "decode_tok_per_s",
    ),
    Headline(
        "decode_int4_tok_per_s",
        "e03_decode",
        "INT4 decode tok/s, 1K ctx, B=1",
        "cpu",
        1024,
        1,
        "decode_tok_per_s",
        "int4",
    ),
    Headline(
        "slp_tok_per_s_20k",
        "e04_slp_prefill",
        "SLP prefill tok/s, 20K, 1 GPU",
        "slp",
        20480,
        1,
        "prefill_tok_per_s",
    ),
    Headline("slp_ttft_s_32k", "e04_slp_prefill", "SLP TTFT s, 32K, 1 GPU", "slp", 32768, 1, "ttft_s"),
    Headline(
        "dslp_tok_per_s_32k",
        "e05_dslp_smallep",
        "DSLP prefill tok/s, 32K, 2 GPUs",
        "dslp",
        32768,
        2,
        "prefill_tok_per_s",
    ),
    # e06: the long prompt is 16K, the decodes 1K prompts at 1K context (sim/mixes.py)
    Headline(
        "projected_worst_ttft_inflation",
        "e06_concurrency",
        "P/D worst TTFT inflation, 16K prompt beside 1-2 decodes, 2 GPUs",
        "pd_mix",
        16384,
        2,
        "projected_worst_ttft_inflation",
    ),
    Headline(
        "projected_worst_tpot_inflation",
        "e06_concurrency",
        "P/D worst TPOT inflation, 1-2 decodes beside a 16K prefill, 2 GPUs",
        "pd_mix",
        16384,
        2,
        "projected_worst_tpot_inflation",
    ),
    Headline(
        "projected_batch4_throughput_gain",
        "e06_concurrency",
        "batch-4 decode throughput over batch 1, 1K ctx, 2 GPUs",
        "batch",
        1024,
        2,
        "projected_batch4_throughput_gain",
    ),
)
BY_NAME = {h.name: h for h in HEADLINES}


def _serving_fns(
    h: Headline, cfg, quick: bool = False
) -> tuple[Callable[[Profile], dict], Callable[[Profile], list[Plan]] | None]:
    """e06's claims on a profile, as its projection computes them (experiments/common/
    simserve.project; quick: its --quick mixes, a 4K prompt beside 2 decodes, as a --quick
    e06 record holds), and the plans a band prices to skip inputs that cannot move them.
    Both P/D inflations come from the same mixes, so one evaluation per profile is kept for
    the other headline (with the plans its servers built)."""
    from hmoe_jax.sim.mixes import pd_worst
    from hmoe_jax.sim.serve import decode_arms, decode_step_s

    if h.schedule == "batch":  # ~0.1 s an evaluation: every input is run

        def gain(p: Profile) -> dict:
            t1 = decode_step_s(cfg, p, 1, h.tokens)
            return {h.metric: 4 * t1 / decode_arms(cfg, p, 4, h.tokens)["plain_step_s"]}

        return gain, None

    def run(p: Profile) -> tuple[dict, list[Plan]]:
        key = repr((quick, sorted((s, sorted(kv.items())) for s, kv in p.values.items())))
        if key not in _PD_CACHE:  # small dicts and the central's plans, one per profile run
            plans: list[Plan] = []
            _PD_CACHE[key] = (pd_worst(cfg, p, quick=quick, plans_out=plans), plans)
        return _PD_CACHE[key]

    return (lambda p: run(p)[0]), (lambda p: run(p)[1])


_PD_CACHE: dict[str, tuple[dict, list]] = {}


def _fns(
    h: Headline, cfg, quick: bool = False
) -> tuple[Callable[[Profile], dict], Callable[[Profile], list[Plan]] | None]:
    if h.serving:
        return _serving_fns(h, cfg, quick)
    if h.decode:
        return (
            lambda p: simulate_decode_step(cfg, p, h.tokens, batch=1, expert_format=h.expert_format),
            lambda p: [decode_step_plan(cfg, p, h.tokens, batch=1)["plan"]],
        )
    return (
        lambda p: simulate_request(cfg, p, h.schedule, h.tokens, expert_format=h.expert_format),
        lambda p: [d["plan"] for d in request_plans(cfg, p, h.schedule, h.tokens)],
    )


def decode_kernel(profile: Profile, expert_format: str = "fp8", batch: int = 1) -> dict[str, Any]:
    """Which CPU expert-kernel efficiency a decode projection carries and why: decode is bound
    by the routed experts' reads on the CPU (xbw), so the kernel's read efficiency over the
    host's sustained read rate sets it."""
    key = "cpu.expert_bw_efficiency" if expert_format == "fp8" else "cpu.int4_expert_bw_efficiency"
    section, k = key.split(".")
    if k not in profile.values[section]:
        return {"key": key, "value": None, "why": "absent: this profile does not project that format"}
    out: dict[str, Any] = {"key": key, "value": profile[key], "src": profile.src[section][k]}
    if key in profile.ranges:
        lo, hi, why = profile.ranges[key]
        out.update(range=[lo, hi], range_src=why)
    out["why"] = (
        "decode is bound by the CPU experts' reads (xbw): the projection carries this one measured "
        "read efficiency of the expert kernel at one row per expert, as its src names it"
        + (
            "; it is the highest of the kernel's measurements named in range_src, which the band "
            "spans (the low end is the lowest of them)"
            if key in profile.ranges and profile[key] >= profile.ranges[key][1]
            else ""
        )
    )
    if expert_format == "fp8" and batch > 1:
        b = "cpu.expert_bw_efficiency_batched"
        out["batched"] = (
            {"key": b, "value": profile[b], "src": profile.src["cpu"]["expert_bw_efficiency_batched"]}
            if "expert_bw_efficiency_batched" in profile.values["cpu"]
            else {"key": b, "value": None, "default": profile.absent().get(b)}
        )
    return out


def headline_band(
    h: Headline,
    profile: Profile | None = None,
    progress: Callable[[str], None] | None = None,
    quick: bool = False,
) -> dict[str, Any]:
    """The band of one headline on `profile` (default: the paper's machine with h.devices GPUs);
    quick: e06's headlines at its --quick sizes (the others have one size)."""
    cfg = named_model_config("deepseek_v3")
    prof = (profile or load_profile(PAPER_MACHINE)).with_accelerators(h.devices)
    evaluate, plans = _fns(h, cfg, quick)
    b = band(
        evaluate, prof, [h.metric], plans=plans, cfg=cfg, expert_format=h.expert_format, progress=progress
    )
    out = {
        "headline": h.name,
        "experiment": h.experiment,
        "label": h.label,
        "profile": prof.name,
        "accelerators": prof.accelerators,
        **b[h.metric],
    }
    if h.decode:
        out["decode_kernel"] = decode_kernel(prof, h.expert_format)
    return out


def headline_bands(
    names: list[str] | None = None, progress: Callable[[str], None] | None = None, quick: bool = False
) -> dict[str, Any]:
    """{profile, method, headlines: name -> headline_band}: what `hmoe reproduce` records."""
    unknown = sorted(set(names or []) - set(BY_NAME))
    if unknown:
        raise ValueError(f"unknown headline(s) {unknown}; known: {sorted(BY_NAME)}")
    out: dict[str, Any] = {}
    for h in HEADLINES:
        if names is None or h.name in names:
            if progress is not None:
                progress(f"[bands] {h.name} ...")
            out[h.name] = headline_band(h, progress=progress, quick=quick)
    return {"profile": PAPER_MACHINE, "model": "deepseek_v3", "method": METHOD, "headlines": out}
