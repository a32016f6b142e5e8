"""noesis.tiny.paraphrase: natural voices for the corpus's tool questions, exact calls."""

import random
import re

import pytest

from noesis.tiny import corpus, english, paraphrase
from noesis.tiny.paraphrase import Voice
from noesis.tiny.tools import execute


def _draw(seed: int) -> corpus.Draw:
    return corpus.Draw(random.Random(seed), "train")


@pytest.mark.parametrize("voice", list(paraphrase.VOICES))
def test_every_voice_and_tool_gives_a_call_that_runs(voice):
    for tool, build in paraphrase.BUILDERS.items():
        for seed in range(12):
            phrased = build(_draw(seed), voice)
            assert phrased.tool == tool and phrased.question.strip() == phrased.question
            assert not execute(tool, corpus.json.dumps(phrased.arguments)).startswith("error")
            text = phrased.question
            if voice.surface == "speech":  # a transcript: no marks, no symbols, lower case
                assert not re.search(r"[?!,;\"“”]", text) and text == text.lower()
            if voice.numbers == "words" and tool == "calculator":
                assert not re.search(r"\d", text)


def test_spans_survive_the_surface_styles():
    """Typos, casing and fillers never touch a number, a date, a name or a quoted text."""
    for seed in range(200):
        for surface in ("typos", "casual", "speech"):
            phrased = paraphrase.string_tool(_draw(seed), Voice("digits", surface))
            assert phrased.arguments["text"] in phrased.question
            phrased = paraphrase.calculator(_draw(seed), Voice("digits", surface))
            expression = phrased.arguments["expression"].removesuffix("/100")  # "percent"
            numbers = re.findall(r"\d+", expression)
            for number in numbers[:1] if "**" in expression else numbers:  # "squared"
                assert number in phrased.question.replace(",", "")


def test_a_mixed_voice_writes_its_first_number_in_words():
    rng = random.Random(0)
    firsts = {paraphrase.say_number(rng, Voice("mixed", "plain"), v, True).text for v in (7, 300)}
    assert not any(text.isdigit() for text in firsts)
    assert paraphrase.say_number(rng, Voice("digits", "plain"), 8.5).text == "8.5"


def test_number_words_in_the_ways_people_write_them():
    assert english.number_words(105) == "one hundred and five"
    assert english.number_words(121, conjunction=" ", hyphen=" ") == "one hundred twenty one"
    assert english.ordinal_words(23) == "twenty-third" and english.ordinal_words(12) == "twelfth"
    assert english.year_words(1905) == "nineteen oh five" and english.year_words(2024) == (
        "twenty twenty-four"
    )
    assert [english.ordinal_suffix(d) for d in (1, 2, 3, 4, 11, 12, 13, 21, 22, 31)] == [
        "st", "nd", "rd", "th", "th", "th", "th", "st", "nd", "st",
    ]  # fmt: skip
    rng = random.Random(3)
    spoken = {paraphrase._words(rng, 1500) for _ in range(60)}
    assert {"fifteen hundred", "one thousand five hundred"} <= spoken


def test_misspell_always_changes_the_word_after_its_first_letter():
    rng = random.Random(1)
    for word in ("what", "convert", "letters", "aab", "zzz"):
        for _ in range(50):
            typo = paraphrase.misspell(rng, word)
            assert typo != word and typo[0] == word[0]
