"""`ep`: the standard expert-parallel variant of `dslp`, for the ablation (PAPER.md: SmallEP
pays off while the EP size <= experts activated per token). Same plan and streaming as
dslp; the MoE dispatches each (token, expert) pair to the expert's owner with all_to_all
(sorted by destination, capacity large enough that no pair is ever dropped), computes,
all_to_all's the results back and sums them, weighted, on the token's owner."""

from __future__ import annotations

from hmoe_jax.schedules.dslp import DslpSchedule


class EpSchedule(DslpSchedule):
    name = "ep"
    moe_scheme = "ep"
