"""The natural-phrasing evaluation split: tool questions worded the way people write and speak
them, which the training corpus generator (corpus.py) never produces.

Item `i` depends only on (seed, i). Items cycle through the five tool domains and the seven
phrasing kinds independently (5 and 7 are coprime), so any 35 consecutive items hold every
(domain, kind) pair once and counts per domain or kind differ by at most one. Each item is a
corpus.Example (a `NaturalExample`, tagged with its kind), so the eval harness and
noesis.tiny.evaluate score it unchanged; its expected call is executed by the real tools to get
the expected result and answer.

A question is built from a domain's wording (a question, a command, or a terse form), with its
numbers, dates, texts and names as protected spans that the surface transforms (lower case,
punctuation removal, typos, fillers) leave alone, so the expected call stays what the user meant.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from noesis.tiny import corpus, lexicon
from noesis.tiny.corpus import Example
from noesis.tiny.english import number_words, ordinal_suffix, ordinal_words, year_words
from noesis.tiny.tools import ERROR_PREFIX, TOOLS, UNITS, execute, schemas

SPLIT = "natural"
DEFAULT_N = 200
DOMAINS = ("calculator", "convert_units", "dates", "lookup_country", "string_tool")
TYPO_RATE = 0.15  # share of eligible words (unprotected, 3+ letters) given a typo; at least one
_OPEN, _CLOSE = "\x02", "\x03"  # around a protected span while the question is being built


@dataclass(frozen=True)
class Phrasing:
    """How one kind of user writes: numbers as digits, words or a mix, and whether in lower case
    without punctuation. compose() applies the kind's wording and transform by its name."""

    name: str
    numbers: str  # "digits", "words" or "mixed"
    lower: bool = False  # lower case and no punctuation (entities lower-cased by the builders)


KINDS: dict[str, Phrasing] = {
    p.name: p
    for p in (
        Phrasing("number_words", "words"),  # "twelve", "one hundred and five"
        Phrasing("mixed_numbers", "mixed"),  # "2 thousand", "1,500", "12 times seven"
        Phrasing("casual", "digits", lower=True),  # lower case, no punctuation
        Phrasing("polite", "digits"),  # "could you work out ...", "would you mind ..."
        Phrasing("terse", "digits"),  # "17 x 23", "capital of japan?", "5 mi in km"
        Phrasing("typos", "digits"),  # swapped, dropped, doubled letters; never in numbers
        Phrasing("asr", "words", lower=True),  # a speech transcript: words, fillers, no marks
    )
}


@dataclass(frozen=True)
class NaturalExample(Example):
    """A corpus.Example from the natural split, with the phrasing kind it was written in."""

    kind: str = ""


def generate(seed: int, count: int = DEFAULT_N, start: int = 0) -> list[NaturalExample]:
    return [example(seed, i) for i in range(start, start + count)]


def example(seed: int, index: int) -> NaturalExample:
    """Item `index` of the natural split for `seed`."""
    domain = DOMAINS[index % len(DOMAINS)]
    kind = tuple(KINDS)[index % len(KINDS)]
    draw = Draw(random.Random(f"noesis-natural/{seed}/{index}"), KINDS[kind])
    request = BUILDERS[domain](draw)
    question = compose(draw, request)
    return _build(f"{SPLIT}-{seed}-{index}", kind, question, request, draw)


# ---------------------------------------------------------------- drawing entities


@dataclass
class Draw:
    """Random choices of one item, and the spans its phrasing must render and protect."""

    rng: random.Random
    phrasing: Phrasing
    entities: list[str] = field(default_factory=list)
    numbers_rendered: int = 0

    def protect(self, text: str) -> str:
        self.entities.append(text)
        return f"{_OPEN}{text}{_CLOSE}"

    def name(self, text: str) -> str:
        return self.protect(text.lower() if self.phrasing.lower else text)

    def number(self, value: float) -> str:
        """The value as this phrasing writes it (a mixed phrasing writes its first number in
        words, so no mixed question is all digits)."""
        first = self.numbers_rendered == 0
        self.numbers_rendered += 1
        style = self.phrasing.numbers
        if style == "mixed" and first:  # words, or "2 thousand" for a round number
            style = "grouped" if value >= 100 and value % 100 == 0 else "words"
        elif style == "mixed":
            style = self.rng.choice(("words", "grouped", "digits"))
        return self.protect(render_number(value, style, self.rng))

    def everyday(self, low: int = 2) -> int:
        """A number as people use them: small or medium; a mixed phrasing adds round hundreds and
        thousands, to be written "2 thousand"."""
        rng = self.rng
        if self.phrasing.numbers == "mixed" and rng.random() < 0.4:
            return rng.choice((rng.randint(1, 9) * 1000, rng.randint(1, 9) * 100))
        return rng.choice((rng.randint(low, 12), rng.randint(low, 99), rng.randint(100, 2500)))


# ---------------------------------------------------------------- numbers in words


def render_number(value: float, style: str, rng: random.Random) -> str:
    """`style`: digits ('1500'), words ('one thousand five hundred'), grouped ('1,500',
    '2 thousand', '3 hundred'). Halves: 'two and a half' or '2.5'."""
    whole = int(value)
    half = value != whole
    if style == "words":
        words = number_words(whole) if whole or not half else ""
        if half:
            return f"{words} and a half".strip() if words else "a half"
        return words
    if style == "grouped" and not half and whole >= 100:
        for scale, name in ((1000, "thousand"), (100, "hundred")):
            if whole % scale == 0 and whole // scale < 100:
                return f"{whole // scale} {name}"
        if whole >= 1000:
            return f"{whole:,}"
    if style == "grouped" and not half:
        return number_words(whole)
    return f"{value:g}" if half else str(whole)


# ---------------------------------------------------------------- a domain's wordings


@dataclass
class Request:
    """What the user wants, before the phrasing kind is applied: wordings, and the real call."""

    tool: str
    arguments: dict[str, Any]
    questions: tuple[str, ...]  # lower-case fragments, asked as questions ("what's ...")
    commands: tuple[str, ...]  # imperatives without "please" ("work out ...")
    terse: tuple[str, ...]  # keyword style ("17 x 23", "capital of japan")
    finish: Callable[[str], tuple[str, str]]  # tool result -> (final answer text, expected)


def _calculator(d: Draw) -> Request:
    rng = d.rng
    op = rng.choice(("add", "sub", "mul", "mul", "div", "pow", "percent"))
    if op == "percent":
        p, n = rng.choice((5, 10, 15, 20, 25, 30, 40, 50, 75)), d.everyday(10)
        expression, phrases, commands, terse = _percent(d, p, n)
    else:
        a, b = _operands(d, op)
        expression = {"add": "+", "sub": "-", "mul": "*", "div": "/", "pow": "**"}[op].join(
            (str(a), str(b))
        )
        phrases, commands, terse = _ARITHMETIC[op](d, d.number(a), d.number(b), b)
    questions = tuple(
        frame.format(p=phrase)
        for frame in (
            "what's {p}",
            "what does {p} come to",
            "how much is {p}",
            "what's {p} equal to",
        )
        for phrase in phrases
    )
    commands += tuple(f"work out {phrase}" for phrase in phrases)
    commands += tuple(f"figure out {phrase}" for phrase in phrases)
    commands += tuple(f"tell me what {phrase} is" for phrase in phrases)

    def finish(result: str) -> tuple[str, str]:
        return f"That comes to {result}.", result

    return Request("calculator", {"expression": expression}, questions, commands, terse, finish)


def _operands(d: Draw, op: str) -> tuple[int, int]:
    rng = d.rng
    if op == "pow":
        return rng.randint(2, 12), rng.choice((2, 2, 3, 3, 4, 5))
    if op == "div":
        b = rng.randint(2, 12)
        return b * (d.everyday() if rng.random() < 0.7 else 1) + rng.randint(0, 1), b
    a, b = d.everyday(), d.everyday()
    return (max(a, b), min(a, b)) if op == "sub" and rng.random() < 0.8 else (a, b)


def _percent(d: Draw, p: int, n: int) -> tuple[str, tuple, tuple, tuple]:
    shown_p, shown_n = d.number(p), d.number(n)
    phrases = (f"{shown_p} percent of {shown_n}",)
    if d.phrasing.numbers == "digits" and not d.phrasing.lower:
        phrases += (f"{shown_p}% of {shown_n}",)
    commands = (f"take {shown_p} percent of {shown_n}",)
    return f"{n}*{p}/100", phrases, commands, phrases


Wording = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]


def _joinable(a: str, b: str) -> bool:
    """Whether "... of A and B" reads one way: not with "one hundred and five" as an operand,
    nor after "three hundred" or "2 thousand" ("three hundred and one thousand")."""
    scaled = _finish(a).endswith(("hundred", "thousand", "million", "billion"))
    return " and " not in a + b and not scaled


def _add(d: Draw, a: str, b: str, _: int) -> Wording:
    phrases = (f"{a} plus {b}", f"{b} added to {a}")
    phrases += (f"the sum of {a} and {b}",) if _joinable(a, b) else ()
    return (
        phrases,
        (f"add {b} to {a}",)
        + ((f"add {a} and {b}", f"sum up {a} and {b}") if _joinable(a, b) else ()),
        (f"{a} + {b}", f"{a}+{b}=", f"{a} plus {b}"),
    )


def _sub(d: Draw, a: str, b: str, _: int) -> Wording:
    return (
        (f"{a} minus {b}", f"{a} take away {b}", f"{a} less {b}"),
        (f"subtract {b} from {a}", f"take {b} away from {a}", f"take away {b} from {a}"),
        (f"{a} - {b}", f"{a}-{b}", f"{a} minus {b}"),
    )


def _mul(d: Draw, a: str, b: str, _: int) -> Wording:
    phrases = (f"{a} times {b}", f"{a} multiplied by {b}")
    phrases += (f"the product of {a} and {b}",) if _joinable(a, b) else ()
    phrases += () if d.phrasing.lower else (f"{a} x {b}",)
    return (
        phrases,
        (f"multiply {a} by {b}",)
        + ((f"multiply {a} and {b} together",) if _joinable(a, b) else ()),
        (f"{a} x {b}", f"{a}*{b}", f"{a} times {b}", f"{a} × {b}"),
    )


def _div(d: Draw, a: str, b: str, _: int) -> Wording:
    return (
        (f"{a} divided by {b}", f"{a} over {b}", f"{a} split {b} ways"),
        (f"divide {a} by {b}", f"split {a} into {b} equal parts"),
        (f"{a} / {b}", f"{a}÷{b}", f"{a} divided by {b}"),
    )


def _pow(d: Draw, a: str, b: str, exponent: int) -> Wording:
    phrases = (f"{a} to the power of {b}", f"{a} raised to the power of {b}")
    phrases += {2: (f"{a} squared",), 3: (f"{a} cubed",)}.get(exponent, ())
    return (
        phrases,
        (f"raise {a} to the power of {b}",),
        (f"{a}^{b}", f"{a} to the power of {b}", f"{a}**{b}"),
    )


_ARITHMETIC: dict[str, Callable[[Draw, str, str, int], Wording]] = {
    "add": _add, "sub": _sub, "mul": _mul, "div": _div, "pow": _pow,
}  # fmt: skip


# Surface spellings of each unit, none of them the corpus's own alias list alone.
UNIT_NAMES: dict[str, tuple[str, ...]] = {
    "kilometer": ("kilometres", "km", "kms", "kilometers"),
    "meter": ("metres", "meters", "m"),
    "centimeter": ("centimetres", "cm", "centimeters"),
    "mile": ("miles", "mi"),
    "foot": ("feet", "ft", "foot"),
    "inch": ("inches", "in"),
    "kilogram": ("kilos", "kg", "kilograms", "kgs"),
    "gram": ("grams", "g", "grammes"),
    "pound": ("pounds", "lbs", "lb"),
    "ounce": ("ounces", "oz"),
    "liter": ("litres", "liters", "l"),
    "milliliter": ("millilitres", "ml", "mls"),
    "gallon": ("gallons", "gal"),
    "celsius": ("degrees celsius", "°C", "centigrade", "celsius"),
    "fahrenheit": ("degrees fahrenheit", "°F", "fahrenheit", "F"),
    "kelvin": ("kelvin", "K", "kelvins"),
}
_SPOKEN_UNIT = re.compile(r"^[a-z ]{4,}$")  # a unit a speaker says: no symbol or abbreviation


def _unit(d: Draw, name: str) -> str:
    choices = UNIT_NAMES[name]
    if d.phrasing.name == "asr":
        choices = tuple(c for c in choices if _SPOKEN_UNIT.match(c)) or choices
    return d.rng.choice(choices)


def _convert_units(d: Draw) -> Request:
    rng = d.rng
    dimension = rng.choice(("length", "length", "mass", "volume", "temperature"))
    names = [name for name, unit in UNITS.items() if unit.dimension == dimension]
    source, target = rng.sample(names, 2)
    if UNITS[source].factor < UNITS[target].factor:  # big to small: no answer that rounds to 0
        source, target = target, source
    if dimension == "temperature":
        value: float = rng.randint(-20, 110)
    else:
        value = rng.choice((rng.randint(1, 12), rng.randint(1, 100), rng.randint(100, 900)))
        value += 0.5 if rng.random() < 0.15 else 0
    v, a, b = d.number(value), _unit(d, source), _unit(d, target)
    questions = (
        f"how many {b} is {v} {a}",
        f"what's {v} {a} in {b}",
        f"{v} {a} in {b} is what",
        f"how much is {v} {a} in {b}",
        f"what do {v} {a} come to in {b}",
    )
    commands = (f"turn {v} {a} into {b}", f"change {v} {a} to {b}", f"express {v} {a} in {b}")
    terse = (f"{v} {a} in {b}", f"{v} {a} to {b}", f"{v}{a} -> {b}", f"{v} {a} = ? {b}")
    arguments = {"value": value, "from_unit": source, "to_unit": target}

    def finish(result: str) -> tuple[str, str]:
        number = result.split(" = ")[1].split(" ")[0]
        return f"That is {number} {UNITS[target].plural}.", number

    return Request("convert_units", arguments, questions, commands, terse, finish)


# ---------------------------------------------------------------- dates


_MONTHS = corpus.MONTHS


def render_date(d: Draw, iso: str) -> str:
    """The date as this phrasing writes it, never ISO (the corpus's usual form)."""
    year, month, day = (int(part) for part in iso.split("-"))
    name, rng = _MONTHS[month - 1], d.rng
    if d.phrasing.numbers == "words":
        said = (
            f"{name} {ordinal_words(day)}"
            if rng.random() < 0.5
            else (f"the {ordinal_words(day)} of {name}")
        )
        year_text = year_words(year) if d.phrasing.name == "asr" else str(year)
        text = f"{said} {year_text}" if d.phrasing.lower else f"{said}, {year_text}"
    else:
        suffix = ordinal_suffix(day)
        forms = [
            f"{day} {name} {year}",
            f"{name} {day}{suffix} {year}",
            f"{name[:3]} {day} {year}",
            f"the {day}{suffix} of {name} {year}",
            f"{year}/{month:02d}/{day:02d}",
        ]
        if day > 12:  # day-first numeric dates only where they cannot be read month-first
            forms.append(f"{day}.{month:02d}.{year}")
        text = rng.choice(forms)
    return d.name(text)


def _random_date(rng: random.Random) -> str:
    return f"{rng.randint(1950, 2035)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def _dates(d: Draw) -> Request:
    return d.rng.choice((_add_days, _days_between, _day_of_week))(d)


def _add_days(d: Draw) -> Request:
    rng = d.rng
    start = _random_date(rng)
    weeks = rng.random() < 0.25
    count = rng.randint(1, 10) if weeks else rng.choice((rng.randint(1, 30), rng.randint(31, 400)))
    before = rng.random() < 0.3
    days = (-1 if before else 1) * count * (7 if weeks else 1)
    n, unit, when = d.number(count), "weeks" if weeks else "days", render_date(d, start)
    if before:
        questions = (f"what was the date {n} {unit} prior to {when}",
                     f"which date comes {n} {unit} before {when}")  # fmt: skip
        commands = (f"go back {n} {unit} from {when}", f"count {n} {unit} back from {when}")
        terse = (f"{when} minus {n} {unit}", f"{n} {unit} before {when}")
    else:
        questions = (f"what's the date {n} {unit} after {when}",
                     f"if I start on {when}, what's the date {n} {unit} later",
                     f"what date will it be {n} {unit} from {when}")  # fmt: skip
        commands = (f"tell me the date {n} {unit} after {when}", f"add {n} {unit} onto {when}")
        terse = (f"{when} plus {n} {unit}", f"{when} + {n} {unit}")
    return _date_request("add_days", {"date": start, "days": days}, questions, commands, terse)


def _days_between(d: Draw) -> Request:
    rng = d.rng
    start, end = sorted((_random_date(rng), _random_date(rng)))
    a, b = render_date(d, start), render_date(d, end)
    questions = (f"how many days lie between {a} and {b}",
                 f"how long is it from {a} until {b} in days",
                 f"how many days is it from {a} to {b}")  # fmt: skip
    commands = (f"count how many days there are from {a} to {b}",
                f"tell me the number of days between {a} and {b}")  # fmt: skip
    terse = (f"days from {a} to {b}", f"days between {a} and {b}", f"{a} to {b} in days")
    return _date_request("days_between", {"start": start, "end": end}, questions, commands, terse)


def _day_of_week(d: Draw) -> Request:
    date = _random_date(d.rng)
    when = render_date(d, date)
    questions = (f"what day was {when}", f"which day of the week was {when}",
                 f"what weekday did {when} fall on", f"{when} was a what day")  # fmt: skip
    commands = (f"tell me the weekday of {when}", f"find out what day {when} was")
    terse = (f"weekday of {when}", f"day of week for {when}", f"{when} day of the week")
    return _date_request("day_of_week", {"date": date}, questions, commands, terse)


def _date_request(tool: str, arguments: dict, questions, commands, terse) -> Request:
    def finish(result: str) -> tuple[str, str]:
        return f"It is {result}." if tool == "day_of_week" else f"The answer is {result}.", result

    return Request(tool, arguments, questions, commands, terse, finish)


# ---------------------------------------------------------------- countries


def _lookup_country(d: Draw) -> Request:
    rng = d.rng
    if rng.random() < 0.6:
        name = rng.choice(lexicon.REAL_COUNTRIES)[0]
    else:
        name = rng.choice(lexicon.countries_in("heldout")).name
    field_name = rng.choices(("capital", "population", "currency"), (45, 30, 25))[0]
    c = d.name(name)
    wordings = {
        "capital": (
            (f"what's the capital of {c}", f"which city is {c}'s capital",
             f"what's {c}'s capital city", f"what city is the capital of {c}"),
            (f"tell me {c}'s capital", f"name the capital city of {c}"),
            (f"capital of {c}", f"{c} capital", f"{c} capital city"),
        ),
        "population": (
            (f"how many people are there in {c}", f"what's the population of {c}",
             f"roughly how many people does {c} have", f"how populous is {c}"),
            (f"tell me how many people live in {c}", f"give me the population of {c}"),
            (f"population of {c}", f"{c} population", f"{c} pop"),
        ),
        "currency": (
            (f"what money do they use in {c}", f"which currency is used in {c}",
             f"what do people pay with in {c}", f"what's {c}'s currency"),
            (f"tell me what currency {c} has", f"name the currency of {c}"),
            (f"currency of {c}", f"{c} currency", f"{c} money"),
        ),
    }  # fmt: skip
    questions, commands, terse = wordings[field_name]

    def finish(result: str) -> tuple[str, str]:
        return f"The {field_name} of {name} is {result}.", result

    arguments = {"country": name, "field": field_name}
    return Request("lookup_country", arguments, questions, commands, terse, finish)


# ---------------------------------------------------------------- strings


def _string_tool(d: Draw) -> Request:
    rng = d.rng
    operations = ["reverse", "uppercase", "length", "count_letter"]
    operations += [] if d.phrasing.lower else ["lowercase"]  # lower-cased text would be a no-op
    operation = rng.choice(operations)
    text = _string_text(d, operation)
    letter = rng.choice(text.replace(" ", "")).lower()
    w = _quoted(d, text)
    l_ = d.protect(letter)
    questions, commands, terse = _STRING_WORDINGS[operation](w, l_)
    arguments = {"operation": operation, "text": text}
    if operation == "count_letter":
        arguments["letter"] = letter

    def finish(result: str) -> tuple[str, str]:
        return f"The result is {result}.", result

    return Request("string_tool", arguments, questions, commands, terse, finish)


def _string_text(d: Draw, operation: str) -> str:
    rng = d.rng
    text = lexicon.text_word(rng, "heldout")
    if not d.phrasing.lower and rng.random() < 0.3:  # a phrase needs quotes to be read
        text = f"{text} {lexicon.text_word(rng, 'heldout')}"
    if operation == "lowercase":
        text = text.upper() if rng.random() < 0.5 else text.title()
    return text


def _quoted(d: Draw, text: str) -> str:
    if d.phrasing.lower:  # no quote marks survive in a transcript or a lower-case message
        return d.protect(text)
    quote = d.rng.choice(('"', "'", "'") if " " in text else ('"', "'", ""))
    return f"{quote}{d.protect(text)}{quote}"


_STRING_WORDINGS: dict[str, Callable[[str, str], Wording]] = {
    "reverse": lambda w, _: (
        (f"what's {w} backwards", f"what does {w} look like reversed", f"how do you spell {w} "
         "backwards"),
        (f"spell {w} backwards", f"flip {w} around", f"write {w} back to front"),
        (f"{w} reversed", f"reverse {w}", f"{w} backwards"),
    ),
    "uppercase": lambda w, _: (
        (f"what's {w} in all caps", f"how does {w} look in capitals"),
        (f"make {w} uppercase", f"put {w} in all caps", f"capitalize every letter of {w}"),
        (f"{w} in caps", f"uppercase {w}", f"{w} all caps"),
    ),
    "lowercase": lambda w, _: (
        (f"what's {w} in small letters", f"how does {w} look in lower case"),
        (f"put {w} in small letters", f"turn {w} into lower case", f"lowercase {w} for me"),
        (f"{w} in lowercase", f"lowercase {w}", f"{w} to lower"),
    ),
    "length": lambda w, _: (
        (f"how many characters does {w} have", f"how long is {w}", f"what's the length of {w}"),
        (f"count the letters of {w}", f"tell me how many characters are in {w}"),
        (f"length of {w}", f"{w} length", f"len {w}"),
    ),
    "count_letter": lambda w, letter: (
        (f"how many {letter}'s are in {w}", f"how often does {letter} occur in {w}",
         f"how many times is the letter {letter} in {w}"),
        (f"count the {letter}'s in {w}", f"tell me how many {letter}'s {w} has"),
        (f"number of {letter}'s in {w}", f"count {letter} in {w}"),
    ),
}  # fmt: skip


BUILDERS: dict[str, Callable[[Draw], Request]] = {
    "calculator": _calculator,
    "convert_units": _convert_units,
    "dates": _dates,
    "lookup_country": _lookup_country,
    "string_tool": _string_tool,
}


# ---------------------------------------------------------------- phrasing kinds


_POLITE = (
    "could you {c}, please?", "would you be able to {c}?", "please can you {c}?",
    "hi! could you {c} for me? thanks", "sorry to bother you, but could you {c}?",
    "I'd like you to {c}, if that's ok.", "can you please {c}?",
)  # fmt: skip
_FILLERS = ("um", "uh", "so", "okay so", "um so", "hey")


def compose(d: Draw, request: Request) -> str:
    """The user's message for a request, written in the item's phrasing kind."""
    rng, kind = d.rng, d.phrasing.name
    if kind == "polite":
        text = rng.choice(_POLITE).format(c=rng.choice(request.commands))
        return _finish(_sentence_case(text))
    if kind == "terse":
        text = rng.choice(request.terse)
        return _finish(text + rng.choice(("", "?", "")))
    if rng.random() < 0.6:
        text = _sentence_case(rng.choice(request.questions)) + "?"
    else:
        text = _sentence_case(rng.choice(request.commands)) + rng.choice((".", "", "!"))
    transform = {"casual": _casual, "typos": _typos, "asr": _asr}.get(kind)
    return _finish(transform(rng, text) if transform else text)


def _sentence_case(text: str) -> str:
    return text[:1].upper() + text[1:] if text[:1] != _OPEN else text


def _finish(text: str) -> str:
    return text.replace(_OPEN, "").replace(_CLOSE, "")


def _outside(text: str, change: Callable[[str], str]) -> str:
    """Apply `change` to the text outside protected spans."""
    parts = re.split(f"({_OPEN}[^{_CLOSE}]*{_CLOSE})", text)
    return "".join(part if part.startswith(_OPEN) else change(part) for part in parts)


def _casual(rng: random.Random, text: str) -> str:
    text = _outside(text, str.lower)
    text = _outside(text, lambda part: part.replace("what's", "whats").replace("'s", "s"))
    return _outside(text, lambda part: re.sub(r"[?.!,']", "", part)).strip()


def _asr(rng: random.Random, text: str) -> str:
    text = _outside(text, lambda part: re.sub(r"[?.!,]", "", part.lower()))
    text = _outside(text, lambda part: part.replace("what's", "what is").replace("'", ""))
    text = _outside(text, lambda part: part.replace("+", " plus ").replace("-", " "))
    # A filler goes between words, never inside a protected span (a number or a date).
    words = re.sub(f"{_OPEN}[^{_CLOSE}]*{_CLOSE}", lambda m: m[0].replace(" ", "\x04"), text)
    words = words.split(" ")
    if rng.random() < 0.5:
        words.insert(rng.randint(1, max(1, len(words) - 1)), rng.choice(("uh", "um")))
    text = f"{rng.choice(_FILLERS)} {' '.join(words)}".replace("\x04", " ")
    return re.sub(" +", " ", text.replace("-", " ")).strip()


def _typos(rng: random.Random, text: str) -> str:
    """Swapped, dropped or doubled letters in unprotected words of 3+ letters, at least one."""
    parts = re.split(f"({_OPEN}[^{_CLOSE}]*{_CLOSE}|[A-Za-z]{{3,}})", text)
    eligible = [i for i, part in enumerate(parts) if re.fullmatch(r"[A-Za-z]{3,}", part)]
    if not eligible:
        return text
    chosen = {i for i in eligible if rng.random() < TYPO_RATE} or {rng.choice(eligible)}
    for i in sorted(chosen):
        parts[i] = typo(rng, parts[i])
    return "".join(parts)


def typo(rng: random.Random, word: str) -> str:
    """One typo in a word of 3+ letters, never in its first letter (people rarely miss it): two
    neighbours swapped, a letter dropped or doubled. The result always differs from the word."""
    i = rng.randrange(1, len(word))
    kind = rng.choice(("swap", "drop", "double"))
    if kind == "swap" and i >= 2 and word[i - 1] != word[i]:
        return word[: i - 1] + word[i] + word[i - 1] + word[i + 1 :]
    if kind == "drop":
        return word[:i] + word[i + 1 :]
    return word[:i] + word[i] + word[i:]


# ---------------------------------------------------------------- the example


def _build(item_id: str, kind: str, question: str, request: Request, d: Draw) -> NaturalExample:
    result = execute(request.tool, json.dumps(request.arguments))
    if result.startswith(ERROR_PREFIX):  # our own bug: every item is a question the tools answer
        raise AssertionError(f"natural item {item_id} gives a tool error: {result}")
    final_text, answer = request.finish(result)
    others = [name for name in TOOLS if name != request.tool]
    declared = [request.tool] + d.rng.sample(others, d.rng.randint(0, 3))
    d.rng.shuffle(declared)
    thinking = f"The user wants {request.tool}; call it."
    messages = [
        corpus.user(question),
        corpus.tool_call_message(thinking, request.tool, request.arguments),
        {"role": "tool", "tool_call_id": "call_0", "name": request.tool, "content": result},
        {"role": "assistant", "content": final_text},
    ]
    return NaturalExample(
        id=item_id,
        split=SPLIT,  # type: ignore[arg-type]  # a third split, outside lexicon's train/heldout
        task=request.tool,
        messages=messages,
        tools=schemas(declared),
        expected_tool=request.tool,
        expected_arguments=request.arguments,
        tool_result=result,
        expected_answer=answer,
        entities=tuple(e for e in d.entities),
        kind=kind,
    )
