"""What the synthesizer is given: signs between numbers and ISO dates as words, prose untouched."""

from __future__ import annotations

import pytest

from noesis.voice.spoken import speakable


@pytest.mark.parametrize("text, said", [
    ("12*7 = 84.", "12 times 7 equals 84."),
    ("100-38 = 62.", "100 minus 38 equals 62."),
    ("2**10 = 1024.", "2 to the power of 10 equals 1024."),
    ("8**2 = 64.", "8 squared equals 64."),
    ("3**3+1 = 28.", "3 cubed plus 1 equals 28."),
    ("2**2.5 = 5.66", "2 to the power of 2.5 equals 5.66"),
    ("200*15/100 = 30.", "200 times 15 divided by 100 equals 30."),
    ("450+270 = 720.", "450 plus 270 equals 720."),
    ("3.5 × 2 = 7.0", "3.5 times 2 equals 7.0"),
    ("2024-03-05 is a Tuesday.", "March 5, 2024 is a Tuesday."),
    ("From 2024-01-01 to 2024-03-01.", "From January 1, 2024 to March 1, 2024."),
])
def test_signs_between_numbers_and_iso_dates_become_words(text, said):
    assert speakable(text) == said


@pytest.mark.parametrize("text", [
    "An x-ray at 5 km/h.", "5 kilometers is 3.11 miles.", "Hello! How can I help you today?",
    "Room 12b, floor 3.", "e-mail me at 9 or 10",
])
def test_prose_and_what_is_not_arithmetic_stay_as_written(text):
    assert speakable(text) == text
