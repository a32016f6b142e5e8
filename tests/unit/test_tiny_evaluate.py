"""noesis.tiny.evaluate: scoring generated turns (Harmony text read by the one parser) against an
example's metadata."""

import functools
from pathlib import Path

import pytest

from noesis.harmony import NOESIS_TINY, HarmonyEncoding, parse_text
from noesis.tiny import corpus, evaluate, harmony

TINY = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"


@functools.cache
def _encoding() -> HarmonyEncoding:
    return HarmonyEncoding.from_file(TINY, NOESIS_TINY)


def score_call(example, text: str) -> evaluate.CallScore:
    return evaluate.score_call(example, parse_text(_encoding(), text))


def final_correct(example, text: str) -> bool | None:
    return evaluate.final_correct(example, parse_text(_encoding(), text))


def _example(predicate):
    return next(e for e in corpus.generate(9, "heldout", 400) if predicate(e))


def _continuation(example: corpus.Example, messages) -> str:
    """The reference text a perfect model generates after the prompt for `messages`."""
    prompt = harmony.render(messages, example.tools, add_generation_prompt=True)
    full = harmony.render(example.messages, example.tools)
    return full[len(prompt) :]


@pytest.fixture(scope="module")
def tool_example():
    return _example(lambda e: e.task == "calculator" and e.expected_tool == "calculator")


def test_reference_call_scores_perfectly(tool_example):
    generated = _continuation(tool_example, tool_example.prompt_messages)
    score = score_call(tool_example, generated.split("<|call|>")[0] + "<|call|>")
    assert score == evaluate.CallScore("calculator", True, True, True, True, False)
    final = _continuation(tool_example, tool_example.messages_before_final)
    assert final_correct(tool_example, final) is True
    assert final_correct(tool_example, "<|channel|>final<|message|>No idea.<|return|>") is False


def test_equivalent_arguments_count_as_correct(tool_example):
    expression = tool_example.expected_arguments["expression"]
    generated = (
        "<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>"
        f'{{"expression": "({expression})"}}<|call|>'
    )
    assert score_call(tool_example, generated).arguments_correct


@pytest.mark.parametrize(
    ("body", "json_ok", "valid"),
    [('{"expression": ', False, False), ('{"expr": "1+1"}', True, False), ("[1]", False, False)],
)
def test_broken_arguments(tool_example, body, json_ok, valid):
    generated = (
        f"<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>{body}<|call|>"
    )
    score = score_call(tool_example, generated)
    assert (
        score.selection_correct
        and score.arguments_json == json_ok
        and score.arguments_valid == valid
    )
    assert not score.arguments_correct


def test_wrong_or_missing_call(tool_example):
    direct = "<|channel|>final<|message|>391.<|return|>"
    score = score_call(tool_example, direct)
    assert score.called is None and not score.selection_correct and score.answered_directly
    undeclared = "<|channel|>commentary to=functions.nothing <|constrain|>json<|message|>{}<|call|>"
    score = score_call(tool_example, undeclared)
    assert score.called == "nothing" and not score.selection_correct and not score.arguments_valid


def test_no_call_expected():
    example = _example(lambda e: e.expected_tool is None and e.expected_answer is not None)
    generated = _continuation(example, example.prompt_messages)
    assert score_call(example, generated).selection_correct
    assert final_correct(example, generated)


def test_summary(tool_example):
    good = evaluate.ExampleScore(
        "a",
        "calculator",
        "calculator",
        evaluate.CallScore("calculator", *[True] * 4, False),
        True,
        30,
    )
    bad = evaluate.ExampleScore(
        "b", "recall", None, evaluate.CallScore(None, False, False, False, False, True), False, 10
    )
    summary = evaluate.summarize([good, bad])
    assert summary["tool_selection_accuracy"] == 0.5
    assert summary["call_validity"] == 1.0 and summary["final_answer_accuracy"] == 0.5
    assert summary["mean_tokens_to_answer"] == 20
    assert summary["by_task"]["recall"]["tool_selection_accuracy"] == 0.0
    assert evaluate.to_json([good])[0]["call"]["called"] == "calculator"
