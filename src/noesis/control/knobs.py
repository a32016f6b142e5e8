"""Per-token knobs: the Φ fast loop inside one generation. The engine keeps a TokenKnobs per
sequence, feeds it each sampled token's metrics as they reach the host, and the runner samples
the next step's row with its temperature and top_p (the per-row tensors the sampler takes
anyway: no extra copy, no extra sync). With overlapped steps the metrics arrive one step late,
so a change lands a token or two after the tokens that caused it; Φ's hysteresis is longer.

The knobs are the request's own scaled by Φ's ratio to its starting point, never above the
request's (temperature 0 has no knobs at all: greedy stays greedy). top_p moves only where the
request already filters (top_p < 1): Φ never moves a row onto the sampler's sorting path."""

from __future__ import annotations

from typing import TYPE_CHECKING

from noesis.control.phi import Phi
from noesis.sampling.metrics import TokenMetrics
from noesis.sampling.params import SamplingParams

if TYPE_CHECKING:
    from noesis.control.policy import ControlPolicy, ControlState

DEFAULT_VERIFY_WIDTH = 4
DEFAULT_THINK_BUDGET = 128


def start_phi(params: SamplingParams) -> Phi:
    """The knobs a conversation's Φ starts from: the request's own."""
    return Phi(params.temperature, params.top_p, DEFAULT_VERIFY_WIDTH, DEFAULT_THINK_BUDGET)


class TokenKnobs:
    """One sequence's sampling knobs, moved by a policy after each of its tokens. The state may
    be a conversation's (noesis.control.turns.TurnControl): then the baseline and Φ carry over
    from its earlier generations."""

    __slots__ = ("policy", "state", "params", "temperature", "top_p", "_applied")

    def __init__(self, policy: ControlPolicy, state: ControlState, params: SamplingParams) -> None:
        self.policy, self.state, self.params = policy, state, params
        self._applied: tuple[Phi, Phi] | None = None
        self._apply(state.phi.phi)

    def observe(self, metrics: TokenMetrics | None) -> None:
        """One sampled token's metrics (None: unusable, e.g. NaN: the policy fails soft)."""
        self._apply(self.policy.next_phi(self.state, metrics))

    def _apply(self, phi: Phi) -> None:
        base, params = self.state.phi.base, self.params
        applied = self._applied
        if applied is not None and applied[0] is phi and applied[1] is base:
            return  # Φ moves once per `hysteresis` tokens at most: most tokens change nothing
        self._applied = (phi, base)
        self.temperature = params.temperature * _ratio(phi.temperature, base.temperature)
        self.top_p = params.top_p
        if params.top_p < 1.0:
            self.top_p = params.top_p * _ratio(phi.top_p, base.top_p)


class TokenControl:
    """The engine's seam: per-token knobs for a new sequence, or None when nothing would move
    (greedy, opted out with SamplingParams(control=False), or no policy to move them)."""

    def __init__(self, policy: ControlPolicy | None) -> None:
        self.policy = policy  # the engine's (EngineConfig.control), for control=True requests

    def knobs(self, params: SamplingParams) -> TokenKnobs | None:
        if params.greedy or params.control is False:
            return None
        if params.control is not True:  # a conversation's own control (TurnControl)
            return params.control.knobs(params)
        if self.policy is None:
            return None
        return TokenKnobs(self.policy, self.policy.begin(start_phi(params)), params)


def _ratio(now: float, start: float) -> float:
    """Φ's knob relative to where it started, at most 1: never beyond the request."""
    return min(1.0, now / start) if start > 0 else 1.0
