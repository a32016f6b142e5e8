"""Early exit from analysis (noesis.control.early_exit) over a scripted LLM: sentences end at a
"." not after a digit, a confident probe closes analysis there and is the rest of the turn, weak
probes let analysis run on, and what the probes cost is counted (no model weights)."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
from scripted_turns import TINY_DIR, ask, ids, m

from noesis.control.early_exit import ExitConfig, ExitTurns
from noesis.harmony import NOESIS_TINY, HarmonyEncoding
from noesis.sampling.params import SamplingParams
from noesis.session import AssistantTurn, TurnRequest
from noesis.structured.harmony_grammar import harmony_turn_grammar
from noesis.structured.matcher import GrammarSpec

PROMPT = [1, 2, 3]
HEADER = "<|channel|>analysis<|message|>"
# Four "." tokens, two of them sentence ends: "2024-03-01." and "52." follow digits.
ANALYSIS = "Plan the answer. Check the date 2024-03-01. Check 52.5 units. Done."
CLOSE = "<|end|><|start|>assistant"
REST = "<|channel|>final<|message|>It is 4.<|return|>"


@dataclass
class Out:
    token_ids: list[int]
    token_metrics: list | None
    finish_reason: str = "stop"


class ScriptedLLM:
    """A model whose every user-answering turn is HEADER + ANALYSIS + CLOSE + REST. A probe or
    rest after k sentences of analysis gets margins `margins.get(k, 1.0)` on every token."""

    def __init__(self, encoding, margins: dict[int, float] | None = None, max_tokens: int = 200):
        self.harmony, self.margins, self.max_tokens = encoding, margins or {}, max_tokens
        self.calls: list[list[SamplingParams]] = []
        self.plain: list[TurnRequest] = []

    def _turn_inputs(self, messages, tools, tool_choice, deterministic, **options):
        grammar = GrammarSpec.lark(harmony_turn_grammar(tools, tool_choice))
        return list(PROMPT), SamplingParams(max_tokens=self.max_tokens, grammar=grammar,
                                            temperature=0.7, seed=100)  # fmt: skip

    def generate(self, prompts, params):
        self.calls.append(list(params))
        return [self._one(prompt, p) for prompt, p in zip(prompts, params, strict=True)]

    def _one(self, prompt: list[int], p: SamplingParams) -> Out:
        h = self.harmony
        written = prompt[len(PROMPT) :]
        close = ids(h, CLOSE)
        if written[-len(close) :] == close:  # a probe or the rest, after analysis
            assert "start: (call | final)" in p.grammar.source  # analysis forbidden
            analysis = written[len(ids(h, HEADER)) : -len(close)]
            sentences = len(re.findall(r"[a-z]\.", h.decode(analysis)))
            rest = ids(h, REST)
            out = rest[: p.max_tokens]
            finish = "length" if len(out) < len(rest) else "stop"
            return Out(out, [m(self.margins.get(sentences, 1.0))] * len(out), finish)
        assert p.grammar is None  # analysis is free text
        whole = ids(h, HEADER + ANALYSIS + "<|end|>")
        assert whole[: len(written)] == written
        out = []
        for token in whole[len(written) :][: p.max_tokens]:
            out.append(token)
            if token in p.stop_token_ids:
                break
        finish = "length" if len(out) == p.max_tokens and out[-1] not in p.stop_token_ids \
            else "stop"  # fmt: skip
        return Out(out, [m(0.5)] * len(out), finish)

    def generate_turns(self, requests, cancel=None):
        self.plain += requests
        return [AssistantTurn("", [], "plain", 3, 5, "stop") for _ in requests]


@pytest.fixture(scope="module")
def encoding():
    return HarmonyEncoding.from_file(TINY_DIR, NOESIS_TINY)


def turn_text(encoding, turn: AssistantTurn) -> str:
    return encoding.decode(turn.token_ids)


def test_a_confident_probe_after_the_plan_closes_analysis_there(encoding):
    llm = ScriptedLLM(encoding, {1: 0.9})
    generator = ExitTurns(llm, ExitConfig(min_margin=0.8))
    (turn,) = generator.generate_turns([ask()])
    assert turn_text(encoding, turn) == HEADER + "Plan the answer." + CLOSE + REST
    assert turn.analysis == "Plan the answer." and turn.final == "It is 4."
    assert turn.completion_tokens == len(turn.token_ids) < len(ids(encoding, HEADER + ANALYSIS))
    assert len(llm.calls) == 2  # the first sentence, then its probe, kept as the rest
    probe = llm.calls[1][0]
    assert probe.metrics and probe.control is False
    stats = generator.stats
    assert (stats.turns, stats.exits, stats.probes, stats.probe_steps) == (1, 1, 1, 0)
    assert stats.sentences == 1 and stats.analysis_tokens == len(ids(encoding, "Plan the answer."))
    assert len(turn.token_metrics) == len(turn.token_ids)


def test_weak_probes_let_analysis_run_to_its_end_and_count_their_steps(encoding):
    llm = ScriptedLLM(encoding, {1: 0.3, 2: 0.3})
    generator = ExitTurns(llm, ExitConfig(min_margin=0.8))
    (turn,) = generator.generate_turns([ask()])
    assert turn_text(encoding, turn) == HEADER + ANALYSIS + CLOSE + REST
    stats = generator.stats
    # probed after "answer." and "units." and "Done." (not after "2024-03-01." nor "52.")
    assert stats.probes == 3 and stats.sentences == 3
    assert stats.exits == 1  # the probe after "Done." (margins 1.0) is kept: the model's own end
    assert stats.probe_steps == 2 * len(ids(encoding, REST))


def test_the_exit_waits_for_the_first_confident_sentence(encoding):
    llm = ScriptedLLM(encoding, {1: 0.3, 2: 0.95, 3: 0.3})
    generator = ExitTurns(llm, ExitConfig(min_margin=0.8))
    (turn,) = generator.generate_turns([ask()])
    analysis = "Plan the answer. Check the date 2024-03-01. Check 52.5 units."
    assert turn.analysis == analysis
    assert turn_text(encoding, turn) == HEADER + analysis + CLOSE + REST
    assert generator.stats.exits == 1 and generator.stats.probes == 2


def test_when_no_probe_is_confident_the_rest_is_decoded_after_the_models_own_end(encoding):
    llm = ScriptedLLM(encoding, {1: 0.3, 2: 0.3, 3: 0.3})
    generator = ExitTurns(llm, ExitConfig(min_margin=0.8))
    (turn,) = generator.generate_turns([ask()])
    assert turn_text(encoding, turn) == HEADER + ANALYSIS + CLOSE + REST
    assert generator.stats.exits == 0 and generator.stats.probes == 3
    rest = llm.calls[-1][0]
    assert not rest.metrics and rest.control is True  # the rest runs as the request asked


def test_a_short_probe_decodes_the_rest_again_and_seeds_are_fresh(encoding):
    llm = ScriptedLLM(encoding, {1: 0.9})
    generator = ExitTurns(llm, ExitConfig(min_margin=0.8, probe_tokens=2))
    (turn,) = generator.generate_turns([ask()])
    assert turn_text(encoding, turn) == HEADER + "Plan the answer." + CLOSE + REST
    assert [c[0].max_tokens == 2 for c in llm.calls] == [False, True, False]
    assert generator.stats.probe_steps == 2
    assert [c[0].seed for c in llm.calls] == [100, 101, 102]


def test_a_whole_rest_probe_is_kept_and_a_truncated_short_one_is_not(encoding):
    whole = ScriptedLLM(encoding, {1: 0.9})
    ExitTurns(whole, ExitConfig(min_margin=0.8, probe_tokens=None)).generate_turns([ask()])
    assert len(whole.calls) == 2 and whole.calls[1][0].max_tokens > len(ids(encoding, REST))
    short = ScriptedLLM(encoding, {1: 0.9})
    generator = ExitTurns(short, ExitConfig(min_margin=0.8, probe_tokens=3))
    generator.generate_turns([ask()])
    assert len(short.calls) == 3 and generator.stats.probe_steps == 3


def test_max_sentences_stops_probing(encoding):
    llm = ScriptedLLM(encoding, {1: 0.3, 2: 0.95})
    generator = ExitTurns(llm, ExitConfig(min_margin=0.8, max_sentences=1))
    (turn,) = generator.generate_turns([ask()])
    assert turn.analysis == ANALYSIS  # the second sentence's probe would have exited: not run
    assert generator.stats.probes == 1


def test_the_token_budget_closes_analysis(encoding):
    header, close = len(ids(encoding, HEADER)), len(ids(encoding, CLOSE))
    plan = len(ids(encoding, "Plan the answer."))
    budget = header + plan + 2 + close  # the plan and one more analysis token; one for the rest
    llm = ScriptedLLM(encoding, {1: 0.3}, max_tokens=budget)
    generator = ExitTurns(llm, ExitConfig(min_margin=0.8))
    (turn,) = generator.generate_turns([ask()])
    one_more = encoding.decode(ids(encoding, ANALYSIS)[: plan + 1])
    assert turn.analysis == one_more  # the plan, a weak probe, one more token
    assert len(turn.token_ids) == budget and generator.stats.probes == 1
    assert llm.calls[-1][0].max_tokens == 1


def test_turns_after_tool_results_run_plain_and_batches_stay_batched(encoding):
    llm = ScriptedLLM(encoding, {1: 0.9})
    generator = ExitTurns(llm, ExitConfig(min_margin=0.8))
    after_tool, first, second = generator.generate_turns([ask("tool"), ask(), ask()])
    assert after_tool.final == "plain" and len(llm.plain) == 1
    assert first.analysis == second.analysis == "Plan the answer."
    assert [len(c) for c in llm.calls] == [2, 2]  # sentences, then probes: both turns per call


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="min_margin"):
        ExitConfig(min_margin=2.0)
    with pytest.raises(ValueError, match="probe_tokens"):
        ExitConfig(probe_tokens=0)
    with pytest.raises(ValueError, match="max_sentences"):
        ExitConfig(max_sentences=0)


def test_the_harness_names_the_exit(encoding):
    from noesis.tiny import harness

    generator = harness.turn_generator(ScriptedLLM(encoding), "early-exit")
    assert isinstance(generator, ExitTurns) and generator.config == ExitConfig()
