"""The baseline without technique 3: FCFS, each prompt prefilled whole (the `auto` schedule
on accelerator 0) while decoding waits, then plain batched decode up to decode_cap. What
llama.cpp-style serving does; the ablation arm the paper's policy is measured against."""

from __future__ import annotations

from hmoe_jax.policies.base import Action, Decode, Policy, Prefill, View


class FcfsPolicy(Policy):
    name = "fcfs"
    defaults = {"decode_cap": 6, "schedule": "auto"}

    def decide(self, view: View) -> tuple[Action, ...]:
        cap = int(self.options["decode_cap"])
        acts: list[Action] = []
        if view.waiting and view.free_rows > 0 and len(view.decoding) < cap:
            acts.append(Prefill(view.waiting[0].id, str(self.options["schedule"]), (0,)))
        if view.decoding:
            acts.append(Decode(view.decoding[:cap]))
        return tuple(acts)
