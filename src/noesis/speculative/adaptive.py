"""DepthController: one request's proposal depth from its rolling acceptance rate, with back-off
to plain decoding and later re-probes. Pure Python, no torch: the engine calls it per step.

The rate is per tested token: a verify that accepts a of n proposals tested a + 1 tokens when
a < n (the first rejection ends the test; later proposals were never judged) and n when a == n.
accepted / tested estimates the chance that a proposal is accepted given its prefix was.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from noesis.speculative.config import SpeculativeConfig


@dataclass(slots=True)
class DepthController:
    """Per request: `depth` says how many tokens to propose this step (0 = plain decode);
    `record(proposed, accepted)` reports the step's outcome, once per step, plain steps too."""

    config: SpeculativeConfig
    _outcomes: deque[bool] = field(init=False)  # tested proposals, newest last: accepted?
    _plain_left: int = field(init=False, default=0)
    _failed_probes: int = field(init=False, default=0)
    _probing: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._outcomes = deque(maxlen=self.config.acceptance_window)

    @property
    def acceptance(self) -> float | None:
        """accepted / tested over the window, None before anything was tested."""
        if not self._outcomes:
            return None
        return sum(self._outcomes) / len(self._outcomes)

    @property
    def backed_off(self) -> bool:
        return self._plain_left > 0

    @property
    def depth(self) -> int:
        cfg = self.config
        if not cfg.adaptive:
            return cfg.k
        if self._plain_left > 0:
            return 0
        rate = self.acceptance
        if rate is None or len(self._outcomes) < cfg.min_samples:
            return cfg.k  # probe at full depth: a few steps fill the estimate
        return _depth_for(rate, cfg.k, cfg.marginal_acceptance)

    def record(self, proposed: int, accepted: int) -> None:
        """One step's outcome: `proposed` tokens offered (0 for a plain step), `accepted` kept."""
        if not 0 <= accepted <= proposed:
            raise ValueError(f"accepted must be in [0, proposed={proposed}], got {accepted}")
        if proposed == 0:
            self._plain_left = max(0, self._plain_left - 1)
            return
        self._outcomes.extend([True] * accepted)
        if accepted < proposed:
            self._outcomes.append(False)
        if self.config.adaptive:
            self._judge()

    def keeps_drafting(self, entropy: float) -> bool:
        """Whether a draft model should propose a token whose distribution has this entropy."""
        return entropy <= self.config.entropy_cutoff

    def _judge(self) -> None:
        cfg = self.config
        if len(self._outcomes) < cfg.min_samples:
            return
        if self.acceptance >= cfg.min_acceptance:
            if self._probing:  # the probe succeeded: the next back-off starts short again
                self._probing, self._failed_probes = False, 0
            return
        # Back off; each probe that fails again waits twice as long (capped).
        if self._probing:
            self._failed_probes += 1
        wait = cfg.reprobe_after * (1 << min(self._failed_probes, 30))
        self._plain_left = min(wait, cfg.max_reprobe_after)
        self._probing = True
        self._outcomes.clear()  # the probe judges the request afresh


def _depth_for(rate: float, max_depth: int, marginal: float) -> int:
    """Largest j <= max_depth with rate**j >= marginal (at least 1): the j-th proposal is worth
    its draft cost while the chance that it is reached and accepted stays above `marginal`."""
    depth = 1
    while depth < max_depth and rate ** (depth + 1) >= marginal:
        depth += 1
    return depth
