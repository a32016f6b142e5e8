"""The natural-phrasing split (noesis.tiny.natural): determinism, balance, expected answers from the
real tools, no overlap with the training templates, and `noesis eval tools --split natural`."""

import json
import random
import re
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from noesis.cli import main
from noesis.harmony import NOESIS_TINY, HarmonyEncoding, parse_text
from noesis.session import AssistantTurn, ToolCall
from noesis.tiny import corpus, harmony, harness, natural
from noesis.tiny.tools import execute

MODELS = Path(__file__).resolve().parents[2] / "models"

SEEDS = (1234, 7)
MODEL = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"


def _question(example: corpus.Example) -> str:
    return example.prompt_messages[-1]["content"]


@pytest.fixture(scope="module")
def items() -> list[natural.NaturalExample]:
    return natural.generate(1234)


def test_deterministic_for_a_seed_and_each_item_alone(items):
    again = natural.generate(1234)
    assert [e.to_dict() for e in again] == [e.to_dict() for e in items]
    assert natural.example(1234, 57) == items[57]  # item i depends only on (seed, i)
    other = natural.generate(7, 40)
    assert [_question(e) for e in other] != [_question(e) for e in items[:40]]


def test_balanced_over_domains_and_kinds_with_every_pair(items):
    assert len(items) == natural.DEFAULT_N == 200
    kinds = Counter(e.kind for e in items)
    assert set(kinds) == set(natural.KINDS)
    assert max(kinds.values()) - min(kinds.values()) <= 1
    domain_of = {"add_days": "dates", "days_between": "dates", "day_of_week": "dates"}
    domains = Counter(domain_of.get(e.task, e.task) for e in items)
    assert set(domains) == set(natural.DOMAINS) and set(domains.values()) == {40}
    pairs = {(domain_of.get(e.task, e.task), e.kind) for e in items[:35]}
    assert len(pairs) == len(natural.DOMAINS) * len(natural.KINDS)
    assert {"add_days", "days_between", "day_of_week"} <= {e.task for e in items}


@pytest.mark.parametrize("seed", SEEDS)
def test_expected_answers_are_the_real_tools_results(seed):
    for example in natural.generate(seed):
        assert example.split == "natural" and example.expected_tool is not None
        declared = [tool["function"]["name"] for tool in example.tools]
        assert example.expected_tool in declared
        result = execute(example.expected_tool, json.dumps(example.expected_arguments))
        assert not result.startswith("error")
        assert example.tool_result == result
        assert example.expected_answer in result and example.expected_answer in example.final_answer
        call = example.messages[1]["tool_calls"][0]["function"]
        assert json.loads(call["arguments"]) == example.expected_arguments
        assert example.messages[2]["content"] == result
        harmony.render(example.messages, example.tools)  # renders like any corpus conversation


def test_no_question_appears_among_the_training_corpus_outputs():
    for seed in SEEDS:
        natural_questions = {_question(e) for e in natural.generate(seed)}
        generated = [
            e for split in ("train", "heldout") for e in corpus.generate(seed, split, 3000)
        ]
        assert not natural_questions & {_question(e) for e in generated}
        # Stronger for the templates: not even with other numbers in the same words. (The
        # paraphrased training questions share many shapes with this split by design: "17 x 23".)
        shape = {re.sub(r"\d+", "#", _question(e)) for e in generated if e.voice == "template"}
        assert not {re.sub(r"\d+", "#", q) for q in natural_questions} & shape


def test_the_corpus_refuses_every_question_of_the_evaluated_split():
    """At the seed `noesis eval tools` uses, the corpus drops any paraphrase that the split asks
    (up to case, punctuation and spacing), so no evaluated question is ever trained on."""
    assert corpus.EVALUATION_SEED == harness.EvalConfig.corpus_seed
    for example in natural.generate(corpus.EVALUATION_SEED, 200):
        question = example.messages[0]["content"]
        assert corpus.asked_by_evaluation(question)
        assert corpus.asked_by_evaluation(question.upper().replace("?", " ?!"))
    assert not corpus.asked_by_evaluation("What is 12 times 7?")


def test_each_kind_reads_as_described(items):
    by_kind: dict[str, list[corpus.Example]] = {}
    for example in items:
        by_kind.setdefault(example.kind, []).append(example)
    asked = {kind: [_question(e) for e in examples] for kind, examples in by_kind.items()}
    for question in asked["casual"] + asked["asr"]:
        assert question == question.lower() and not re.search(r"[?!,]", question)
    assert all(q.split()[0] in {"um", "uh", "so", "okay", "hey"} for q in asked["asr"])
    assert not any(re.search(r"\d", q) for q in asked["asr"])
    numeric = [e for e in by_kind["number_words"] if e.task in ("calculator", "convert_units")]
    assert numeric and not any(re.search(r"\d", _question(e)) for e in numeric)
    words = r"\b(one|two|three|four|five|six|seven|eight|nine|ten|hundred|thousand|[a-z]+ty|"
    words += r"[a-z]+teen)\b"
    mixed = [_question(e) for e in by_kind["mixed_numbers"] if e.task == "calculator"]
    assert mixed and all(re.search(words, q) for q in mixed)
    assert any(re.search(r"\d", q) for q in mixed)  # some digits next to the words
    assert all(re.search(r"(?i)\b(could|would|please|can|like)\b", q) for q in asked["polite"])
    assert all(len(q.split()) <= 9 for q in asked["terse"])
    many = " ".join(_question(e) for e in natural.generate(1234, 700))
    for phrase in ("multiplied by", " x ", "to the power of", "divided by", "minus", "times",
                   " km", "kilometres", "miles", "uh", "um"):  # fmt: skip
        assert phrase in many


def test_typos_change_words_but_never_numbers_or_protected_text():
    rng = random.Random(0)
    for word in ("calculate", "capital", "the", "backwards"):
        for _ in range(20):
            changed = natural.typo(rng, word)
            assert changed != word and changed[0] == word[0]
            assert abs(len(changed) - len(word)) <= 1
    for example in natural.generate(1234):
        question = _question(example)
        if example.kind == "typos":
            for entity in example.entities:
                assert entity in question  # numbers, dates, names and texts survive whole
        if example.kind == "asr":  # no filler inside a number or a date either
            for entity in example.entities:
                assert entity.replace("-", " ") in question


def test_number_words():
    assert natural.number_words(12) == "twelve"
    assert natural.number_words(105) == "one hundred and five"
    assert natural.number_words(2000) == "two thousand"
    assert natural.number_words(1882) == "one thousand eight hundred and eighty-two"
    assert natural.number_words(-40) == "minus forty"
    rng = random.Random(0)
    assert natural.render_number(2000, "grouped", rng) == "2 thousand"
    assert natural.render_number(1500, "grouped", rng) == "15 hundred"
    assert natural.render_number(2397, "grouped", rng) == "2,397"
    assert natural.render_number(7.5, "words", rng) == "seven and a half"


# ---------------------------------------------------------------- the harness and the command


def test_harness_reports_rates_per_kind_on_scripted_outputs():
    """A scripted model that is perfect on asr items and answers nothing else."""
    examples = natural.generate(1234, 14)
    encoding = HarmonyEncoding.from_file(MODELS / "noesis-tiny", NOESIS_TINY)

    def _respond(prompt: str) -> str:
        example = next(e for e in examples if _question(e) in prompt)
        if example.kind != "asr":
            return "<|channel|>final<|message|>No idea.<|return|>"
        rest = example.text()[len(prompt) :]
        end = min(i + len(t) for t in (harmony.CALL, harmony.RETURN) if (i := rest.find(t)) != -1)
        return rest[:end]

    def generate_turns(requests, cancel):  # the runs' TurnGenerator, read by the one parser
        turns = []
        for request in requests:
            text = _respond(harmony.render(request.messages, request.tools, True))
            parsed = parse_text(encoding, text)
            calls = [ToolCall("c", c.name, c.arguments) for c in parsed.tool_calls]
            turns.append(AssistantTurn(parsed.analysis, calls, parsed.final, 1, 1, "stop"))
        return turns

    llm = SimpleNamespace(generate_turns=generate_turns)
    config = harness.EvalConfig(split="natural", n=14)
    result = harness.run(llm, examples, config, None)
    by_kind = result.summary["by_kind"]
    assert set(by_kind) == set(natural.KINDS) and by_kind["asr"]["examples"] == 2
    assert by_kind["asr"]["tool_selection_accuracy"] == 1.0
    assert by_kind["asr"]["end_to_end_accuracy"] == 1.0
    assert by_kind["typos"]["tool_selection_accuracy"] == 0.0
    assert result.summary["tool_selection_accuracy"] == pytest.approx(2 / 14)
    text = harness.format_report({"runs": {"greedy": result.summary}}, "header")
    assert "per kind (n): selection / e2e" in text and "asr (2)" in text


def test_unknown_split_is_refused():
    with pytest.raises(Exception, match="unknown split 'spoken'"):
        harness.eval_examples(harness.EvalConfig(split="spoken"))
    assert harness.eval_examples(harness.EvalConfig(split="natural", n=3)) == natural.generate(
        1234, 3
    )


@pytest.mark.skipif(not MODEL.is_dir(), reason="models/noesis-tiny not present")
def test_eval_tools_split_natural_on_the_bundled_model(tmp_path, capsys):
    path = tmp_path / "natural.json"
    argv = ["eval", "tools", "--device", "cpu", "--split", "natural", "--n", "2"]
    assert main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "on natural (n=2" in out and "per kind (n): selection / e2e" in out
    report = json.loads(path.read_text())
    assert report["split"] == "natural" and report["examples"] == 2
    by_kind = report["runs"]["greedy"]["by_kind"]
    assert list(by_kind) == list(natural.KINDS)[:2]
    assert sum(k["examples"] for k in by_kind.values()) == 2
    scores = report["scores"]["greedy"]
    assert [s["example_id"] for s in scores] == [f"natural-1234-{i}" for i in range(2)]


@pytest.mark.skipif(not MODEL.is_dir(), reason="models/noesis-tiny not present")
def test_with_every_built_in_tool_declared_the_model_calls_and_never_says_it_cannot():
    """`noesis chat`'s default declares all seven tools: on natural questions (two per phrasing
    kind, every domain) the bundled model calls the tool the question needs, never answering that
    a declared tool is unavailable (the first model did: "I can't convert units without the
    convert_units tool")."""
    from noesis.llm import LLM
    from noesis.sampling.params import SamplingParams
    from noesis.session import TurnRequest
    from noesis.tools.builtin import DECLARATION_ORDER, schemas

    # The fourteen prompts share the seven declarations: prefix caching (as `noesis serve` and the
    # voice experts run) prefills them once.
    llm = LLM(str(MODEL), progress=False, enable_prefix_caching=True)
    declared = schemas(list(DECLARATION_ORDER))
    picked = natural.generate(1234, 14)
    params = SamplingParams(temperature=0.0, max_tokens=96)
    requests = [
        TurnRequest([x.messages[0]], declared, "auto", False, {"params": params})
        for x in picked
    ]
    turns = llm.generate_turns(requests)
    for example, turn in zip(picked, turns, strict=True):
        assert "can't" not in (turn.final or "") + turn.analysis, (example.id, turn)
        assert [c.name for c in turn.tool_calls] == [example.expected_tool], (example.id, turn)
