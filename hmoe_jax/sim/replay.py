"""Replaying a measured serving run on the simulated clock, and the latency numbers both
sides are compared by: what e06 (experiments/common/simserve.py) and the tiny Scheduler
replay test share. Plain data in and out (a measured request is read through its
attributes: submitted_s, prompt, token_s, finished_s, finish_reason, schedule)."""

from __future__ import annotations

import dataclasses

import numpy as np

from hmoe_jax.sim.serve import from_replay


def token_timings(token_s: list[float], arrival_s: float) -> dict[str, float | None]:
    """TTFT, TPOT (mean gap after the first token) and end-to-end latency to the LAST token
    of a request that arrived at arrival_s and produced tokens at token_s: the same for a
    measured replay-log request and a simulated one (a cancelled request's cancel time is the
    client's, not the server's; the simulated one stops at its forced last token)."""
    gaps = np.diff(token_s)
    return {
        "ttft_s": token_s[0] - arrival_s if token_s else None,
        "tpot_s": float(np.mean(gaps)) if gaps.size else None,
        "e2e_s": token_s[-1] - arrival_s if token_s else None,
    }


def replay_log(rs, t0: float) -> list[dict]:
    """What the simulator needs to replay a measured run (e06, tests/test_sim_serve.py):
    each request's arrival, prompt length, token times (s, from t0) and how it ended."""
    return [
        {
            "arrival_s": r.submitted_s - t0,
            "prompt_tokens": int(r.prompt.size),
            "token_s": [t - t0 for t in r.token_s],
            "finished_s": None if r.finished_s is None else r.finished_s - t0,
            "finish_reason": r.finish_reason,
            "schedule": r.schedule,
        }
        for r in rs
    ]


def replay_requests(kept: list[dict], max_len: int):
    """(SimRequests, stop) replaying one measured round as its client ran it. e06's client
    cancels a round's decodes once its prompt request (finish_reason "length") has its last
    token: so those requests decode until the simulated prompt request is done, not for a
    fixed count (a replay at the measured count let a faster simulated decode end before the
    prompt arrived and never see the stall). A round where every request was cancelled (the
    alone decodes, cancelled after a count of timed steps) replays the measured counts."""
    reqs = from_replay(kept)
    done_by = [i for i, x in enumerate(kept) if x.get("finish_reason") != "cancelled"]
    if len(done_by) == len(kept) or not done_by:
        return reqs, None
    for i, x in enumerate(kept):
        if x.get("finish_reason") == "cancelled":
            reqs[i] = dataclasses.replace(reqs[i], output_tokens=max_len - reqs[i].prompt_tokens)

    def stop(results) -> bool:
        return all(results[i].state == "done" for i in done_by)

    return reqs, stop


def window_tpot(decodes, t0: float, t1: float) -> float | None:
    """Mean gap between a decode's tokens over the span from its last token at or before t0
    to its first token at or after t1 (a decode that stalls through the window shows the
    stall; one that ended inside the window: to its last token), averaged over the decodes;
    None without such a span. Anything with `token_s` (a measured Request, a SimResult)."""
    per = []
    for r in decodes:
        t = r.token_s
        lo = max((i for i, x in enumerate(t) if x <= t0), default=None)
        hi = min((i for i, x in enumerate(t) if x >= t1), default=len(t) - 1 if t else None)
        if lo is not None and hi is not None and hi > lo:
            per.append((t[hi] - t[lo]) / (hi - lo))
    return float(np.mean(per)) if per else None
