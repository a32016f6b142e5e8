"""Probe-then-skip: a turn that answers the user skips its analysis when a short probe of the
turn without analysis is confident, as a turn generator over a noesis.LLM.

The probe decodes the first `probe_tokens` tokens of the turn under the turn grammar with
analysis forbidden (noesis.structured.harmony_grammar, `analysis=False`): the channel (a call or
the final), the tool's name, the first words of an answer. Its per-token metrics come from the
distribution actually sampled after the grammar's mask (forced tokens have margin 1), so the
weakest free decision decides: when every probed token's top-1/top-2 margin reaches
`min_margin`, the turn runs without analysis; otherwise (or when a metric is missing or not
finite: fail soft) it runs as the request asked, analysis allowed. The probe's tokens are not
the answer's: the chosen generation starts again from the prompt (its prefill is cached), so
a probe costs `probe_tokens` decode steps and no tokens to answer; `ProbedTurns.stats` counts
them. Turns after tool results (which answer without analysis in Harmony) and turns without
tools or without the turn grammar run as one plain generation."""

from __future__ import annotations

import dataclasses
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from noesis.harmony.parser import parse_completion
from noesis.sampling.metrics import TokenMetrics
from noesis.session import AssistantTurn, BatchedTurnGenerator, TurnRequest
from noesis.structured.harmony_grammar import harmony_turn_spec


@dataclass(frozen=True)
class SkipConfig:
    # Tokens probed; None: the whole turn, kept as the answer when confident (no second pass).
    probe_tokens: int | None = None
    min_margin: float = 0.5  # p(top-1) - p(top-2) every probed token must reach

    def __post_init__(self) -> None:
        if self.probe_tokens is not None and self.probe_tokens < 1:
            raise ValueError(f"probe_tokens must be >= 1, got {self.probe_tokens}")
        if not 0.0 <= self.min_margin <= 1.0:
            raise ValueError(f"min_margin must be in [0, 1], got {self.min_margin}")


def probe_confident(metrics: Sequence[TokenMetrics | None], config: SkipConfig) -> bool:
    """Skip analysis? True when the probe has tokens and each one's margin reaches the floor;
    a missing or non-finite metric is no evidence (False: analysis stays)."""
    if not metrics:
        return False
    for m in metrics:
        if m is None or not math.isfinite(m.margin) or m.margin < config.min_margin:
            return False
    return True


@dataclass(slots=True)
class SkipStats:
    turns: int = 0  # user-answering turns probed
    skipped: int = 0  # of those, run without analysis
    probe_steps: int = 0  # decode steps the probes spent (not tokens to answer)
    weakest: list[float] = field(default_factory=list)  # each probe's lowest margin (NaN: none)


class ProbedTurns(BatchedTurnGenerator):
    """TurnGenerator: `LLM.generate_turns`, with each probed turn's analysis skipped when its
    probe is confident."""

    def __init__(self, llm, config: SkipConfig | None = None) -> None:
        if llm.harmony is None:
            raise ValueError("skipping analysis needs a Harmony model")
        self.llm, self.config = llm, config or SkipConfig()
        self.stats = SkipStats()

    def generate_turns(
        self, requests: Sequence[TurnRequest], cancel: threading.Event | None = None
    ) -> list[AssistantTurn]:
        inputs = [self._inputs(r) for r in requests]
        probed = [i for i, x in enumerate(inputs) if x is not None]
        kept = self._probe([inputs[i] for i in probed])  # position in `probed`: probe output
        skipped = {probed[k]: out for k, out in kept.items()}
        turns: list[AssistantTurn | None] = [None] * len(requests)
        others = [i for i in range(len(requests)) if i not in skipped]
        if others:
            plain = self.llm.generate_turns([requests[i] for i in others], cancel)
            for index, turn in zip(others, plain, strict=True):
                turns[index] = turn
        again = [i for i, out in skipped.items() if out is None]  # short probes: decode the turn
        outs = self.llm.generate([inputs[i][0] for i in again], [inputs[i][1] for i in again]) \
            if again else []  # fmt: skip
        skipped.update(zip(again, outs, strict=True))
        for index, out in skipped.items():
            turns[index] = self._turn(inputs[index][0], out)  # type: ignore[index]
        return turns  # type: ignore[return-value]

    def _inputs(self, r: TurnRequest):
        """(prompt, params without analysis) of a turn to probe, or None to run it as asked."""
        if not r.tools or not r.messages or r.messages[-1].get("role") != "user":
            return None
        prompt, params = self.llm._turn_inputs(r.messages, r.tools, r.tool_choice,
                                               r.deterministic, **r.options)  # fmt: skip
        if params.grammar is None:  # unconstrained: nothing would keep analysis out
            return None
        grounded = r.options.get("grounded", True)
        grammar = harmony_turn_spec(r.tools, r.tool_choice, r.options.get("response_format"),
                                    r.messages if grounded else None, analysis=False)  # fmt: skip
        return prompt, dataclasses.replace(params, grammar=grammar)

    def _probe(self, inputs: list) -> dict:
        """{index: the probe's output (None for a short probe)} of the confident inputs. The
        probe does not steer: its metrics are read here, not fed to the control per token."""
        if not inputs:
            return {}
        limit = self.config.probe_tokens
        params = [dataclasses.replace(p, metrics=True, control=False, max_tokens=limit or
                                      p.max_tokens) for _, p in inputs]  # fmt: skip
        outs = self.llm.generate([prompt for prompt, _ in inputs], params)
        sure = {}
        for index, out in enumerate(outs):
            self.stats.turns += 1
            self.stats.probe_steps += len(out.token_ids)
            margins = [m.margin if m is not None else math.nan for m in out.token_metrics or ()]
            self.stats.weakest.append(min(margins, default=math.nan))
            if probe_confident(out.token_metrics or [], self.config):
                self.stats.skipped += 1
                self.stats.probe_steps -= len(out.token_ids) if limit is None else 0
                sure[index] = None if limit is not None else out
        return sure

    def _turn(self, prompt: list[int], out) -> AssistantTurn:
        from noesis.llm import _assistant_turn  # noesis.llm imports the control package

        parsed = parse_completion(self.llm.harmony, list(out.token_ids))
        return _assistant_turn(parsed, prompt, out.token_ids, out.finish_reason, out.token_metrics)
