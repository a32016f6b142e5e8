"""noesis.tiny.corpus: seeded, split by entity, and every tool call in it is right."""

import json
import re
from collections import Counter

import pytest

from noesis.tiny import corpus, lexicon, paraphrase
from noesis.tiny.corpus import MONTHS
from noesis.tiny.harmony import RETURN
from noesis.tiny.tools import TOOLS, execute, validate


@pytest.fixture(scope="module")
def train_examples():
    return corpus.generate(11, "train", 1500)


@pytest.fixture(scope="module")
def heldout_examples():
    return corpus.generate(11, "heldout", 1500)


def test_same_seed_same_corpus():
    assert corpus.generate(5, "train", 50) == corpus.generate(5, "train", 50)
    assert list(corpus.texts(5, "train", 30)) == list(corpus.texts(5, "train", 30))
    assert corpus.generate(5, "train", 20) != corpus.generate(6, "train", 20)


def test_slices_match_the_whole():
    assert corpus.generate(3, "heldout", 10, start=40) == corpus.generate(3, "heldout", 50)[40:]


def test_every_task_and_decision_appears(train_examples):
    tasks = Counter(e.task for e in train_examples)
    assert set(tasks) == set(corpus.GENERATORS)
    called = Counter(e.expected_tool for e in train_examples)
    assert set(TOOLS) <= set(called) and called[None] > 0.25 * len(train_examples)
    missing = [e for e in train_examples if e.task in TOOLS and e.expected_tool is None]
    assert missing and all(corpus.CANNOT in e.final_answer for e in missing)
    assert any(not e.tools for e in train_examples)


def test_tool_calls_validate_and_execute_to_the_recorded_result(train_examples, heldout_examples):
    for example in train_examples + heldout_examples:
        calls = [m for m in example.messages if m.get("tool_calls")]
        if example.expected_tool is None:
            assert not calls
            continue
        (call,) = calls[0]["tool_calls"]
        function = call["function"]
        assert function["name"] == example.expected_tool
        assert example.expected_tool in [t["function"]["name"] for t in example.tools]
        arguments = json.loads(function["arguments"])
        assert arguments == example.expected_arguments
        assert validate(TOOLS[function["name"]].parameters, arguments) == []
        assert execute(function["name"], function["arguments"]) == example.tool_result
        assert example.messages[-2] == {
            "role": "tool",
            "tool_call_id": call["id"],
            "name": function["name"],
            "content": example.tool_result,
        }


def test_final_answer_holds_the_expected_answer(train_examples):
    for example in train_examples:
        assert example.messages[-1]["role"] == "assistant"
        if example.expected_answer is not None:
            assert example.expected_answer in example.final_answer
        assert example.text().endswith(RETURN)


def _question_numbers(example: corpus.Example) -> set[str]:
    """Numbers the user wrote; a date counts by its year (months and days are shared)."""
    found = set()
    for message in example.messages:
        if message["role"] != "user":
            continue
        text = re.sub(r"(\d{4})-\d{2}-\d{2}", r"\1", message["content"])
        text = re.sub(rf"(?:{'|'.join(MONTHS)}) \d{{1,2}}, (\d{{4}})", r"\1", text)
        found |= {m.split(".")[0] for m in re.findall(r"\d+(?:\.\d+)?", text)}
    return found - {"0"}  # "divided by 0" is part of a template


def test_heldout_shares_no_entity_or_number_with_train(train_examples, heldout_examples):
    templated = [x for x in train_examples if x.voice == "template"]
    train_numbers = set().union(*map(_question_numbers, templated))
    heldout_numbers = set().union(*map(_question_numbers, heldout_examples))
    assert heldout_numbers and not train_numbers & heldout_numbers
    train_entities = {e.lower() for x in train_examples for e in x.entities}
    heldout_entities = {e.lower() for x in heldout_examples for e in x.entities}
    assert len(heldout_entities) > 500 and not train_entities & heldout_entities
    assert all(lexicon.split_of(e) == "heldout" for e in heldout_entities)


def test_paraphrased_questions_keep_to_train_numbers(train_examples):
    """A paraphrased question (noesis.tiny.paraphrase) writes numbers in many date and number
    forms; apart from days and months and the small numbers shared by both splits
    (paraphrase.SMALL), every number it shows is a train number."""
    paraphrased = [x for x in train_examples if x.voice != "template" and x.expected_tool]
    assert len(paraphrased) > 200 and len({x.voice for x in paraphrased}) >= 10
    shown = 0
    for example in paraphrased:
        text = example.prompt_messages[-1]["content"].replace(",", "")
        allowed = set()
        for key in ("date", "start", "end"):
            if key in example.expected_arguments:
                _, month, day = example.expected_arguments[key].split("-")
                allowed |= {month, day, str(int(month)), str(int(day))}
        numbers = {n for n in re.findall(r"\d+", text) if n not in allowed}
        large = {n for n in numbers if int(n) > paraphrase.SMALL}
        shown += len(large)
        assert all(lexicon.split_of(int(n)) == "train" for n in large), (text, large)
    assert shown > 100


def test_paraphrased_voices_and_the_heldout_templates():
    """About the configured share of training tool questions are paraphrased; held-out examples
    are always the templates, identical with and without paraphrasing."""
    train = corpus.generate(5, "train", 1200)
    tool_questions = [x for x in train if x.task in paraphrase.BUILDERS]
    share = sum(x.voice != "template" for x in tool_questions) / len(tool_questions)
    assert abs(share - corpus.DEFAULT_MIXTURE.paraphrased) < 0.06
    plain = corpus.Mixture(paraphrased=0.0)
    heldout = [corpus.example(5, "heldout", i) for i in range(200)]
    assert heldout == [corpus.example(5, "heldout", i, plain) for i in range(200)]
    assert all(x.voice == "template" for x in heldout)


def test_recorded_entities_appear_in_the_conversation(train_examples):
    # A paraphrased question may say its numbers only in words; its call writes them in digits.
    shown = [x for x in train_examples if x.voice == "template" or x.expected_tool]
    for example in shown[:300]:
        text = example.text().lower()
        assert all(entity.lower() in text for entity in example.entities)


def test_entities_are_mostly_fresh():
    """Most names and words are made up, so the model learns to copy rather than memorize."""
    names = [
        e for x in corpus.generate(12, "train", 2000) if x.task == "recall" for e in x.entities
    ]
    assert len(set(names)) > 0.6 * len(names)


def test_prompt_and_before_final_views():
    example = next(e for e in corpus.generate(2, "train", 50) if e.expected_tool)
    assert example.prompt_messages[-1]["role"] == "user"
    assert [m["role"] for m in example.messages_before_final][-2:] == ["assistant", "tool"]


def test_documents_are_plain_english():
    texts = list(corpus.texts(0, "train", 12))
    documents = [t for t in texts if not t.startswith("<|start|>")]
    assert len(documents) == 2 and all(re.fullmatch(r"[A-Za-z0-9 ,.'!]+", d) for d in documents)
