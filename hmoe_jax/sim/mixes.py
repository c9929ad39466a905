"""Projected serving mixes on a profile (e06's projection and its headline bands): a long
prompt alone, k short requests decoding alone, then the long prompt arriving once all k
decode, through SimServer with one of e06's three backends; the TTFT and TPOT inflations the
paper's technique 3 claim is about (under 15%)."""

from __future__ import annotations

from typing import Any

from hmoe_jax.sim.replay import window_tpot
from hmoe_jax.sim.serve import SimRequest, SimServer

PROJECTION_BACKENDS = {
    "fcfs (no technique 3)": dict(policy="fcfs", decode_cap=6),
    "in-process paper policy": dict(policy="paper", decode_cap=6, dual_batch="off", last_decode_s=0.0),
    # the prefill worker with `auto` (serve/pd.py takes a schedule): short prompts by the
    # cpu schedule, long ones by slp, as the paper splits them
    "P/D disaggregation": dict(policy="fcfs", pd=True, schedule="auto", decode_cap=6),
}
PROJECTION_DECODE_TOKENS = 600  # decodes outlast the prefill (P/D prefills each 1K prompt by slp too)


def projection_lengths(quick: bool) -> tuple[int, int, int]:
    """(decode context, short prompt, long prompt) of the projection's mixes."""
    return 1024, 1024, 4096 if quick else 16384


def project_mix(
    cfg, prof, backend: str, k: int, short_len: int, long_len: int, plans_out: list | None = None
) -> dict[str, Any]:
    """One projected mix on `prof`: a long prompt alone, k short requests decoding alone, then
    the long prompt arriving once all k decode; TTFT / TPOT and their inflations. plans_out:
    gets every plan the mix's servers built (what a band prices to tell whether an input can
    move the mix)."""
    opts, max_len, dec_tokens = PROJECTION_BACKENDS[backend], long_len + 64, PROJECTION_DECODE_TOKENS

    def serve(reqs, stop=None):
        srv = SimServer(cfg, prof, max_batch=4, max_len=max_len, **opts)
        got = srv.run(reqs, stop=stop)
        if plans_out is not None:
            plans_out.extend(srv.built_plans)
        return got, srv

    def steady(rs: list) -> bool:  # all decode, and 32 steps of all of them are in
        if not all(len(r.token_s) >= 2 for r in rs):
            return False
        start = max(r.token_s[1] for r in rs)
        return all(sum(1 for t in r.token_s if t > start) >= 32 for r in rs)

    def prefilled(rs: list) -> bool:  # the window is over: the prompt's first token, and
        t1 = rs[-1].first_token_s  # a decode token after it for every decode
        return t1 is not None and all(r.token_s and r.token_s[-1] >= t1 for r in rs[:-1])

    alone_p, srv_a = serve([SimRequest(0.0, long_len, 2)])
    ttft_a = alone_p[0].first_token_s
    row = {"part": "projection_mix", "backend": backend, "mix": f"1P+{k}D" if k else "1P"}
    row.update(ttft_alone_s=ttft_a, long_prompt_tokens=long_len, long_schedule=alone_p[0].schedule)
    if not k:
        row.update(ttft_mix_s=ttft_a, ttft_inflation=1.0, no_fit=srv_a.no_fit[:1])
        return row
    dec, _ = serve([SimRequest(0.0, short_len, dec_tokens) for _ in range(k)], stop=steady)
    start = max(r.token_s[1] for r in dec)
    tpot_a = window_tpot(dec, start, min(r.token_s[-1] for r in dec))
    arrive = max(r.token_s[2] for r in dec)  # the prompt comes once all k decode
    got, srv_m = serve(
        [SimRequest(0.0, short_len, dec_tokens) for _ in range(k)] + [SimRequest(arrive, long_len, 2)],
        stop=prefilled,
    )
    p = got[-1]
    ttft_m = p.first_token_s - p.arrival_s
    tpot_m = window_tpot(got[:k], p.arrival_s, p.first_token_s)
    row.update(
        ttft_mix_s=ttft_m,
        ttft_inflation=ttft_m / ttft_a,
        tpot_alone_s=tpot_a,
        tpot_mix_s=tpot_m,
        tpot_inflation=tpot_m / tpot_a,
        mixed_throughput_gain=(ttft_a + ttft_m / tpot_m * tpot_a) / ttft_m,
        mix_long_schedule=p.schedule,
        no_fit=srv_m.no_fit[:1],
    )
    return row


def pd_worst(cfg, prof, quick: bool = False, plans_out: list | None = None) -> dict[str, Any]:
    """P/D disaggregation's worst TTFT and TPOT inflation over the mixes with decodes (1P+1D
    and 1P+2D; quick: 1P+2D), as e06's summary projected_worst_*_inflation, and whether every
    mix's plans fit (plans_out: as project_mix's)."""
    ctx, short_len, long_len = projection_lengths(quick)
    mixes = [
        project_mix(cfg, prof, "P/D disaggregation", k, short_len, long_len, plans_out)
        for k in ((2,) if quick else (1, 2))
    ]
    return {
        "projected_worst_ttft_inflation": max(m["ttft_inflation"] for m in mixes),
        "projected_worst_tpot_inflation": max(m["tpot_inflation"] for m in mixes),
        "fits": not any(m["no_fit"] for m in mixes),
    }
