"""A conversation's control state as a deterministic trace records it, and back: a replayed
generation starts its per-token knobs from the belief and Φ the conversation had reached, not
from a fresh one (noesis.telemetry.trace)."""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import Any

from noesis.control.belief import WINDOW, BeliefState, Phase, ToolStats
from noesis.control.knobs import TokenKnobs
from noesis.control.phi import Phi
from noesis.control.policy import ControlPolicy, ControlState, make_policy
from noesis.sampling.params import SamplingParams


def record_state(policy: ControlPolicy, state: ControlState) -> dict[str, Any]:
    """What a generation's knobs start from: the policy's name, the belief, Φ's controller;
    and the conversation's emit-vs-tool decisions so far (the last is this generation's)."""
    belief, phi = state.belief, state.phi
    return {
        "policy": policy.name,
        "belief": {
            "phase": belief.phase.value, "entropy_ema": belief.entropy_ema,
            "baseline": belief.baseline, "tokens": belief.tokens, "recent": list(belief.recent),
            "tools": {name: dataclasses.astuple(stats) for name, stats in belief.tools.items()},
            "last_round_ok": belief.last_round_ok,
        },
        "phi": {"base": dataclasses.astuple(phi.base), "phi": dataclasses.astuple(phi.phi),
                "direction": phi.direction, "streak": phi.streak, "fail_softs": phi.fail_softs},
        "decisions": list(state.decisions),  # emit-vs-tool, one per generation so far
    }  # fmt: skip


def restore_state(policy: ControlPolicy, data: dict[str, Any]) -> ControlState:
    """A state `policy` began and then set to what record_state wrote."""
    phi_data, belief_data = data["phi"], data["belief"]
    state = policy.begin(Phi(*phi_data["base"]))
    state.belief = BeliefState(
        phase=Phase(belief_data["phase"]), entropy_ema=belief_data["entropy_ema"],
        baseline=belief_data["baseline"], tokens=belief_data["tokens"],
        recent=deque(belief_data["recent"], maxlen=WINDOW),
        tools={name: ToolStats(*stats) for name, stats in belief_data["tools"].items()},
        last_round_ok=belief_data["last_round_ok"],
    )  # fmt: skip
    state.phi.phi = Phi(*phi_data["phi"])
    state.phi.direction, state.phi.streak = phi_data["direction"], phi_data["streak"]
    state.phi.fail_softs = phi_data["fail_softs"]
    state.decisions = list(data["decisions"])
    return state


class RecordedControl:
    """SamplingParams.control for a replayed generation of a controlled conversation: the
    engine asks it for the sequence's knobs, as it asks a live conversation's TurnControl."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.data = data

    def knobs(self, params: SamplingParams) -> TokenKnobs:
        policy = make_policy(self.data["policy"])
        assert policy is not None
        return TokenKnobs(policy, restore_state(policy, self.data), params)
