"""BeliefState: one conversation's running estimate of how sure the model is (entropy EMA, rolling
variance, a slow baseline), which mode it is in, and how reliable each tool has been."""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass, field

from noesis.sampling.metrics import TokenMetrics

FAST_ALPHA = 0.3  # entropy EMA per token: follows the last few tokens
SLOW_ALPHA = 0.02  # the slow loop's baseline: the conversation's typical entropy
WINDOW = 16  # tokens of the rolling variance
EXPLORE_NATS = 1.0  # entropy EMA above this: explore; below EXPLOIT_NATS: exploit
EXPLOIT_NATS = 0.3


class Phase(str, enum.Enum):
    EXPLORE = "explore"
    EXPLOIT = "exploit"
    TOOL_SEEKING = "tool_seeking"  # a tool call was made and its result is awaited or just read


@dataclass(slots=True)
class ToolStats:
    """One tool's outcomes from the executor."""

    calls: int = 0
    successes: int = 0
    retries: int = 0  # attempts beyond the first
    timeouts: int = 0

    @property
    def reliability(self) -> float:
        """Success rate with a uniform prior (1/2 before any call), less a share for retries."""
        success = (self.successes + 1) / (self.calls + 2)
        return success * (self.calls + 1) / (self.calls + self.retries + 1)


@dataclass(slots=True)
class BeliefState:
    phase: Phase = Phase.EXPLORE
    entropy_ema: float | None = None
    baseline: float | None = None  # slow loop
    tokens: int = 0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=WINDOW))
    tools: dict[str, ToolStats] = field(default_factory=dict)
    last_round_ok: bool | None = None  # every call of the latest tool round succeeded

    @property
    def variance(self) -> float:
        """Rolling variance of the last WINDOW entropies (0 with fewer than two)."""
        if len(self.recent) < 2:
            return 0.0
        mean = sum(self.recent) / len(self.recent)
        return sum((x - mean) ** 2 for x in self.recent) / (len(self.recent) - 1)

    def observe(self, metrics: TokenMetrics | None) -> bool:
        """Fold one token's metrics in; False (and nothing changed) when they are unusable."""
        if metrics is None or not math.isfinite(metrics.entropy) or metrics.entropy < 0:
            return False
        h = metrics.entropy
        self.entropy_ema = h if self.entropy_ema is None else _ema(self.entropy_ema, h, FAST_ALPHA)
        self.baseline = h if self.baseline is None else _ema(self.baseline, h, SLOW_ALPHA)
        self.recent.append(h)
        self.tokens += 1
        if self.phase is not Phase.TOOL_SEEKING:
            self.phase = _phase(self.phase, self.entropy_ema)
        return True

    def observe_call(self) -> None:
        """The model called a tool: its result is what it waits for."""
        self.phase = Phase.TOOL_SEEKING

    def observe_tool(self, name: str, ok: bool, attempts: int, error: str | None) -> None:
        """An executed call's outcome (noesis.tools.ToolResult's fields)."""
        stats = self.tools.setdefault(name, ToolStats())
        stats.calls += 1
        stats.successes += ok
        stats.retries += max(0, attempts - 1)
        stats.timeouts += error == "timeout"

    def reliability(self, name: str | None = None) -> float:
        """One tool's reliability, or the mean over the tools used (1/2 before any call)."""
        if name is not None:
            return self.tools.get(name, ToolStats()).reliability
        if not self.tools:
            return ToolStats().reliability
        return sum(s.reliability for s in self.tools.values()) / len(self.tools)

    def end_round(self, all_ok: bool) -> None:
        """A round of tool results was read: the model is back to answering."""
        self.last_round_ok = all_ok
        self.phase = Phase.EXPLOIT if all_ok else Phase.EXPLORE


def _ema(old: float, new: float, alpha: float) -> float:
    return old + alpha * (new - old)


def _phase(phase: Phase, entropy_ema: float) -> Phase:
    """Explore above EXPLORE_NATS, exploit below EXPLOIT_NATS; in between, stay (hysteresis)."""
    if entropy_ema > EXPLORE_NATS:
        return Phase.EXPLORE
    if entropy_ema < EXPLOIT_NATS:
        return Phase.EXPLOIT
    return phase
