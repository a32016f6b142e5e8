"""Tool questions as people write and say them, for the training corpus: numbers in digits, words or
both, many verbs and operators, lower case without punctuation, polite and terse forms, typos, and
speech transcripts with fillers.

Each builder draws what the user wants through the corpus's `Draw` (so training and held-out data
keep their entities apart) and returns the question with the call that answers it. A question is
built from parts: plain text, which the surface styles may change, and `Said` spans (numbers, dates,
units, names, quoted texts), which they leave alone, so the expected call is always what the user
meant. The evaluation split (`noesis.tiny.natural`) has its own wordings and noise; this module
never imports it, and the corpus drops any question that the split also asks (`corpus.py`).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from noesis.tiny import english, lexicon
from noesis.tiny.tools import UNITS, format_number

# ---------------------------------------------------------------- how one user writes


@dataclass(frozen=True)
class Voice:
    """numbers: "digits", "words" or "mixed"; surface: how the sentence around them is written."""

    numbers: str
    surface: str  # plain, casual, polite, terse, typos, speech


# (numbers, surface) -> weight. Speech always says numbers in words, as a transcript would.
VOICES: dict[Voice, float] = {
    Voice("digits", "plain"): 10,
    Voice("words", "plain"): 8,
    Voice("mixed", "plain"): 6,
    Voice("digits", "casual"): 8,
    Voice("words", "casual"): 5,
    Voice("digits", "polite"): 7,
    Voice("words", "polite"): 4,
    Voice("digits", "terse"): 8,
    Voice("mixed", "terse"): 3,
    Voice("digits", "typos"): 7,
    Voice("words", "typos"): 4,
    Voice("words", "speech"): 10,
    Voice("digits", "speech"): 3,  # an ASR that writes numerals
}


def pick_voice(rng: random.Random) -> Voice:
    voices, weights = zip(*VOICES.items(), strict=True)
    return rng.choices(voices, weights)[0]


@dataclass(frozen=True)
class Said:
    """A span the surface styles never touch: a number, date, unit, name or quoted text."""

    text: str


Part = str | Said


@dataclass(frozen=True)
class Phrased:
    """A tool question and its answer: the call, and what the corpus needs to finish the turn."""

    tool: str
    question: str
    arguments: dict[str, Any]
    facts: dict[str, Any] = field(default_factory=dict)  # e.g. the expression, the shown value


# ---------------------------------------------------------------- numbers


def say_number(rng: random.Random, voice: Voice, value: float, first: bool = False) -> Said:
    """`value` as this voice writes it. A mixed voice writes its first number in words or as
    "3 thousand", the others at random, so that a mixed question is never all digits."""
    style = voice.numbers
    if style == "mixed":
        style = "words" if first else rng.choice(("words", "digits", "grouped"))
        if first and value >= 100 and value % 100 == 0 and rng.random() < 0.6:
            style = "grouped"
    return Said(_number_text(rng, value, style, voice.surface == "speech"))


def _number_text(rng: random.Random, value: float, style: str, spoken: bool) -> str:
    whole, half = int(value), value != int(value)
    if style == "words":
        if half:
            if rng.random() < 0.5 or not whole:
                return f"{_words(rng, whole)} and a half" if whole else "a half"
            return f"{_words(rng, whole)} point five"
        return _words(rng, whole)
    if style == "grouped" and not half:
        for scale, name in ((1000, "thousand"), (100, "hundred")):
            if whole >= scale and whole % scale == 0 and whole // scale < 100:
                head = str(whole // scale) if rng.random() < 0.7 else _words(rng, whole // scale)
                return f"{head} {name}"
        if whole >= 1000:
            return f"{whole:,}"
        return _words(rng, whole)
    if not half and whole >= 1000 and rng.random() < 0.25 and not spoken:
        return f"{whole:,}"
    return format_number(value)


def _words(rng: random.Random, value: int) -> str:
    """Number words in one of the ways people write them: 'one hundred and five', 'one hundred
    five', 'a hundred and five', 'twenty one', 'fifteen hundred'."""
    conjunction = " and " if rng.random() < 0.7 else " "
    hyphen = "-" if rng.random() < 0.6 else " "
    if 1100 <= value < 10_000 and value % 100 == 0 and value % 1000 and rng.random() < 0.4:
        return f"{english.number_words(value // 100, conjunction, hyphen)} hundred"
    text = english.number_words(value, conjunction, hyphen)
    if 100 <= value < 200 and rng.random() < 0.3:
        text = "a" + text[len("one") :]
    return text


# ---------------------------------------------------------------- arithmetic


_SYMBOL = re.compile(r"[+\-*/x×÷^%=]")

# Each operation: (phrase template, uses a symbol). {a} and {b} in the user's order; the
# expression is always a then b.
_OPERATIONS: dict[str, tuple[tuple[str, bool], ...]] = {
    "+": (
        ("{a} plus {b}", False), ("{a} + {b}", True), ("{a}+{b}", True),
        ("{a} and {b} added together", False), ("the sum of {a} and {b}", False),
        ("{a} add {b}", False), ("{a} and {b} together", False), ("{a} added to {b}", False),
        ("the total of {a} and {b}", False),
    ),
    "-": (
        ("{a} minus {b}", False), ("{a} - {b}", True), ("{a}-{b}", True),
        ("{a} take away {b}", False), ("{b} subtracted from {a}", False),
        ("{a} less {b}", False), ("the difference between {a} and {b}", False),
        ("{b} taken from {a}", False), ("{b} less than {a}", False),
    ),
    "*": (
        ("{a} times {b}", False), ("{a} x {b}", True), ("{a}*{b}", True), ("{a} * {b}", True),
        ("{a} × {b}", True), ("{a}x{b}", True), ("{a} multiplied by {b}", False),
        ("the product of {a} and {b}", False), ("{a} lots of {b}", False),
        ("{a} multiplied with {b}", False), ("{a} groups of {b}", False),
    ),
    "/": (
        ("{a} divided by {b}", False), ("{a} / {b}", True), ("{a}/{b}", True),
        ("{a} ÷ {b}", True), ("{a} over {b}", False), ("{a} shared between {b}", False),
        ("{a} divided into {b}", False), ("{a} split {b} ways", False),
        ("{a} shared equally among {b}", False),
    ),
    "**": (
        ("{a} to the power of {b}", False), ("{a}^{b}", True), ("{a} ^ {b}", True),
        ("{a}**{b}", True), ("{a} raised to the power {b}", False), ("{a} to the {b}", False),
        ("{a} to the power {b}", False), ("{a} raised to {b}", False),
    ),
}  # fmt: skip
# Imperatives: "multiply 12 by 7".
_COMMANDS: dict[str, tuple[str, ...]] = {
    "+": ("add {a} and {b}", "add {b} to {a}", "sum {a} and {b}", "plus {a} and {b}",
          "total up {a} and {b}"),
    "-": ("subtract {b} from {a}", "take {b} from {a}", "take {b} off {a}", "deduct {b} from {a}",
          "minus {b} from {a}"),
    "*": ("multiply {a} by {b}", "multiply {a} with {b}", "multiply {a} and {b}",
          "times {a} by {b}"),
    "/": ("divide {a} by {b}", "split {a} into {b} parts", "share {a} between {b}",
          "divide {a} into {b}"),
    "**": ("raise {a} to the power of {b}", "raise {a} to {b}", "take {a} to the power {b}"),
}  # fmt: skip
_SPECIAL_POWERS = {
    2: ("{a} squared", "the square of {a}", "square {a}", "{a} to the second power"),
    3: ("{a} cubed", "the cube of {a}", "cube {a}", "{a} to the third power"),
}

_CALC_QUESTIONS = (
    "what is {e}", "what's {e}", "what is {e} equal to", "how much is {e}", "what does {e} make",
    "what do you get for {e}", "what's the answer to {e}", "what is the result of {e}",
    "do you know what {e} is", "can you tell me what {e} is", "{e} equals what", "{e} is what",
    "what would {e} be", "any idea what {e} is", "what do i get if i do {e}",
    "how much does {e} make",
    "what's {e} come to", "what does {e} equal", "how much would {e} be",
)  # fmt: skip
_CALC_COMMANDS = (
    "calculate {e}", "compute {e}", "solve {e}", "evaluate {e}", "do {e}", "find {e}",
    "give me {e}", "i need {e}", "help me with {e}", "quickly do {e}",
)  # fmt: skip
_CALC_TERSE = ("{e}", "{e}?", "{e} =", "{e} = ?", "{e}=?", "calc {e}", "{e} equals", "math: {e}")


def calculator(d: Any, voice: Voice) -> Phrased:
    rng = d.rng
    op = rng.choices(("+", "-", "*", "/", "**", "%"), (20, 16, 26, 16, 10, 12))[0]
    if op == "%":
        return _percent(d, voice)
    a, b = _operands(d, op)
    expression = f"{a}{op}{b}"
    shown_a = say_number(rng, voice, a, first=True)
    shown_b = say_number(rng, voice, b)
    symbols = voice.surface != "speech" and voice.numbers != "words"
    if op == "**" and b in _SPECIAL_POWERS and rng.random() < 0.5:
        phrase = _fill(rng.choice(_SPECIAL_POWERS[b]), a=shown_a)
        command = isinstance(phrase[0], str) and phrase[0].startswith(("square", "cube"))
        return _arith(d, voice, phrase, expression, command=command)
    if rng.random() < 0.3 and voice.surface not in ("terse",):
        return _arith(d, voice, _fill(rng.choice(_COMMANDS[op]), a=shown_a, b=shown_b),
                      expression, command=True)  # fmt: skip
    choices = [t for t, symbolic in _OPERATIONS[op] if symbols or not symbolic]
    phrase = _fill(rng.choice(choices), a=shown_a, b=shown_b)
    return _arith(d, voice, phrase, expression, command=False)


def _operands(d: Any, op: str) -> tuple[int, int]:
    rng = d.rng
    if op == "**":
        base = small(rng, 2, 12) if rng.random() < 0.7 else d.number(13, 30)
        return base, rng.choice((2, 2, 3, 3, 4, 5, 6))
    if op == "/":
        b = small(rng, 2, 12) if rng.random() < 0.6 else d.number(13, 50)
        if rng.random() < 0.6:  # a whole answer, as everyday divisions mostly are
            return pick(d, [b * k for k in range(1, 200)]), b
        return d.number(13, 3000), b
    return _everyday(d), _everyday(d)


def _everyday(d: Any) -> int:
    """Operands as people use them: mostly small, sometimes large or round."""
    rng = d.rng
    size = rng.choices(("small", "medium", "large", "round"), (30, 35, 25, 10))[0]
    if size == "small":
        return small(rng, 1, 12)
    if size == "medium":
        return d.number(13, 99)
    if size == "large":
        return d.number(100, 9999)
    return pick(d, [k * scale for k in range(1, 10) for scale in (10, 100, 1000)])


SMALL = 12  # numbers up to this are words of the language, shared by both splits, not entities


def small(rng: random.Random, low: int, high: int) -> int:
    """A number in [low, high] (high <= SMALL) from either split."""
    assert high <= SMALL
    return rng.randint(low, high)


def pick(d: Any, values: list[int]) -> int:
    """One of `values` that belongs to the draw's split (any small one does), recorded."""
    allowed = [v for v in values if v <= SMALL or lexicon.split_of(v) == d.split]
    value = d.rng.choice(allowed)
    if value > SMALL:
        d.entities.append(str(value))
    return value


def _percent(d: Any, voice: Voice) -> Phrased:
    rng = d.rng
    p = pick(d, [5, 10, 15, 20, 25, 30, 40, 50, 60, 75, 80] + list(range(1, 100)))
    n = pick(d, list(range(10, 1000)) + [k * 100 for k in range(10, 100)])
    shown_p, shown_n = say_number(rng, voice, p, first=True), say_number(rng, voice, n)
    marks = ["{p} percent of {n}", "{p} per cent of {n}"]
    if voice.surface != "speech" and voice.numbers == "digits":
        marks += ["{p}% of {n}", "{p}% of {n}", "{p} % of {n}"]
    phrase = _fill(rng.choice(marks), p=shown_p, n=shown_n)
    return _arith(d, voice, phrase, f"{n}*{p}/100", command=False)


def _arith(d: Any, voice: Voice, phrase: list[Part], expression: str, command: bool) -> Phrased:
    rng = d.rng
    if command:
        frame = rng.choice(("{e}", "{e}", "please {e}", "can you {e}", "now {e}"))
    elif voice.surface == "terse":
        frame = rng.choice(_CALC_TERSE)
    else:
        frame = rng.choice(_CALC_QUESTIONS + _CALC_COMMANDS)
    question = finish(rng, voice, _fill(frame, e=phrase))
    return Phrased("calculator", question, {"expression": expression}, {"expression": expression})


# ---------------------------------------------------------------- units


UNIT_WORDS: dict[str, tuple[str, ...]] = {
    "kilometer": ("kilometers", "kilometres", "km", "kms", "kilometer", "kilometre", "k.m."),
    "meter": ("meters", "metres", "m", "meter", "metre", "mtrs"),
    "centimeter": ("centimeters", "centimetres", "cm", "cms", "centimetre"),
    "mile": ("miles", "mi", "mile", "mls."),
    "foot": ("feet", "ft", "foot", "ft."),
    "inch": ("inches", "in", "inch", "ins", "in."),
    "kilogram": ("kilograms", "kilogrammes", "kg", "kgs", "kilos", "kilo"),
    "gram": ("grams", "grammes", "g", "gr", "gms", "gram"),
    "pound": ("pounds", "lbs", "lb", "pound", "lb."),
    "ounce": ("ounces", "oz", "ounce", "oz."),
    "liter": ("liters", "litres", "l", "L", "ltr", "litre", "liter"),
    "milliliter": ("milliliters", "millilitres", "ml", "mL", "mls", "millilitre"),
    "gallon": ("gallons", "gal", "gals", "gallon"),
    "celsius": ("celsius", "degrees celsius", "C", "°C", "degrees C", "centigrade", "deg C"),
    "fahrenheit": ("fahrenheit", "degrees fahrenheit", "F", "°F", "degrees F", "deg F"),
    "kelvin": ("kelvin", "kelvins", "K", "degrees kelvin"),
}
_SPOKEN = re.compile(r"^[a-z ]{4,}$")


_SINGULAR = frozenset(
    """kilometer kilometre meter metre centimetre mile foot inch kilo gram pound ounce litre liter
    millilitre gallon""".split()
)


def _unit_word(rng: random.Random, voice: Voice, unit: str, one: bool = False) -> Said:
    words = UNIT_WORDS[unit]
    if not one:  # "5 feet", not "5 foot" (abbreviations serve both)
        words = tuple(w for w in words if w not in _SINGULAR) or words
    if voice.surface == "speech":
        words = tuple(w for w in words if _SPOKEN.match(w)) or words
    word = rng.choice(words)
    capital = voice.surface in ("plain", "polite", "typos") and rng.random() < 0.15
    return Said(word.capitalize() if word.islower() and capital else word)


_UNIT_QUESTIONS = (
    "how many {b} is {v} {a}", "how many {b} are in {v} {a}", "how many {b} are there in {v} {a}",
    "how many {b} in {v} {a}", "what is {v} {a} in {b}", "{v} {a} is how many {b}",
    "{v} {a} equals how many {b}", "what's {v} {a} in {b}", "what are {v} {a} in {b}",
    "i have {v} {a}, how many {b} is that", "{v} {a} would be how many {b}",
    "how much is {v} {a} in {b}", "what does {v} {a} convert to in {b}",
)  # fmt: skip
_UNIT_COMMANDS = (
    "convert {v} {a} to {b}", "convert {v} {a} into {b}", "change {v} {a} to {b}",
    "turn {v} {a} to {b}", "put {v} {a} in {b}", "give me {v} {a} in {b}",
    "show {v} {a} in {b}", "translate {v} {a} to {b}", "convert {v}{a} to {b}",
)  # fmt: skip
_UNIT_TERSE = ("{v} {a} to {b}", "{v} {a} in {b}", "{v}{a} to {b}", "{v} {a} -> {b}",
               "{v}{a} in {b}", "{v} {a} = {b}", "{v} {a} = ? {b}", "{v} {a} as {b}",
               "{a} to {b}: {v}", "{v} {a} into {b}")  # fmt: skip


def convert_units(d: Any, voice: Voice) -> Phrased:
    rng = d.rng
    dimension = rng.choice(("length", "length", "mass", "volume", "temperature"))
    source, target = rng.sample([n for n, u in UNITS.items() if u.dimension == dimension], 2)
    if dimension == "temperature":
        value: float = d.number(-40, 250) if rng.random() < 0.8 else small(rng, 0, 12)
    else:
        size = rng.randrange(3)
        value = small(rng, 1, 12) if size == 0 else d.number(*((13, 100), (100, 900))[size - 1])
        value += 0.5 if rng.random() < 0.15 else 0
    v = say_number(rng, voice, value, first=True)
    a = _unit_word(rng, voice, source, one=value == 1)
    b = _unit_word(rng, voice, target)
    if voice.surface == "terse":
        frame = rng.choice(_UNIT_TERSE)
    else:
        frame = rng.choice(_UNIT_QUESTIONS + _UNIT_COMMANDS)
    question = finish(rng, voice, _fill(frame, v=v, a=a, b=b))
    arguments = {"value": value, "from_unit": source, "to_unit": target}
    return Phrased("convert_units", question, arguments)


# ---------------------------------------------------------------- dates

MONTHS = (
    "January February March April May June July August September October November December".split()
)


_WORD_DATES = ("{m} {d} {y}", "the {d} of {m} {y}", "{d} of {m} {y}", "{m} the {d} {y}")


def say_date(rng: random.Random, voice: Voice, iso: str) -> Said:
    """A date in one of the many ways people write or say it (never ambiguous: a numeric form
    with the day first or the month first only where the day is over 12)."""
    year, month, day = (int(part) for part in iso.split("-"))
    name = MONTHS[month - 1]
    if rng.random() < 0.2:
        name = name[:3] + ("." if rng.random() < 0.3 else "")
    if voice.numbers == "words" or voice.surface == "speech":
        day_text = english.ordinal_words(day) if rng.random() < 0.85 else english.number_words(day)
        year_text = english.year_words(year) if voice.surface == "speech" else str(year)
        if rng.random() < 0.3 and voice.surface != "speech":
            year_text = english.year_words(year)
        form = rng.choice(_WORD_DATES)
        if voice.surface != "speech" and rng.random() < 0.5:
            form = form.replace(" {y}", ", {y}")
        return Said(form.format(m=MONTHS[month - 1], d=day_text, y=year_text))
    suffix = english.ordinal_suffix(day)
    forms = [
        f"{iso}", f"{name} {day}, {year}", f"{name} {day} {year}", f"{day} {name} {year}",
        f"{name} {day}{suffix}, {year}", f"{day}{suffix} {name} {year}",
        f"the {day}{suffix} of {name}, {year}", f"the {day}{suffix} of {name} {year}",
        f"{year}/{month:02d}/{day:02d}", f"{year}.{month:02d}.{day:02d}",
    ]  # fmt: skip
    if day > 12:
        forms += [f"{day}/{month}/{year}", f"{day}.{month:02d}.{year}", f"{month}/{day}/{year}",
                  f"{day}-{month:02d}-{year}"]  # fmt: skip
    return Said(rng.choice(forms))


def _span(rng: random.Random, voice: Voice, count: int, weeks: bool) -> tuple[Said, str]:
    """(the count said, its unit): "3 weeks", "a week", "ten days", "a day", "a fortnight"."""
    if count == 1:
        return Said(rng.choice(("a", "one", "1"))), "week" if weeks else "day"
    return say_number(rng, voice, count), "weeks" if weeks else "days"


def add_days(d: Any, voice: Voice) -> Phrased:
    rng = d.rng
    start = d.date()
    weeks = rng.random() < 0.25
    count = small(rng, 1, 12) if weeks or rng.random() < 0.4 else d.number(13, 500)
    before = rng.random() < 0.3
    n, unit = _span(rng, voice, count, weeks)
    when = say_date(rng, voice, start)
    if weeks and count == 2 and rng.random() < 0.3:
        n, unit = Said("a"), "fortnight"
    days = (-1 if before else 1) * count * (7 if weeks else 1)
    if before:
        frames = ("what was the date {n} {u} before {d}", "what date is {n} {u} before {d}",
                  "{n} {u} before {d}", "{d} minus {n} {u}", "go back {n} {u} from {d}",
                  "what's {n} {u} earlier than {d}", "subtract {n} {u} from {d}",
                  "which date was {n} {u} prior to {d}", "{d} - {n} {u}",
                  "count back {n} {u} from {d}", "take {n} {u} off {d}")  # fmt: skip
    else:
        frames = ("what is the date {n} {u} after {d}", "what date is {n} {u} after {d}",
                  "{n} {u} after {d}", "{d} plus {n} {u}", "{n} {u} from {d}",
                  "what's {n} {u} later than {d}", "add {n} {u} to {d}", "{d} + {n} {u}",
                  "starting {d}, what's the date in {n} {u}",
                  "if it's {d} now, what date is it in {n} {u}", "{n} {u} past {d}",
                  "move {d} forward by {n} {u}", "date {n} {u} after {d}")  # fmt: skip
    question = finish(rng, voice, _fill(rng.choice(frames), n=n, u=unit, d=when))
    return Phrased("add_days", question, {"date": start, "days": days})


def days_between(d: Any, voice: Voice) -> Phrased:
    rng = d.rng
    start, end = sorted((d.date(), d.date()))
    a, b = say_date(rng, voice, start), say_date(rng, voice, end)
    frames = ("how many days between {a} and {b}", "how many days are there from {a} to {b}",
              "days between {a} and {b}", "days from {a} to {b}", "number of days from {a} to {b}",
              "how many days separate {a} and {b}", "count the days between {a} and {b}",
              "how long is it from {a} to {b}, in days", "{a} to {b}: how many days",
              "how many days is it between {a} and {b}", "days from {a} until {b}",
              "what's the number of days between {a} and {b}", "{a} -> {b} days")  # fmt: skip
    question = finish(rng, voice, _fill(rng.choice(frames), a=a, b=b))
    return Phrased("days_between", question, {"start": start, "end": end})


def day_of_week(d: Any, voice: Voice) -> Phrased:
    rng = d.rng
    date = d.date()
    when = say_date(rng, voice, date)
    frames = ("what day of the week was {d}", "what day of the week is {d}", "what weekday is {d}",
              "which day was {d}", "what day did {d} fall on", "{d} was what day",
              "day of the week for {d}", "{d} weekday", "weekday of {d}", "what day is {d}",
              "which weekday does {d} fall on", "tell me the day of the week of {d}",
              "find the weekday for {d}", "{d} is which day of the week")  # fmt: skip
    question = finish(rng, voice, _fill(rng.choice(frames), d=when))
    return Phrased("day_of_week", question, {"date": date})


# ---------------------------------------------------------------- countries


_COUNTRY_FRAMES = {
    "capital": ("what is the capital of {c}", "capital of {c}", "{c} capital", "{c}'s capital",
                "what's the capital city of {c}", "which city is the capital of {c}",
                "what city is {c}'s capital", "name the capital of {c}", "{c} capital city",
                "the capital of {c} is what", "where is the capital of {c}",
                "tell me {c}'s capital city", "what's {c}'s capital"),
    "population": ("what is the population of {c}", "population of {c}", "{c} population",
                   "how many people live in {c}", "how many people does {c} have",
                   "how many people are in {c}", "how populated is {c}",
                   "number of people in {c}", "{c}'s population", "how big is {c}'s population",
                   "what's the population of {c}", "how many inhabitants does {c} have"),
    "currency": ("what currency does {c} use", "currency of {c}", "{c} currency",
                 "what money do they use in {c}", "what is the currency in {c}",
                 "which currency is used in {c}", "what do they pay with in {c}", "{c} money",
                 "{c}'s currency", "what's the money of {c}", "what currency is used in {c}",
                 "what money does {c} have"),
}  # fmt: skip


def lookup_country(d: Any, voice: Voice) -> Phrased:
    rng = d.rng
    if d.split == "train" and rng.random() < 0.25:  # few and all in train: show them in every voice
        country = rng.choice(lexicon.REAL_COUNTRIES)[0]
        d.entities.append(country)
    else:
        country = d.country().name if rng.random() < 0.97 else d.unknown_country()
    what = rng.choices(("capital", "population", "currency"), (45, 30, 25))[0]
    lower = voice.surface in ("casual", "speech") or rng.random() < 0.1
    c = Said(country.lower() if lower else country)
    question = finish(rng, voice, _fill(rng.choice(_COUNTRY_FRAMES[what]), c=c))
    return Phrased("lookup_country", question, {"country": country, "field": what})


# ---------------------------------------------------------------- strings


_STRING_FRAMES = {
    "reverse": ("reverse {w}", "{w} reversed", "{w} backwards", "spell {w} backwards",
                "{w} back to front", "what is {w} in reverse", "write {w} in reverse order",
                "flip {w}", "what's {w} backwards", "{w} spelled backward", "mirror {w}",
                "what does {w} read backwards", "turn {w} around", "reverse the text {w}"),
    "uppercase": ("uppercase {w}", "{w} in capitals", "{w} in all caps", "make {w} all caps",
                  "{w} in upper case", "turn {w} into capital letters", "write {w} in caps",
                  "{w} to uppercase", "convert {w} to upper case", "shout {w}",
                  "what's {w} in capital letters", "all caps {w}"),
    "lowercase": ("lowercase {w}", "{w} in lower case", "{w} in small letters",
                  "make {w} lowercase", "{w} to lowercase", "write {w} in small letters",
                  "convert {w} to lower case", "what's {w} in lowercase", "no caps: {w}",
                  "turn {w} into lowercase letters"),
    "length": ("length of {w}", "how many letters in {w}", "how many characters in {w}",
               "how long is {w}", "{w} length", "count the letters in {w}",
               "number of characters in {w}", "how many letters does {w} have",
               "how many chars is {w}", "what's the length of {w}", "letter count of {w}"),
    "count_letter": ("how many {l}s in {w}", "how many {l}'s are in {w}", "count {l} in {w}",
                     "number of {l}s in {w}", "how many times does {l} appear in {w}",
                     "how often is {l} in {w}", "occurrences of {l} in {w}",
                     "how many times is {l} in {w}", "count the {l}'s in {w}",
                     "how many letter {l} in {w}", "count how many {l} are in {w}"),
}  # fmt: skip


def string_tool(d: Any, voice: Voice) -> Phrased:
    rng = d.rng
    operations = ["reverse", "uppercase", "length", "count_letter"]
    lower = voice.surface in ("casual", "speech")
    operations += [] if lower else ["lowercase"]
    operation = rng.choice(operations)
    text = d.word()
    if not lower and rng.random() < 0.25:
        text = f"{text} {d.word()}"
    if operation == "lowercase":
        text = rng.choice((text.upper(), text.title(), text.capitalize()))
    elif not lower and rng.random() < 0.15:
        text = text.capitalize()
    letter = rng.choice(text.replace(" ", "")).lower()
    if voice.surface in ("casual", "speech") or (" " not in text and rng.random() < 0.3):
        w = Said(text)
        quoted: list[Part] = [w]
    else:
        mark = rng.choice(('"', "'", "“"))
        close = "”" if mark == "“" else mark
        quoted = [mark, Said(text), close]
    frame = rng.choice(_STRING_FRAMES[operation])
    question = finish(rng, voice, _fill(frame, w=quoted, l=Said(letter)))
    arguments: dict[str, Any] = {"operation": operation, "text": text}
    if operation == "count_letter":
        arguments["letter"] = letter
    return Phrased("string_tool", question, arguments)


BUILDERS: dict[str, Callable[[Any, Voice], Phrased]] = {
    "calculator": calculator,
    "convert_units": convert_units,
    "add_days": add_days,
    "days_between": days_between,
    "day_of_week": day_of_week,
    "lookup_country": lookup_country,
    "string_tool": string_tool,
}


# ---------------------------------------------------------------- the sentence around the spans


def _fill(template: str, **slots: Part | list[Part]) -> list[Part]:
    """The template's text split around its {slots}, each slot replaced by its parts."""
    parts: list[Part] = []
    for piece in re.split(r"(\{\w+\})", template):
        if piece.startswith("{") and piece.endswith("}"):
            value = slots[piece[1:-1]]
            parts.extend(value if isinstance(value, list) else [value])
        elif piece:
            parts.append(piece)
    return parts


# Around any request, and around an imperative only ("could you convert ...").
_POLITE = (
    "{q}, please", "hey, {q}", "hi there, {q}", "quick question: {q}", "excuse me, {q}",
    "help me out: {q}", "{q}, thanks", "{q}, thank you", "hello! {q}", "good morning, {q}",
    "just wondering, {q}", "sorry, {q}", "{q}? thanks a lot", "hi, {q}",
)  # fmt: skip
_POLITE_COMMANDS = (
    "please {q}", "could you {q}", "can you {q}", "would you {q}", "would you kindly {q}",
    "could you please {q}", "can you please {q}", "i'd like you to {q}",
    "if you can, {q}", "please could you {q}", "would it be possible to {q}",
    "i was wondering if you could {q}", "mind helping? {q}", "be so kind and {q}",
)  # fmt: skip
_IMPERATIVES = frozenset(
    """add subtract take deduct minus multiply times divide split share raise square cube sum total
    plus calculate compute solve evaluate do find give help quickly convert change turn put show
    translate go count move reverse spell write flip mirror uppercase lowercase make shout tell
    name""".split()
)
_FILLERS = ("um", "uh", "so", "okay", "well", "hmm", "like", "er", "right", "okay so", "yeah")
_KEYBOARD = "qwertyuiop asdfghjkl zxcvbnm".split()


def finish(rng: random.Random, voice: Voice, parts: list[Part]) -> str:
    """The whole question in the voice's surface style."""
    style = voice.surface
    if style == "polite":
        first = parts[0] if isinstance(parts[0], str) else ""
        command = first.split(" ", 1)[0] in _IMPERATIVES
        frames = _POLITE + _POLITE_COMMANDS if command else _POLITE
        parts = _fill(rng.choice(frames), q=parts)
    text_parts = _surface(rng, style, parts)
    text = "".join(p.text if isinstance(p, Said) else p for p in text_parts)
    text = re.sub(r"\s+", " ", text).strip()
    if style in ("plain", "polite", "typos"):
        text = text[:1].upper() + text[1:] if not isinstance(text_parts[0], Said) else text
        if not text.endswith(("?", ".", "!", ":")):
            text += rng.choice(("?", "?", "?", ".", "")) if style != "polite" else "?"
    elif style == "terse" and rng.random() < 0.4 and not text.endswith("?"):
        text += "?"
    return text


def _surface(rng: random.Random, style: str, parts: list[Part]) -> list[Part]:
    if style == "casual":
        parts = _on_text(parts, lambda t: re.sub(r"[?.!,']", "", t.lower()))
        if rng.random() < 0.3:
            parts = _on_text(parts, lambda t: t.replace("what is", "whats").replace(" you ", " u "))
    elif style == "typos":
        parts = _with_typos(rng, parts)
    elif style == "speech":
        parts = _on_text(parts, _spoken_text)
        parts = [_spoken_span(rng, p) if isinstance(p, Said) else p for p in parts]
        if rng.random() < 0.7:
            parts = [rng.choice(_FILLERS) + " "] + parts
        if rng.random() < 0.3:
            parts = _insert_filler(rng, parts)
    return parts


def _spoken_text(text: str) -> str:
    """Text around the spans as a transcript writes it: lower case, no marks."""
    text = re.sub(r"[?.!,:]", "", text.lower()).replace("what's", "what is")
    return text.replace("'", "")


def _spoken_span(rng: random.Random, span: Said) -> Said:
    """A span as a transcript writes it: lower case, hyphens often dropped."""
    text = span.text.lower()
    return Said(text.replace("-", " ") if rng.random() < 0.5 else text)


def _on_text(parts: list[Part], change: Callable[[str], str]) -> list[Part]:
    return [p if isinstance(p, Said) else change(p) for p in parts]


def _insert_filler(rng: random.Random, parts: list[Part]) -> list[Part]:
    """An "uh" between two words of a plain-text part."""
    plain = [i for i, p in enumerate(parts) if isinstance(p, str) and p.strip().count(" ") >= 1]
    if not plain:
        return parts
    i = rng.choice(plain)
    words = parts[i].split(" ")  # type: ignore[union-attr]
    at = rng.randint(1, len(words) - 1)
    words.insert(at, rng.choice(("uh", "um", "er")))
    return parts[:i] + [" ".join(words)] + parts[i + 1 :]


def _with_typos(rng: random.Random, parts: list[Part]) -> list[Part]:
    """Typos in plain-text words of 3+ letters: about one word in six, at least one."""
    pieces: list[tuple[int, int]] = []  # (part, word start) of each eligible word
    split_parts: list[Part | list[str]] = []
    for i, part in enumerate(parts):
        if isinstance(part, Said):
            split_parts.append(part)
            continue
        tokens = re.split(r"([A-Za-z]{3,})", part)
        split_parts.append(tokens)
        pieces += [(i, j) for j, token in enumerate(tokens) if re.fullmatch(r"[A-Za-z]{3,}", token)]
    if not pieces:
        return parts
    chosen = {p for p in pieces if rng.random() < 0.17} or {rng.choice(pieces)}
    out: list[Part] = []
    for i, piece in enumerate(split_parts):
        if isinstance(piece, Said):
            out.append(piece)
            continue
        out.append(
            "".join(misspell(rng, t) if (i, j) in chosen else t for j, t in enumerate(piece))
        )
    return out


def misspell(rng: random.Random, word: str) -> str:
    """One typo past the first letter: neighbours swapped, a letter dropped, doubled, or hit on a
    neighbouring key, or a stray letter added. Always differs from the word."""
    for _ in range(8):
        i = rng.randrange(1, len(word))
        kind = rng.choice(("swap", "drop", "double", "neighbour", "extra"))
        if kind == "swap" and i >= 2 and word[i - 1] != word[i]:
            changed = word[: i - 1] + word[i] + word[i - 1] + word[i + 1 :]
        elif kind == "drop":
            changed = word[:i] + word[i + 1 :]
        elif kind == "double":
            changed = word[:i] + word[i] + word[i:]
        elif kind == "neighbour" and word[i].lower() in "".join(_KEYBOARD):
            changed = word[:i] + _neighbour(rng, word[i]) + word[i + 1 :]
        elif kind == "extra":
            changed = word[:i] + rng.choice("aeiourstn") + word[i:]
        else:
            continue
        if changed != word:
            return changed
    return word[:1] + word[1:] + word[-1]


def _neighbour(rng: random.Random, letter: str) -> str:
    for row in _KEYBOARD:
        at = row.find(letter.lower())
        if at >= 0:
            options = [row[j] for j in (at - 1, at + 1) if 0 <= j < len(row)]
            chosen = rng.choice(options)
            return chosen.upper() if letter.isupper() else chosen
    return letter
