"""Think budget: how many analysis tokens a turn may spend (from Φ), and the confidence-based early
exit: once the last few analysis tokens were all near-certain, close analysis and answer."""

from __future__ import annotations

from dataclasses import dataclass

from noesis.sampling.metrics import TokenMetrics


@dataclass(frozen=True)
class BudgetConfig:
    confident_margin: float = 0.9  # p(top-1) - p(top-2) of a near-certain token
    confident_tokens: int = 4  # that many in a row allow an early exit
    min_tokens: int = 4  # analysis tokens before an early exit may fire


class ThinkBudget:
    """One analysis message. `observe` per analysis token returns True once it should close:
    the budget is spent, or the model has been confident long enough."""

    def __init__(self, budget: int, config: BudgetConfig | None = None) -> None:
        self.budget = budget
        self.config = config or BudgetConfig()
        self.tokens = 0
        self.confident_run = 0
        self.reason: str | None = None  # "budget" or "confident" once it fired

    def observe(self, metrics: TokenMetrics | None) -> bool:
        if self.reason is not None:
            return True
        self.tokens += 1
        sure = metrics is not None and metrics.margin >= self.config.confident_margin
        self.confident_run = self.confident_run + 1 if sure else 0
        if self.tokens >= self.budget:
            self.reason = "budget"
        elif (self.tokens >= self.config.min_tokens
              and self.confident_run >= self.config.confident_tokens):  # fmt: skip
            self.reason = "confident"
        return self.reason is not None
