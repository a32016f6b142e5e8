"""The control-plane tasks of noesis.tiny.corpus (opt-in: CONTROL_MIXTURE, the `control` split):
long analysis, questions answerable with or without a tool, two calls in a row; their scoring by
the harness on scripted turns; the default corpus and its splits unchanged byte for byte."""

import functools
import hashlib
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from noesis.errors import InvalidRequest
from noesis.harmony import NOESIS_TINY, HarmonyEncoding, parse_text
from noesis.session import AssistantTurn, ToolCall
from noesis.tiny import corpus, data, harmony, harness, lexicon, natural
from noesis.tiny.tools import TOOLS, execute, validate

TINY = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
needs_tokenizer = pytest.mark.skipif(not TINY.is_dir(), reason="models/noesis-tiny not present")


@pytest.fixture(scope="module")
def control_split():
    return corpus.control_examples(1234, 400)


@pytest.fixture(scope="module")
def control_train():
    return corpus.generate(5, "train", 1200, mixture=corpus.CONTROL_MIXTURE)


# ---------------------------------------------------------------- the old splits, unchanged


def _digest(examples) -> str:
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.id, e.task, e.text(), e.expected_tool, e.expected_arguments,
                             e.tool_result, e.expected_answer, list(e.entities), e.voice,
                             e.history_spans()]).encode())  # fmt: skip
    return h.hexdigest()


# Recorded from the corpus before the control-plane tasks existed (commit 3a1e7b9).
BEFORE = {
    "heldout": "d8aab4440d86a665b0c783f64a6dcd2bcf638b0ffa41d2f109071dc5f94349e8",
    "train": "c38b33eb4ce24b32c121ea86f1bc9872e4eb2d4a9f08b13fd56629013dd87b2b",
    "natural": "aa5c71043b0da165301fa519b2949d490c26d3a027c03d89e357f8728dcf8b9d",
    "items": "fa3b2a0a043c46437d3eb98cb0aeb47d260166314806dc85ad142f702b39687c",
}


def test_the_default_corpus_and_its_splits_are_unchanged():
    assert _digest(corpus.generate(1234, "heldout", 200)) == BEFORE["heldout"]
    assert _digest(corpus.generate(0, "train", 200)) == BEFORE["train"]
    assert _digest(natural.generate(1234, 200)) == BEFORE["natural"]
    h = hashlib.sha256()
    for text, spans in corpus.training_items(0, "train", 300):
        h.update(json.dumps([text, spans]).encode())
    assert h.hexdigest() == BEFORE["items"]
    examples = corpus.generate(1234, "heldout", 200)
    assert not any(e.tool_optional or e.later_calls for e in examples)
    assert all(e.shows_call == (e.expected_tool is not None) for e in examples)


# ---------------------------------------------------------------- the new kinds


def _calls(example: corpus.Example) -> list[tuple[str, dict, str]]:
    """(tool, arguments, result) of every call the conversation shows, in order."""
    results = {m["tool_call_id"]: m["content"] for m in example.messages if m["role"] == "tool"}
    found = []
    for message in example.messages:
        for call in message.get("tool_calls") or []:
            function = call["function"]
            found.append((function["name"], json.loads(function["arguments"]), results[call["id"]]))
    return found


def test_every_kind_appears_and_renders(control_split, control_train):
    for examples in (control_split, control_train):
        tasks = Counter(e.task for e in examples)
        assert set(tasks) == {*corpus.GENERATORS, corpus.OPTIONAL_TOOL, corpus.TWO_CALLS}
        for example in examples:
            assert example.text().endswith(harmony.RETURN)
            if example.expected_answer is not None:
                assert example.expected_answer in example.final_answer
    share = sum(e.task in (corpus.OPTIONAL_TOOL, corpus.TWO_CALLS) for e in control_train)
    assert 0.08 < share / len(control_train) < 0.25  # modest in training
    share = sum(e.task in (corpus.OPTIONAL_TOOL, corpus.TWO_CALLS) for e in control_split)
    assert 0.25 < share / len(control_split) < 0.5  # a realistic mix in the evaluation


def test_calls_validate_and_execute_to_the_recorded_results(control_split, control_train):
    for example in control_split + control_train:
        calls = _calls(example)
        assert example.shows_call == bool(calls)
        if not calls:
            continue
        declared = [t["function"]["name"] for t in example.tools]
        expected = [(example.expected_tool, example.expected_arguments, example.tool_result)]
        expected += [(c["tool"], c["arguments"], c["result"]) for c in example.later_calls]
        assert calls == expected
        for tool, arguments, result in calls:
            assert tool in declared and validate(TOOLS[tool].parameters, arguments) == []
            assert execute(tool, json.dumps(arguments)) == result


def test_two_calls_chain_the_first_result_into_the_second(control_split):
    chains = [e for e in control_split if e.task == corpus.TWO_CALLS and e.shows_call]
    assert len(chains) > 40 and all(len(e.later_calls) == 1 for e in chains)
    assert {e.expected_tool for e in chains} == {"add_days", "lookup_country", "days_between"}
    for example in chains:
        first, (second,) = example.tool_result, example.later_calls
        assert first in json.dumps(second["arguments"])
        roles = [m["role"] for m in example.messages[len(example.prompt_messages) :]]
        assert roles == ["assistant", "tool", "assistant", "tool", "assistant"]
        assert example.messages[-1]["content"].count(second["result"]) >= 1
    refused = [e for e in control_split if e.task == corpus.TWO_CALLS and not e.shows_call]
    assert refused and all(corpus.CANNOT in e.final_answer for e in refused)


def test_optional_calls_show_either_route(control_split, control_train):
    optional = [e for e in control_split if e.task == corpus.OPTIONAL_TOOL]
    assert len(optional) > 40
    # Evaluation: always the direct route; the call stays expected-if-made where it is declared.
    for example in optional:
        assert not example.shows_call
        declared = [t["function"]["name"] for t in example.tools]
        assert example.tool_optional == (example.expected_tool is not None)
        assert example.tool_optional == (example.expected_tool in declared)
        if example.tool_optional:
            expected = execute(example.expected_tool, json.dumps(example.expected_arguments))
            assert example.tool_result == expected
    assert sum(e.tool_optional for e in optional) > 0.6 * len(optional)
    # Training: both routes, the direct one more often.
    trained = [e for e in control_train if e.task == corpus.OPTIONAL_TOOL and e.tool_optional]
    shown = sum(e.shows_call for e in trained) / len(trained)
    assert 0.1 < shown < 0.5
    sums = [e for e in optional if e.expected_tool == "calculator"]
    assert sums and all(re.fullmatch(r"\d\+\d", e.expected_arguments["expression"]) for e in sums)
    earlier = [e for e in optional if e.expected_tool == "lookup_country"]
    for example in earlier:  # the capital was said in an earlier exchange
        said = example.prompt_messages[-3]["content"]
        assert example.expected_answer in said and example.expected_answer in example.final_answer


def _analyses(example: corpus.Example) -> list[str]:
    return [m["thinking"] for m in example.messages if m.get("thinking")]


def test_long_analysis_keeps_the_plan_first_and_restates_the_task(control_train):
    """A quarter of the calls' analyses end with one to three checks of the call's own values,
    after the plan; the plan alone otherwise."""
    calls = [e for e in control_train if e.task in corpus.GENERATORS and e.shows_call]
    lengthened = 0
    for example in calls:
        analysis = _analyses(example)[0]
        pool = corpus._tool_checks(example.expected_tool, example.expected_arguments)
        checks = 0
        while any(analysis.endswith(" " + c) for c in pool):
            analysis = analysis[: -len(next(c for c in pool if analysis.endswith(" " + c))) - 1]
            checks += 1
        assert checks <= 3 and analysis and not any(c in analysis for c in pool)
        lengthened += checks > 0
    assert abs(lengthened / len(calls) - corpus.CONTROL_MIXTURE.long_analysis) < 0.06
    plain = corpus.generate(5, "train", 600)
    for example in plain:
        if example.task in corpus.GENERATORS and example.shows_call:
            pool = corpus._tool_checks(example.expected_tool, example.expected_arguments)
            assert not any(c in _analyses(example)[0] for c in pool)


def test_the_checks_are_varied():
    task = corpus._day_of_week_task(corpus.Draw(corpus.random.Random(0), "train"),
                                    "What day is 2024-03-05?", {"date": "2024-03-05"})  # fmt: skip
    seen = set()
    for seed in range(40):
        copy = corpus.Task(task.kind, task.question, task.tool, task.arguments, task.thinking)
        corpus._overthink(corpus.random.Random(seed), copy)
        assert copy.thinking.startswith(task.thinking + " ")
        seen.add(copy.thinking)
    assert len(seen) > 10


def test_control_entities_come_from_their_split(control_split, control_train):
    held = {e.lower() for x in control_split for e in x.entities}
    assert held and all(lexicon.split_of(e) == "heldout" for e in held)
    templated = [x for x in control_train if x.voice == "template"]
    trained = {e.lower() for x in templated for e in x.entities}
    assert not held & trained
    ids = {e.id for e in control_split}
    assert len(ids) == len(control_split) and all(i.startswith("control-1234-") for i in ids)
    assert corpus.control_examples(1234, 5, start=10) == control_split[10:15]


def test_mixtures_by_name_and_bad_names():
    assert corpus.mixture_named("default") is corpus.DEFAULT_MIXTURE
    assert corpus.mixture_named("control", 0.5).long_analysis == 0.5
    with pytest.raises(ValueError, match=r"unknown mixture 'ctl' \(available: default, control\)"):
        corpus.mixture_named("ctl")
    with pytest.raises(ValueError, match="long_analysis must be in"):
        corpus.mixture_named("control", 1.5)
    bad = corpus.Mixture(weights={"calculator": 1, "chess": 1})
    with pytest.raises(ValueError, match="unknown task kind 'chess'"):
        corpus.generate(0, "train", 20, mixture=bad)


# ---------------------------------------------------------------- data build


@needs_tokenizer
def test_data_build_with_the_control_mixture(tmp_path):
    data.main(["--out", str(tmp_path), "--train-items", "60", "--heldout-items", "12",
               "--mixture", "control", "--tokenizer", str(TINY), "--workers", "1"])  # fmt: skip
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["config"]["mixture"] == "control" and meta["train_items"] == 60
    tokens = np.load(tmp_path / "train.tokens.npy")
    tok = data.tokenizer.load(tmp_path / data.TOKENIZER_DIR)
    texts = list(corpus.texts(0, "train", 60, mixture=corpus.CONTROL_MIXTURE))
    separator = tok.token_to_id(harmony.ENDOFTEXT)
    expected = [i for t in texts for i in tok.encode(t, add_special_tokens=False).ids + [separator]]
    assert tokens.tolist() == expected
    default = tmp_path / "default"
    data.main(["--out", str(default), "--train-items", "60", "--heldout-items", "12",
               "--tokenizer", str(TINY), "--workers", "1"])  # fmt: skip
    held = [np.load(d / "heldout.tokens.npy").tolist() for d in (tmp_path, default)]
    assert held[0] == held[1]  # the held-out stream is the default mixture's


def test_data_flags_are_checked(capsys):
    with pytest.raises(SystemExit):
        data.main(["--out", "/tmp/x", "--mixture", "ctl"])
    assert "invalid choice: 'ctl'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        data.main(["--out", "/tmp/x", "--long-analysis", "2"])
    assert "--long-analysis must be between 0 and 1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown mixture"):
        data.DataConfig(mixture="ctl")


# ---------------------------------------------------------------- harness scoring


@functools.cache
def _encoding() -> HarmonyEncoding:
    return HarmonyEncoding.from_file(TINY, NOESIS_TINY)


class Scripted:
    """A TurnGenerator answering `respond(example, prompt text)`; n characters count as n tokens."""

    def __init__(self, examples, respond):
        self.examples, self.respond = examples, respond

    def generate_turns(self, requests, cancel):
        return [self._turn(r) for r in requests]

    def _turn(self, request):
        prompt = harmony.render(request.messages, request.tools, True)
        example = next(e for e in self.examples if harmony.render(e.prompt_messages, e.tools)
                       in prompt)  # fmt: skip
        text = self.respond(example, prompt)
        parsed = parse_text(_encoding(), text)
        calls = [ToolCall(f"c{i}", c.name, c.arguments) for i, c in enumerate(parsed.tool_calls)]
        return AssistantTurn(parsed.analysis, calls, parsed.final, 1, len(text), "stop", [1],
                             [0] * len(text))  # fmt: skip


def _reference(example: corpus.Example, prompt: str) -> str:
    """The corpus conversation's next turn after `prompt` (a perfect model)."""
    rest = example.text()[len(prompt) :]
    assert example.text().startswith(prompt), "the run left the reference conversation"
    return rest[: min(i + len(t) for t in (harmony.CALL, harmony.RETURN)
                      if (i := rest.find(t)) != -1)]  # fmt: skip


CALL = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"


@needs_tokenizer
def test_harness_scores_optional_calls_either_way_and_chains_end_to_end(control_split):
    optional = [e for e in control_split if e.tool_optional][:2]
    direct = next(e for e in control_split if e.expected_tool is None and e.task != "two_calls"
                  and e.tools)  # fmt: skip
    chains = [e for e in control_split if e.task == corpus.TWO_CALLS and e.shows_call][:2]
    examples = [*optional, direct, *chains]
    called_optional, broken_chain = optional[1], chains[1]

    def respond(example, prompt):
        results = prompt.count("to=assistant<|channel|>commentary")  # tool results so far
        if example is called_optional:  # takes the optional call, then answers from its result
            if results == 0:
                return CALL.format(example.expected_tool, json.dumps(example.expected_arguments))
            return f"<|channel|>final<|message|>It is {example.tool_result}.<|return|>"
        if example is broken_chain and results == 1:  # an invalid second call
            return CALL.format(example.later_calls[0]["tool"], '{"wrong": 1}')
        if not example.text().startswith(prompt):  # after the invalid call's error
            return "<|channel|>final<|message|>Sorry, that failed.<|return|>"
        return _reference(example, prompt)

    generator = Scripted(examples, respond)
    result = harness.run(generator, examples, harness.EvalConfig(n=len(examples)), None)
    by_id = {s.example_id: s for s in result.scores}
    for example in optional:
        score = by_id[example.id]
        assert score.call.selection_correct and score.end_to_end and score.final_correct
    assert by_id[called_optional.id].call.called == called_optional.expected_tool
    assert by_id[called_optional.id].call.arguments_correct
    assert by_id[optional[0].id].call.called is None
    good, bad = (by_id[c.id] for c in chains)
    assert good.end_to_end and good.final_correct and good.call.arguments_correct
    assert bad.end_to_end is False and bad.final_correct  # the supplied run is the reference
    summary = result.summary
    assert summary["optional_tool_calls"] == 0.5 and summary["optional_tool_calls_n"] == 2
    assert summary["missed_tool_calls"] == 0.0 and summary["missed_tool_calls_n"] == 2
    assert summary["unnecessary_tool_calls"] == 0.0 and summary["unnecessary_tool_calls_n"] == 1
    # calls: the optional one, two per chain (the broken chain's second invalid)
    assert summary["every_call_validity"] == pytest.approx(4 / 5)
    traces = {t.example.id: t for t in result.traces}
    assert len(traces[chains[0].id].own.turns) == 3 and traces[chains[0].id].supplied is not None
    assert all(traces[e.id].supplied is None for e in optional)


def test_the_control_split_through_the_harness():
    examples = harness.eval_examples(harness.EvalConfig(split="control", n=7))
    assert examples == corpus.control_examples(1234, 7)
    assert "control" in harness.SPLITS
    with pytest.raises(InvalidRequest, match="unknown split 'ctl'"):
        harness.eval_examples(harness.EvalConfig(split="ctl", n=2))
