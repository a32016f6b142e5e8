"""TurnControl: a conversation under a ControlPolicy, one generation at a time (noesis.session
drives it). Before each generation: the knobs Φ set (relative to the request's own, so greedy stays
greedy) with per-token metrics switched on, and the emit-vs-tool decision as the tool_choice the
turn grammar enforces. After it: every token's metrics through the policy, then the tool results
into the belief.

The fast loop runs per token over each generation's metrics; the knobs it ends on apply from the
next generation (the engine has no per-token knob seam yet)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from noesis.control.phi import Phi
from noesis.sampling.params import SamplingParams

if TYPE_CHECKING:
    from noesis.control.policy import ControlPolicy, ControlState

DEFAULT_TURN_TOKENS = 1024  # a turn's max_tokens when the request gives no params (as noesis.LLM)
DEFAULT_VERIFY_WIDTH = 4
DEFAULT_THINK_BUDGET = 128


class TurnControl:
    def __init__(self, policy: ControlPolicy) -> None:
        self.policy = policy
        self.state: ControlState | None = None

    def params(self, params: SamplingParams | None) -> SamplingParams:
        """The request's params with Φ's temperature and top_p (as ratios of the first
        generation's, which Φ started from) and metrics on."""
        base = params or SamplingParams(max_tokens=DEFAULT_TURN_TOKENS)
        if self.state is None:
            start = Phi(base.temperature, base.top_p, DEFAULT_VERIFY_WIDTH, DEFAULT_THINK_BUDGET)
            self.state = self.policy.begin(start)
        now, first = self.state.phi.phi, self.state.phi.base
        temperature = base.temperature * _ratio(now.temperature, first.temperature)
        top_p = min(1.0, base.top_p * _ratio(now.top_p, first.top_p))
        return dataclasses.replace(base, temperature=temperature, top_p=top_p, metrics=True)

    def tool_choice(self, choice: Any) -> Any:
        """The request's `auto` becomes the policy's decision; any other choice stands."""
        assert self.state is not None, "params() first"
        decision = self.policy.tool_vs_emit(self.state) if choice == "auto" else None
        self.state.decisions.append(decision.value if decision else str(choice))
        return decision.value if decision is not None else choice

    def observe_turn(self, token_metrics: list, num_tokens: int, called: bool) -> None:
        """A generated turn: its tokens' metrics (none from a generator that has none: the
        policy fails soft), and whether it called tools."""
        assert self.state is not None
        present = [metrics for metrics in token_metrics if metrics is not None]
        for metrics in present or ([None] if num_tokens else []):  # None: a token without any
            self.policy.next_phi(self.state, metrics)  # (forced, or an accepted proposal)
        if called:
            self.state.belief.observe_call()

    def observe_results(self, results: list) -> None:
        """A round of noesis.tools.ToolResult."""
        assert self.state is not None
        belief = self.state.belief
        for result in results:
            belief.observe_tool(result.name, result.ok, result.attempts, result.error)
        belief.end_round(all(result.ok for result in results))

    def summary(self) -> dict[str, Any]:
        """What the control did in this conversation (for reports)."""
        if self.state is None:
            return {}
        phi, belief = self.state.phi, self.state.belief
        return {
            "decisions": list(self.state.decisions),
            "temperature_ratio": _ratio(phi.phi.temperature, phi.base.temperature),
            "top_p_ratio": _ratio(phi.phi.top_p, phi.base.top_p),
            "fail_softs": phi.fail_softs,
            "entropy_ema": belief.entropy_ema,
            "phase": belief.phase.value,
        }


def _ratio(now: float, first: float) -> float:
    return now / first if first > 0 else 1.0
