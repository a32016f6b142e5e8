"""TurnControl: a conversation under a ControlPolicy, one generation at a time (noesis.session
drives it). Before each generation: the request's params with metrics on and this control as
their `control`, and the emit-vs-tool decision as the tool_choice the turn grammar enforces.
After it: the tool results into the belief.

The Φ fast loop runs per token inside the generation: the engine asks `knobs(params)` for each
sampled sequence (noesis.control.knobs) and feeds it every token's metrics, so the
conversation's belief and Φ carry from one generation into the next. A generator that never
asks (a test double, a generator without an engine) gets the turn's metrics fed afterwards and
Φ's knobs applied to its next generation's params instead."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from noesis.control.knobs import TokenKnobs, start_phi
from noesis.sampling.params import SamplingParams

if TYPE_CHECKING:
    from noesis.control.policy import ControlPolicy, ControlState

DEFAULT_TURN_TOKENS = 1024  # a turn's max_tokens when the request gives no params (as noesis.LLM)


class TurnControl:
    def __init__(self, policy: ControlPolicy) -> None:
        self.policy = policy
        self.state: ControlState | None = None
        self.per_token = False  # the generator's engine has asked for knobs
        self.steered = 0  # generations (engine requests) of the current turn steered per token

    def params(self, params: SamplingParams | None) -> SamplingParams:
        """The request's params with metrics on and this control steering them. Where the
        generator does not steer per token, Φ's temperature and top_p (as ratios of the first
        generation's, which Φ started from) apply to the whole generation instead."""
        base = params or SamplingParams(max_tokens=DEFAULT_TURN_TOKENS)
        if self.state is None:
            self.state = self.policy.begin(start_phi(base))
        self.steered = 0
        if not self.per_token:
            now, first = self.state.phi.phi, self.state.phi.base
            base = dataclasses.replace(
                base, temperature=base.temperature * _ratio(now.temperature, first.temperature),
                top_p=min(1.0, base.top_p * _ratio(now.top_p, first.top_p)),
            )  # fmt: skip
        return dataclasses.replace(base, metrics=True, control=self)

    def knobs(self, params: SamplingParams) -> TokenKnobs:
        """The engine's per-token knobs for one sequence of this conversation's generation."""
        assert self.state is not None, "params() first"
        self.per_token = True
        self.steered += 1
        return TokenKnobs(self.policy, self.state, params)

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
        if not self.steered:  # else the engine fed each token's metrics as it was sampled
            present = [metrics for metrics in token_metrics if metrics is not None]
            for metrics in present or ([None] if num_tokens else []):  # None: no metrics at all
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
