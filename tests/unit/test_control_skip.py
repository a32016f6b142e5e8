"""Probe-then-skip (noesis.control.skip): the confidence rule on synthetic metric streams, the
turn grammar without analysis, and the generator's routing over a fake LLM (no model)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from scripted_turns import TINY_DIR, ask, ids, m

from noesis.control.skip import ProbedTurns, SkipConfig, probe_confident
from noesis.harmony import NOESIS_TINY, HarmonyEncoding
from noesis.sampling.params import SamplingParams
from noesis.session import AssistantTurn, TurnRequest
from noesis.structured.harmony_grammar import harmony_turn_grammar
from noesis.structured.matcher import GrammarSpec
from noesis.tiny import tools

FINAL = "<|channel|>final<|message|>Yara is 4 years old.<|return|>"


# ---------------------------------------------------------------- the rule


def test_confident_only_when_every_probed_token_reaches_the_floor():
    config = SkipConfig(min_margin=0.8)
    assert probe_confident([m(1.0), m(0.8), m(0.95)], config)
    assert not probe_confident([m(1.0), m(0.79), m(1.0)], config)  # one weak decision is enough


def test_missing_or_broken_metrics_keep_the_analysis():
    config = SkipConfig(min_margin=0.0)  # even the floor that skips everything
    assert not probe_confident([], config)
    assert not probe_confident([m(1.0), None], config)
    assert not probe_confident([m(math.nan)], config)


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="probe_tokens"):
        SkipConfig(probe_tokens=0)
    with pytest.raises(ValueError, match="min_margin"):
        SkipConfig(min_margin=1.5)


# ---------------------------------------------------------------- the grammar


def test_the_grammar_without_analysis_opens_with_the_call_or_the_final():
    declared = tools.schemas(["calculator"])
    assert harmony_turn_grammar(declared, "auto").splitlines()[0].startswith("start: (analysis")
    start = harmony_turn_grammar(declared, "auto", analysis=False).splitlines()[0]
    assert start == "start: (call | final)"


# ---------------------------------------------------------------- the generator


@dataclass
class Out:
    token_ids: list[int]
    token_metrics: list
    finish_reason: str = "stop"


class FakeLLM:
    """Probes answer with FINAL and the given margins; plain turns are recorded."""

    def __init__(self, encoding, margins: list[float]) -> None:
        self.harmony, self.margins = encoding, margins
        self.generated: list[list[SamplingParams]] = []
        self.plain: list[TurnRequest] = []

    def _turn_inputs(self, messages, tools, tool_choice, deterministic, **options):
        grammar = GrammarSpec.lark(harmony_turn_grammar(tools, tool_choice))
        return [1, 2, 3], SamplingParams(max_tokens=64, grammar=grammar)

    def generate(self, prompts, params):
        self.generated.append(list(params))
        token_ids = ids(self.harmony, FINAL)[: params[0].max_tokens]
        metrics = [m(x) for x in self.margins][: len(token_ids)]
        return [Out(token_ids, metrics) for _ in prompts]

    def generate_turns(self, requests, cancel=None):
        self.plain += requests
        return [AssistantTurn("planned", [], "plain", 3, 20, "stop") for _ in requests]


@pytest.fixture(scope="module")
def encoding():
    return HarmonyEncoding.from_file(TINY_DIR, NOESIS_TINY)


def test_a_confident_whole_turn_probe_is_the_answer(encoding):
    llm = FakeLLM(encoding, [1.0] * 30)
    generator = ProbedTurns(llm, SkipConfig(min_margin=0.8))
    turn = generator.generate_turns([ask()])[0]
    assert turn.final == "Yara is 4 years old." and turn.analysis == ""
    assert turn.token_ids == ids(encoding, FINAL) and not llm.plain
    (probe,) = llm.generated[0]  # one generation only: the probe was kept
    assert len(llm.generated) == 1 and probe.metrics and probe.control is False
    assert "start: (call | final)" in probe.grammar.source
    assert generator.stats.skipped == 1 and generator.stats.probe_steps == 0


def test_a_weak_probe_runs_the_turn_as_asked_and_counts_its_steps(encoding):
    llm = FakeLLM(encoding, [1.0, 1.0, 0.3] + [1.0] * 30)
    generator = ProbedTurns(llm, SkipConfig(min_margin=0.8))
    turn = generator.generate_turns([ask()])[0]
    assert turn.analysis == "planned" and len(llm.plain) == 1
    assert generator.stats.skipped == 0
    assert generator.stats.probe_steps == len(ids(encoding, FINAL))
    assert generator.stats.weakest == [pytest.approx(0.3)]


def test_a_short_probe_decodes_the_turn_again_and_answers_after_tools_are_not_probed(encoding):
    llm = FakeLLM(encoding, [1.0] * 30)
    generator = ProbedTurns(llm, SkipConfig(probe_tokens=2, min_margin=0.8))
    after_tool, first = generator.generate_turns([ask("tool"), ask()])
    assert after_tool.final == "plain" and llm.plain[0].messages[-1]["role"] == "tool"
    assert [len(call) for call in llm.generated] == [1, 1]  # the probe, then the turn
    assert llm.generated[0][0].max_tokens == 2 and llm.generated[1][0].max_tokens == 64
    assert first.final == "Yara is 4 years old." and generator.stats.probe_steps == 2


def test_the_compiled_grammar_refuses_analysis_and_accepts_a_direct_final(encoding):
    from noesis.structured import GrammarCompiler
    from noesis.tokenizer import Tokenizer

    compiler = GrammarCompiler.from_tokenizer(Tokenizer.from_dir(TINY_DIR), 8192)
    declared = tools.schemas(["calculator"])

    def accepts(text: str, analysis: bool) -> bool:
        matcher = compiler.matcher(GrammarSpec.lark(harmony_turn_grammar(declared, "auto",
                                                                         analysis=analysis)))
        return all(matcher.accept_token(i) for i in ids(encoding, text))

    thinking = "<|channel|>analysis<|message|>No tool is needed.<|end|>"
    assert accepts(thinking, analysis=True) and not accepts(thinking, analysis=False)
    assert accepts(FINAL, analysis=False)
