"""Binding gate for n > 1 branches of one request: score each branch by -entropy, -contradiction
and +schema validity; prune the weakest, at most `max_prune_rate` of the live branches per check,
and only branches that scored low in `hysteresis` checks in a row. Contradiction is the
contradiction sidecar's score when a branch has one (noesis.sidecars.contradiction: its latest
result, visible from the step after it was asked), else disagreement of the branches' exact answer
strings (self-consistency)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Branch:
    mean_entropy: float  # nats per token so far
    answer: str | None = None  # what it concludes, when it has (compared across branches)
    schema_valid: bool | None = None  # its tool arguments validate (None: no call yet)
    # p(contradiction) against the context and the other branches, from the contradiction
    # sidecar (None: off, or not answered yet: the answers' self-consistency stands in)
    contradiction: float | None = None


@dataclass(frozen=True)
class GateConfig:
    max_prune_rate: float = 0.4
    hysteresis: int = 2  # checks in a row a branch must be among the weakest
    margin: float = 0.5  # a branch is weak when it scores this far below the best
    contradiction_weight: float = 1.0
    schema_weight: float = 1.0


class BindingGate:
    def __init__(self, config: GateConfig | None = None) -> None:
        self.config = config or GateConfig()
        self.weak_streak: dict[int, int] = {}

    def scores(self, branches: dict[int, Branch]) -> dict[int, float]:
        c = self.config
        answers = Counter(b.answer for b in branches.values() if b.answer is not None)
        answered = sum(answers.values())
        scores = {}
        for key, b in branches.items():
            score = -b.mean_entropy if math.isfinite(b.mean_entropy) else -math.inf
            if b.contradiction is not None:
                score -= c.contradiction_weight * b.contradiction
            elif b.answer is not None and answered > 1:
                agreement = (answers[b.answer] - 1) / (answered - 1)
                score -= c.contradiction_weight * (1 - agreement)
            if b.schema_valid is not None:
                score += c.schema_weight * (1 if b.schema_valid else -1)
            scores[key] = score
        return scores

    def prune(self, branches: dict[int, Branch]) -> list[int]:
        """Keys of the branches to stop now (live branches are those passed)."""
        scores = self.scores(branches)
        best = max(scores.values(), default=0.0)
        weak = {k for k, s in scores.items() if s < best - self.config.margin}
        self.weak_streak = {k: self.weak_streak.get(k, 0) + 1 for k in weak}
        ready = [k for k in weak if self.weak_streak[k] >= self.config.hysteresis]
        cap = math.floor(self.config.max_prune_rate * len(branches))
        pruned = sorted(ready, key=lambda k: scores[k])[:cap]
        for key in pruned:
            del self.weak_streak[key]
        return pruned
