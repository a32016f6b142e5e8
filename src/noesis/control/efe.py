"""EFE-lite: emit or call a tool, decided at the header boundary (where the next message's recipient
is chosen) and applied through the turn grammar: allow, force or forbid the tool header.

    G_emit = CE_now + λ·contradiction
    G_tool = tool_cost + (1 - reliability)·failure_cost - α·expected_gain
    force the tool when G_tool + δ < G_emit - force_margin; forbid it when
    G_emit + δ < G_tool - forbid_margin; otherwise leave the choice to the model.

CE_now is the entropy EMA (nats per token: the cost of guessing on). The expected gain of a call is
the tool's prior gain, scaled by its reliability, and by `repeat_discount` once a round of calls
has already succeeded (a second look-up is expected to tell less). Contradiction is 0 until an
NLI side model exists.

Forbidding needs as clear a case as forcing. With no margin, a confident model (entropy EMA near
0) after one successful round was always forbidden its next call: on the control split's
two-call questions (benchmarks/RESULTS.md, 2026-11-28) end to end fell from 98% to 14%, and on
the single-call held-out split it saved nothing (tokens -1.2% at T = 0.7 with it and without it).
Low entropy says the model is sure of its next step, which may well be the second call.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from noesis.control.belief import BeliefState


class Decision(str, enum.Enum):
    """The tool_choice that applies the decision through the turn grammar."""

    ALLOW = "auto"
    FORCE = "required"
    FORBID = "none"


@dataclass(frozen=True)
class EfeConfig:
    delta: float = 0.02  # safety margin against flip-flopping
    lam: float = 1.0
    alpha: float = 1.0
    tool_cost: float = 0.25  # nats-equivalent cost of a call (its tokens and latency)
    failure_cost: float = 0.5
    prior_gain: float = 0.5  # a tool's expected gain before any call
    repeat_discount: float = 0.25
    force_margin: float = 1.0  # forcing needs a much clearer case than allowing
    forbid_margin: float = 1.0  # ... and so does forbidding (see the module's note)


@dataclass(frozen=True, slots=True)
class EfeScores:
    decision: Decision
    g_emit: float
    g_tool: float


def tool_vs_emit(
    belief: BeliefState, config: EfeConfig | None = None, contradiction: float = 0.0
) -> EfeScores:
    c = config or EfeConfig()
    if belief.entropy_ema is None:  # nothing observed yet: the model decides
        return EfeScores(Decision.ALLOW, float("nan"), float("nan"))
    g_emit = belief.entropy_ema + c.lam * contradiction
    reliability = belief.reliability()
    gain = c.prior_gain * reliability
    if belief.last_round_ok:
        gain *= c.repeat_discount
    g_tool = c.tool_cost + (1 - reliability) * c.failure_cost - c.alpha * gain
    if g_tool + c.delta < g_emit - c.force_margin:
        decision = Decision.FORCE
    elif g_emit + c.delta < g_tool - c.forbid_margin:
        decision = Decision.FORBID
    else:
        decision = Decision.ALLOW
    return EfeScores(decision, g_emit, g_tool)
