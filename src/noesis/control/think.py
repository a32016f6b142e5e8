"""Think budget on the Harmony analysis channel, as a turn generator over a noesis.LLM: a turn that
answers the user opens with analysis of at most `budget` tokens, then closes it and goes on
through the turn grammar, as if the model had ended it there.

Two batched generations per such turn: the analysis text after a forced
`<|channel|>analysis<|message|>` (no grammar: analysis is free text), stopped at `<|end|>` or the
budget; then, from `... <|end|><|start|>assistant`, the rest of the turn under the request's own
params (its turn grammar included: the rest starts where a turn starts). Turns after tool results
(which answer without analysis in Harmony) run as one plain generation. A confidence-based exit
decided per sentence through the same seam is noesis.control.early_exit."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

from noesis.harmony.parser import parse_completion
from noesis.session import AssistantTurn, BatchedTurnGenerator, TurnRequest


@dataclasses.dataclass(slots=True)
class _Budgeted:
    prompt: list[int]
    params: Any  # the turn's SamplingParams
    analysis: list[int]  # forced header + generated analysis text
    analysis_metrics: list


class BudgetedTurns(BatchedTurnGenerator):
    """TurnGenerator: `LLM.generate_turns` with each user-answering turn's analysis capped.
    Measured harmful on the bundled model at 8 tokens and neutral at 16 (benchmarks/RESULTS.md);
    the budgeted generations do not watch `cancel`."""

    def __init__(self, llm, budget: int) -> None:
        if llm.harmony is None:
            raise ValueError("a think budget needs a Harmony model")
        self.llm, self.budget = llm, budget
        h = llm.harmony
        self.header = [h.token_id("<|channel|>"), *h.encode_text("analysis"),
                       h.token_id("<|message|>")]  # fmt: skip
        self.close = [h.token_id("<|end|>"), h.token_id("<|start|>"), *h.encode_text("assistant")]
        self.stops = (h.token_id("<|end|>"), *h.stop_tokens_for_assistant_actions())

    def generate_turns(
        self, requests: Sequence[TurnRequest], cancel: threading.Event | None = None
    ) -> list[AssistantTurn]:
        return user_turns_through(self.llm, requests, cancel, self._budgeted)

    def _budgeted(self, requests: list[TurnRequest]) -> list[AssistantTurn]:
        llm = self.llm
        starts = []
        for r in requests:  # the prompt and params LLM.generate_turn would use
            prompt, params = llm._turn_inputs(r.messages, r.tools, r.tool_choice, r.deterministic,
                                              **r.options)  # fmt: skip
            starts.append(_Budgeted(prompt, params, list(self.header), [None] * len(self.header)))
        if self.budget > 0:
            self._think(starts)
        rests = [self._rest_params(s) for s in starts]
        outs = llm.generate([s.prompt + s.analysis + self.close for s in starts], rests)
        return [self._turn(s, out) for s, out in zip(starts, outs, strict=True)]

    def _think(self, starts: list[_Budgeted]) -> None:
        """The analysis text of every turn, batched: free text up to `<|end|>` or the budget."""
        params = [dataclasses.replace(s.params, grammar=None, max_tokens=self.budget,
                                      stop_token_ids=self.stops) for s in starts]  # fmt: skip
        outs = self.llm.generate([s.prompt + s.analysis for s in starts], params)
        for start, out in zip(starts, outs, strict=True):
            text = [t for t in out.token_ids if t not in self.stops]  # the close is forced
            start.analysis += text
            start.analysis_metrics += (out.token_metrics or [None] * len(out.token_ids))[
                : len(text)
            ]

    def _rest_params(self, start: _Budgeted):
        used = len(start.analysis) + len(self.close)
        params = start.params
        seed = None if params.seed is None else (params.seed + 1) % (2**63)  # fresh noise
        left = None if params.max_tokens is None else max(1, params.max_tokens - used)
        return dataclasses.replace(params, seed=seed, max_tokens=left)

    def _turn(self, start: _Budgeted, out) -> AssistantTurn:
        from noesis.llm import _assistant_turn  # noesis.llm imports the control package

        token_ids = start.analysis + self.close + list(out.token_ids)
        metrics = start.analysis_metrics + [None] * len(self.close) + list(out.token_metrics or ())
        parsed = parse_completion(self.llm.harmony, token_ids)
        return _assistant_turn(parsed, start.prompt, token_ids, out.finish_reason, metrics)


def user_turns_through(
    llm,
    requests: Sequence[TurnRequest],
    cancel: threading.Event | None,
    make: Callable[[list[TurnRequest]], list[AssistantTurn]],
) -> list[AssistantTurn]:
    """The turns that answer the user made by `make` (batched), the others by plain
    `llm.generate_turns`; in the order of `requests`."""
    answering = [i for i, r in enumerate(requests) if answers_the_user(r)]
    others = [i for i in range(len(requests)) if i not in answering]
    turns: list[AssistantTurn | None] = [None] * len(requests)
    for indices, made in (
        (others, llm.generate_turns([requests[i] for i in others], cancel) if others else []),
        (answering, make([requests[i] for i in answering]) if answering else []),
    ):
        for index, turn in zip(indices, made, strict=True):
            turns[index] = turn
    return turns  # type: ignore[return-value]


def answers_the_user(request: TurnRequest) -> bool:
    """A turn after the user's message (analysis comes first), not after tool results."""
    return bool(request.messages) and request.messages[-1].get("role") == "user"
