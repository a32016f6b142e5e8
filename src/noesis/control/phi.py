"""The Φ controller: sampling knobs {temperature, top_p, verify_width, think_budget} moved by
per-token uncertainty against the conversation's own baseline.

Fast loop: per token, entropy EMA above (below) the slow baseline by more than `band` for
`hysteresis` tokens in a row moves every knob one step of at most `clamp` (10%) towards
conservative (confident). Slow loop: the baseline itself (BeliefState.baseline). Knobs never
leave [floor * request's value, request's value] (temperature 0 stays greedy); a token without
usable metrics resets the knobs to the request's own (fail-soft).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from noesis.control.belief import BeliefState
from noesis.sampling.metrics import TokenMetrics


@dataclass(frozen=True, slots=True)
class Phi:
    temperature: float
    top_p: float
    verify_width: int  # speculative depth for the speculator (not wired yet: see the README)
    think_budget: int  # analysis tokens allowed


@dataclass(frozen=True)
class PhiConfig:
    clamp: float = 0.10  # largest relative change of a knob per move
    hysteresis: int = 4  # tokens a direction must hold before a move (3-5)
    band: float = 0.25  # relative distance of the EMA from the baseline that is a direction
    min_gap: float = 0.05  # nats: below this no direction whatever the band (near-zero baselines)
    floor: float = 0.5  # knobs never below floor * the request's own value
    max_verify_width: int = 8
    min_think: int = 8  # the think budget moves within [min_think, base budget * 2]


class PhiController:
    """One conversation's knobs. `update(metrics, belief)` after each token (belief already
    updated with it) returns the knobs for the next one."""

    def __init__(self, base: Phi, config: PhiConfig | None = None) -> None:
        self.base = base
        self.config = config or PhiConfig()
        self.phi = base
        self.direction = 0  # +1 uncertain, -1 confident, 0 neither
        self.streak = 0
        self.fail_softs = 0  # tokens whose metrics were unusable

    def update(self, metrics: TokenMetrics | None, belief: BeliefState) -> Phi:
        if not _usable(metrics) or belief.entropy_ema is None or belief.baseline is None:
            self.fail_softs += 1
            self.phi, self.direction, self.streak = self.base, 0, 0
            return self.phi
        direction = self._direction(belief.entropy_ema, belief.baseline)
        self.streak = self.streak + 1 if direction == self.direction else 1
        self.direction = direction
        if direction and self.streak >= self.config.hysteresis:
            self.phi = self._moved(direction)
            self.streak = 0  # the next move needs another full run of tokens
        return self.phi

    def _direction(self, ema: float, baseline: float) -> int:
        gap = max(self.config.band * baseline, self.config.min_gap)
        if ema > baseline + gap:
            return 1
        if ema < baseline - gap:
            return -1
        return 0

    def _moved(self, direction: int) -> Phi:
        """One step: uncertain -> cooler, narrower nucleus, shallower speculation, more thought;
        confident -> back towards the request's knobs, deeper speculation, less thought."""
        c, base, phi = self.config, self.base, self.phi
        scale = 1 - c.clamp if direction > 0 else 1 + c.clamp
        temperature = _within(phi.temperature * scale, c.floor * base.temperature, base.temperature)
        top_p = _within(phi.top_p * scale, c.floor * base.top_p, base.top_p)
        width = _within(phi.verify_width - direction, 0, c.max_verify_width)
        think = _within(round(phi.think_budget * (1 + c.clamp * direction)), c.min_think,
                        2 * base.think_budget)  # fmt: skip
        return dataclasses.replace(
            phi, temperature=temperature, top_p=top_p, verify_width=int(width), think_budget=think
        )


def _usable(metrics: TokenMetrics | None) -> bool:
    if metrics is None:
        return False
    values = (metrics.entropy, metrics.varentropy, metrics.top_k_mass, metrics.margin)
    return all(math.isfinite(v) for v in values) and metrics.entropy >= 0


def _within(value, lo, hi):
    return min(max(value, lo), hi)
