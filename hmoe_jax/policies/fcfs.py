"""The baseline without technique 3: FCFS, each prompt prefilled whole (the `auto` schedule
on accelerator 0) while decoding waits, then plain batched decode up to decode_cap. What
llama.cpp-style serving does; the ablation arm the paper's policy is measured against.

One prefill at a time: with a prefill running in the background (P/D's prefill worker runs
every prefill so) the next waits for it. The in-process scheduler runs fcfs prefills in the
foreground, so there it never sees one."""

from __future__ import annotations

from hmoe_jax.policies.base import Action, Decode, Policy, Prefill, View


class FcfsPolicy(Policy):
    name = "fcfs"
    defaults = {"decode_cap": 6, "schedule": "auto"}
    emits = frozenset({"prefill", "decode"})

    def decide(self, view: View) -> tuple[Action, ...]:
        cap = int(self.options["decode_cap"])
        acts: list[Action] = []
        if view.waiting and not view.background and view.free_rows > 0 and len(view.decoding) < cap:
            acts.append(Prefill(view.waiting[0].id, str(self.options["schedule"]), (0,)))
        if view.decoding:
            acts.append(Decode(view.decoding[:cap]))
        return tuple(acts)
