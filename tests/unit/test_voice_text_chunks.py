"""The streaming sentence/clause chunker that lets speech start before the reply is complete."""

from __future__ import annotations

import pytest

from noesis.errors import InvalidRequest
from noesis.voice.text_chunks import TextChunker, split_clauses


def _chunks(text: str, step: int = 1, **options) -> list[str]:
    chunker = TextChunker(**options)
    out = []
    for start in range(0, len(text), step):
        out += chunker.feed(text[start : start + step])
    return out + chunker.flush()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Hello there. How are you? Fine!", ["Hello there.", "How are you?", "Fine!"]),
        ("Pi is about 3.14 and e is 2.72. Next.", ["Pi is about 3.14 and e is 2.72.", "Next."]),
        ("It costs 1,000 dollars, roughly. Ok.", ["It costs 1,000 dollars, roughly.", "Ok."]),
        ("Use a tool, e.g. a hammer. Done.", ["Use a tool, e.g. a hammer.", "Done."]),
        ("Ask Dr. Smith, i.e. the vet. Now.", ["Ask Dr. Smith, i.e. the vet.", "Now."]),
        ("J. R. R. Tolkien wrote books. Yes.", ["J. R. R. Tolkien wrote books.", "Yes."]),
        (
            "When the long meeting finally ended, everyone went home.",
            ["When the long meeting finally ended,", "everyone went home."],
        ),
        ("Yes, I can do that.", ["Yes, I can do that."]),  # clause too short to stand alone
        ('He said "stop." Then he left.', ['He said "stop."', "Then he left."]),
        ("Really?! Well... fine.", ["Really?!", "Well...", "fine."]),
        ("Items:\n- apples\n- pears", ["Items:", "- apples", "- pears"]),
        ("1. Buy milk. 2. Walk the dog.", ["1. Buy milk.", "2. Walk the dog."]),
        ("no punctuation at all", ["no punctuation at all"]),
    ],
)
def test_chunks_are_the_same_whether_fed_at_once_or_char_by_char(text, expected):
    assert _chunks(text, step=len(text)) == expected
    assert _chunks(text, step=1) == expected
    assert _chunks(text, step=3) == expected


def test_a_chunk_is_released_as_soon_as_the_next_character_decides_it():
    chunker = TextChunker()
    assert chunker.feed("The answer is 3") == []
    assert chunker.feed(".") == []  # could still be 3.14
    assert chunker.feed("14") == []
    assert chunker.feed(". ") == ["The answer is 3.14."]
    assert chunker.feed("Then") == []
    assert chunker.flush() == ["Then"]
    assert chunker.flush() == []


def test_text_without_punctuation_is_cut_at_a_space_past_max_chars():
    text = "one two three four five six seven eight"
    assert _chunks(text, max_chars=20) == ["one two three four five", "six seven eight"]


def test_min_clause_chars_is_configurable():
    assert _chunks("Yes, I can.", min_clause_chars=0) == ["Yes,", "I can."]


def test_split_clauses_splits_every_clause():
    assert split_clauses("Hello, world. This is 3.14, e.g. pi!") == [
        "Hello,",
        "world.",
        "This is 3.14,",
        "e.g. pi!",
    ]


def test_bad_options_raise():
    with pytest.raises(InvalidRequest, match="min_clause_chars"):
        TextChunker(min_clause_chars=-1)
    with pytest.raises(InvalidRequest, match="max_chars"):
        TextChunker(max_chars=0)
