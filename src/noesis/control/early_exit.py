"""Confidence-based early exit from analysis, as a turn generator over a noesis.LLM: a turn that
answers the user writes its analysis a sentence at a time; after each sentence a probe decodes
the rest of the turn as if analysis closed there (`<|end|><|start|>assistant`, then the call or
the final; under the turn grammar, analysis forbidden). When every probed token's top-1/top-2
margin reaches the floor (noesis.control.skip.probe_confident), analysis closes there and the
probe is the rest of the turn; otherwise the next sentence follows. Analysis the model closes
itself is kept whole. Reasoning models restate and double-check after their plan: this cuts that
and keeps the plan.

Batched through `LLM.generate`: each round, every open turn's next sentence in one generation
(free text after a forced `<|channel|>analysis<|message|>`, as in noesis.control.think), then
every probe in one (at most `probe_tokens` tokens each). A sentence ends at a "." token that
does not follow a digit, so "52.5" ends none; a sentence ending in a number or date is read on to
the next. A probe that is not kept costs decode steps that are not tokens to answer
(`ExitTurns.stats`). Probes read metrics and do
not steer (control off, as in noesis.control.skip); the sentences and a rest decoded after the
model's own `<|end|>` run under the request's params. Turns after tool results run as one plain
generation. The generations do not watch `cancel`."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from noesis.control.skip import SkipConfig, probe_confident
from noesis.control.think import user_turns_through
from noesis.harmony.parser import parse_completion
from noesis.session import AssistantTurn, BatchedTurnGenerator, TurnRequest
from noesis.structured.harmony_grammar import harmony_turn_spec

SEED_LIMIT = 2**63


@dataclass(frozen=True)
class ExitConfig:
    min_margin: float = 0.8  # p(top-1) - p(top-2) every probed token must reach
    # Tokens probed: the channel, the call's recipient and first arguments, or a final's first
    # words. A confident probe that ended the turn is kept as its rest; a longer rest is decoded
    # after it (its prefill cached). None: the whole rest, every token of a final's free text
    # included (stricter, and a weak probe then costs the whole rest).
    probe_tokens: int | None = 16
    max_sentences: int = 6  # probed sentences; past them analysis runs on to its own end

    def __post_init__(self) -> None:
        SkipConfig(self.probe_tokens, self.min_margin)  # the same ranges, the same errors
        if self.max_sentences < 1:
            raise ValueError(f"max_sentences must be >= 1, got {self.max_sentences}")


@dataclass(slots=True)
class ExitStats:
    turns: int = 0  # user-answering turns
    exits: int = 0  # of those, analysis closed on a confident probe
    probes: int = 0
    probe_steps: int = 0  # decode steps of probes not kept (not tokens to answer)
    sentences: int = 0  # analysis sentences written, over all turns
    analysis_tokens: int = 0  # analysis text kept, over all turns (without the forced header)


@dataclass(slots=True)
class _Open:
    """One turn on its way: the analysis so far and, once decided, the rest."""

    prompt: list[int]
    params: Any  # the request's SamplingParams (its grammar included)
    rest: Any  # the same for the rest after analysis: analysis forbidden by the grammar
    analysis: list[int]  # the forced header, then the analysis text
    metrics: list
    sentences: int = 0
    generations: int = 0  # seeded generations so far: each draws fresh noise
    at_sentence_end: bool = False
    closed: bool = False  # analysis is over: an exit, the model's own <|end|>, or the budget
    out: Any = None  # the rest's output (a kept probe, or the rest decoded at the end)


class ExitTurns(BatchedTurnGenerator):
    """TurnGenerator: `LLM.generate_turns`, with each user-answering turn's analysis closed after
    the first sentence whose probe of the rest is confident."""

    def __init__(self, llm, config: ExitConfig | None = None) -> None:
        if llm.harmony is None:
            raise ValueError("an early exit from analysis needs a Harmony model")
        self.llm, self.config = llm, config or ExitConfig()
        self.stats = ExitStats()
        h = llm.harmony
        self.header = [h.token_id("<|channel|>"), *h.encode_text("analysis"),
                       h.token_id("<|message|>")]  # fmt: skip
        self.close = [h.token_id("<|end|>"), h.token_id("<|start|>"), *h.encode_text("assistant")]
        self.end = h.token_id("<|end|>")
        self.actions = tuple(h.stop_tokens_for_assistant_actions())
        [self.dot] = h.encode_text(".")
        self.digits = {token for d in "0123456789" for token in h.encode_text(d)}

    def generate_turns(
        self, requests: Sequence[TurnRequest], cancel: threading.Event | None = None
    ) -> list[AssistantTurn]:
        return user_turns_through(self.llm, requests, cancel, self._exiting)

    def _exiting(self, requests: list[TurnRequest]) -> list[AssistantTurn]:
        opens = [self._open(r) for r in requests]
        self._decide(opens)
        return [self._turn(o) for o in opens]

    def _open(self, r: TurnRequest) -> _Open:
        """The prompt and params LLM.generate_turn would use, and the rest's params."""
        prompt, params = self.llm._turn_inputs(r.messages, r.tools, r.tool_choice,
                                               r.deterministic, **r.options)  # fmt: skip
        rest = params
        if params.grammar is not None:  # unconstrained: nothing keeps a second analysis out
            words = r.messages if r.options.get("grounded", True) else None
            grammar = harmony_turn_spec(r.tools, r.tool_choice, r.options.get("response_format"),
                                        words, analysis=False)  # fmt: skip
            rest = dataclasses.replace(params, grammar=grammar)
        self.stats.turns += 1
        o = _Open(prompt, params, rest, list(self.header), [None] * len(self.header))
        o.closed = self._left(o) <= 1  # no room for analysis text: straight to the rest
        return o

    def _decide(self, opens: list[_Open]) -> None:
        """Sentences and probes in rounds until every turn's analysis is over; then the rest of
        the turns whose rest is not a kept probe."""
        active = [o for o in opens if not o.closed]
        while active:
            self._sentences(active)
            self._probe([o for o in active if not o.closed and o.at_sentence_end])
            active = [o for o in active if not o.closed]
        pending = [o for o in opens if o.out is None]
        if pending:
            params = [self._seeded(o, o.rest, self._left(o)) for o in pending]
            outs = self.llm.generate([o.prompt + o.analysis + self.close for o in pending], params)
            for o, out in zip(pending, outs, strict=True):
                o.out = out

    def _sentences(self, active: list[_Open]) -> None:
        """Every open turn's next sentence (or the rest of its analysis), batched."""
        params = []
        for o in active:
            stops = (self.end, *self.actions)
            if o.sentences < self.config.max_sentences:
                stops = (self.dot, *stops)
            free = dataclasses.replace(o.params, grammar=None, stop_token_ids=stops)
            params.append(self._seeded(o, free, self._left(o) - 1))  # one left for the rest
        outs = self.llm.generate([o.prompt + o.analysis for o in active], params)
        for o, out in zip(active, outs, strict=True):
            self._read_sentence(o, list(out.token_ids), out.token_metrics, out.finish_reason)

    def _read_sentence(self, o: _Open, ids: list[int], metrics, finish: str | None) -> None:
        last = ids[-1] if ids else None
        text = ids[:-1] if last == self.end or last in self.actions else ids  # the close is forced
        o.analysis += text
        o.metrics += list(metrics or [None] * len(ids))[: len(text)]
        self.stats.analysis_tokens += len(text)
        sentence = last == self.dot and len(ids) >= 2 and ids[-2] not in self.digits
        o.sentences += sentence
        self.stats.sentences += sentence
        o.at_sentence_end = sentence
        if last != self.dot or finish == "length" or self._left(o) <= 1:
            o.closed = True  # the model closed analysis (or the budget did)

    def _probe(self, probing: list[_Open]) -> None:
        """Probe the rest after each turn's last sentence; close the confident ones there."""
        if not probing:
            return
        limit = self.config.probe_tokens
        params = []
        for o in probing:
            reading = dataclasses.replace(o.rest, metrics=True, control=False)
            params.append(self._seeded(o, reading, min(limit or self._left(o), self._left(o))))
        outs = self.llm.generate([o.prompt + o.analysis + self.close for o in probing], params)
        rule = SkipConfig(limit, self.config.min_margin)
        for o, out in zip(probing, outs, strict=True):
            self.stats.probes += 1
            kept = False
            if probe_confident(out.token_metrics or [], rule):
                o.closed = True
                self.stats.exits += 1
                kept = limit is None or out.finish_reason != "length"  # it ended the turn
                o.out = out if kept else None  # None: the rest is decoded after
            self.stats.probe_steps += 0 if kept else len(out.token_ids)

    def _left(self, o: _Open) -> int:
        """Tokens the turn may still generate after its analysis so far and the close."""
        if o.params.max_tokens is None:
            return 1 << 30
        return o.params.max_tokens - len(o.analysis) - len(self.close)

    def _seeded(self, o: _Open, params, max_tokens: int):
        """`params` for the turn's next generation: fresh noise, at most `max_tokens`."""
        seed = None if params.seed is None else (params.seed + o.generations) % SEED_LIMIT
        o.generations += 1
        return dataclasses.replace(params, seed=seed, max_tokens=max(1, max_tokens))

    def _turn(self, o: _Open) -> AssistantTurn:
        from noesis.llm import _assistant_turn  # noesis.llm imports the control package

        out = o.out
        token_ids = o.analysis + self.close + list(out.token_ids)
        rest_metrics = list(out.token_metrics or [None] * len(out.token_ids))
        metrics = o.metrics + [None] * len(self.close) + rest_metrics
        parsed = parse_completion(self.llm.harmony, token_ids)
        return _assistant_turn(parsed, o.prompt, token_ids, out.finish_reason, metrics)
