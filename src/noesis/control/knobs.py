"""Per-token knobs: the Φ fast loop inside one generation. The engine keeps a TokenKnobs per
sequence, feeds it each sampled token's metrics as they reach the host, and the runner samples
the next step's row with its temperature and top_p (the per-row tensors the sampler takes
anyway: no extra copy, no extra sync). With overlapped steps the metrics arrive one step late,
so a change lands a token or two after the tokens that caused it; Φ's hysteresis is longer.

The knobs are the request's own scaled by Φ's ratio to its starting point, never above the
request's (temperature 0 has no knobs at all: greedy stays greedy). top_p moves only where the
request already filters (top_p < 1): Φ never moves a row onto the sampler's sorting path."""

from __future__ import annotations

from itertools import compress
from typing import TYPE_CHECKING

import numpy as np

from noesis.control.bank import _BATCHED, BANK, Lease, batched
from noesis.control.phi import Phi
from noesis.sampling.metrics import TokenMetrics
from noesis.sampling.params import SamplingParams

if TYPE_CHECKING:
    from noesis.control.policy import ControlPolicy, ControlState

DEFAULT_VERIFY_WIDTH = 4
DEFAULT_THINK_BUDGET = 128
VECTOR_ROWS = 16  # steps with fewer controlled rows update them one at a time (observe_rows)


def start_phi(params: SamplingParams) -> Phi:
    """The knobs a conversation's Φ starts from: the request's own."""
    return Phi(params.temperature, params.top_p, DEFAULT_VERIFY_WIDTH, DEFAULT_THINK_BUDGET)


class TokenKnobs:
    """One sequence's sampling knobs, moved by a policy after each of its tokens. The state may
    be a conversation's (noesis.control.turns.TurnControl): then the baseline and Φ carry over
    from its earlier generations. Under a policy the bank reproduces (noesis.control.bank), the
    state lives in a bank row while the knobs observe, and `observe_rows` moves a whole step's
    rows at once; `state` reads it back into the objects."""

    __slots__ = ("policy", "params", "temperature", "top_p", "_state", "_lease")

    def __init__(self, policy: ControlPolicy, state: ControlState, params: SamplingParams) -> None:
        self.policy, self._state, self.params = policy, state, params
        self._lease: Lease | None = None
        self._apply(state.phi.phi)

    @property
    def state(self) -> ControlState:
        """The conversation's state, current (a bank row holding it is written back)."""
        BANK.sync(self._state)
        return self._state

    def observe(self, metrics: TokenMetrics | None) -> None:
        """One sampled token's metrics (None: unusable, e.g. NaN: the policy fails soft), through
        the policy's own objects (the reference the bank reproduces)."""
        BANK.sync(self._state)  # a bank row holding the state: back into the objects first
        self._lease = None
        self._apply(self.policy.next_phi(self._state, metrics))

    def _apply(self, phi: Phi) -> None:
        base = self._state.phi.base
        self._set(_ratio(phi.temperature, base.temperature), _ratio(phi.top_p, base.top_p))

    def _set(self, temperature_ratio: float, top_p_ratio: float) -> None:
        """The request's knobs scaled by Φ's ratios (top_p only where the request filters)."""
        params = self.params
        self.temperature = params.temperature * temperature_ratio
        self.top_p = params.top_p * top_p_ratio if params.top_p < 1.0 else params.top_p


def observe_rows(knobs: list[TokenKnobs], metrics: np.ndarray) -> None:
    """One token for each of `knobs` (one step's controlled rows), metrics [N, NUM_METRICS]
    float64 with a NaN entropy where a row has none: the bank moves their states together; a
    policy with its own next_phi is asked row by row, and so is a step of few rows (below
    VECTOR_ROWS numpy's fixed cost per call exceeds the per-row Python it saves)."""
    if len(knobs) < VECTOR_ROWS:
        for k, row in zip(knobs, metrics.tolist(), strict=True):
            k.observe(TokenMetrics.from_row(row))
        return
    slots = [k._lease.slot if k._lease is not None else None for k in knobs]
    if None in slots:  # a first token, or a state read back since: lease (or not) first
        slots = []
        for k, row in zip(knobs, metrics, strict=True):
            if not batched(k.policy):
                k.observe(TokenMetrics.from_row(row.tolist()))  # the policy's own next_phi
                slots.append(-1)
                continue
            if k._lease is None or k._lease.slot is None:
                k._lease = BANK.lease(k._state, _BATCHED[type(k.policy).next_phi])
            slots.append(k._lease.slot)
    rows = np.array(slots, dtype=np.int64)
    mine = rows >= 0
    ratios = BANK.observe_rows(rows[mine], metrics[mine]).tolist()  # [n, 2]
    for k, (temperature, top_p) in zip(compress(knobs, mine.tolist()), ratios, strict=True):
        k._set(temperature, top_p)  # the runner reads them per row: plain attributes


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
