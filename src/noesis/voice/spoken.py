"""Text as it should be said: the tools' answers carry symbols a synthesizer reads out by name
("12*7 = 84." became "12 asterisk 7 equals 84") and ISO dates it reads digit group by digit group.
`speakable` rewrites those forms before synthesis; prose and numbers alone are left as they are."""

from __future__ import annotations

import re

MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August", "September",
    "October", "November", "December",
)
_NUMBER = r"\d+(?:\.\d+)?"
_DATE = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})\b")
# Between two numbers only: "x-ray", "km/h" and "e-mail" keep their signs.
_LEFT = rf"({_NUMBER}|(?<=\d )(?:squared|cubed))"  # a number, or a number's power in words
_OPERATORS = (
    (re.compile(rf"({_NUMBER})\s*\*\*\s*2(?![\d.])"), r"\1 squared"),
    (re.compile(rf"({_NUMBER})\s*\*\*\s*3(?![\d.])"), r"\1 cubed"),
    (re.compile(rf"({_NUMBER})\s*\*\*\s*(?=\d)"), r"\1 to the power of "),
    (re.compile(rf"{_LEFT}\s*[*×]\s*(?=\d)"), r"\1 times "),
    (re.compile(rf"{_LEFT}\s*[/÷]\s*(?=\d)"), r"\1 divided by "),
    (re.compile(rf"{_LEFT}\s*\+\s*(?=\d)"), r"\1 plus "),
    (re.compile(rf"{_LEFT}\s*[-−]\s*(?=\d)"), r"\1 minus "),
    (re.compile(rf"{_LEFT}\s*=\s*(?=-?\d)"), r"\1 equals "),
)


def speakable(text: str) -> str:
    """`text` with ISO dates as words ("2024-03-05" -> "March 5, 2024") and arithmetic signs
    between numbers as words ("100-38 = 62" -> "100 minus 38 equals 62", "8**2" -> "8 squared")."""
    text = _DATE.sub(_date_words, text)
    for pattern, words in _OPERATORS:
        text = pattern.sub(words, text)
    return text


def _date_words(match: re.Match) -> str:
    year, month, day = (int(group) for group in match.groups())
    if not 1 <= month <= 12 or not 1 <= day <= 31:
        return match.group(0)
    return f"{MONTHS[month - 1]} {day}, {year}"
