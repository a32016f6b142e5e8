"""The noesis-tiny corpus: seeded conversations with tool calls, as OpenAI-style messages plus the
metadata an evaluator scores against, rendered to Harmony by harmony.render.

Example `i` of a split depends only on (seed, split, i), so any slice can be made in parallel and
re-made later. Held-out examples use only held-out entities (lexicon.split_of): names, words,
countries, and every number and year that appears in a question.

The control-plane tasks (CONTROL_MIXTURE, opt-in: the default corpus and its splits do not draw
them) add what a controller can act on: analysis that double-checks after its plan
(`Mixture.long_analysis`), questions answerable with or without a tool (`Example.tool_optional`),
and questions needing two calls in a row (`Example.later_calls`). Their evaluation split is
`control` (control_examples): held-out entities, its own seed stream.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

from noesis.tiny import english, harmony, lexicon, paraphrase
from noesis.tiny.lexicon import Split
from noesis.tiny.tools import ERROR_PREFIX, TOOLS, UNITS, WEEKDAYS, execute, format_number, schemas

CANNOT = "can't"  # every refusal for a missing tool contains this
ERROR_ANSWER = "error"  # every report of a tool error contains this


@dataclass(frozen=True)
class Example:
    """One conversation and what a correct model does in it."""

    id: str
    split: Split
    task: str
    messages: list[dict[str, Any]]  # the whole conversation, ending with the assistant's final
    tools: list[dict[str, Any]]  # declared tools (OpenAI function format)
    expected_tool: str | None  # None: the right move is to answer without a call
    expected_arguments: dict[str, Any] | None
    tool_result: str | None
    expected_answer: str | None  # a correct final answer contains it; None: not scored
    entities: tuple[str, ...] = ()  # names, words, countries and numbers drawn from the split
    voice: str = "template"  # how the question is written: the templates, or a paraphrase voice
    # The expected call may be made or not: answering directly is right too (the conversation
    # shows one of the two routes; shows_call says which).
    tool_optional: bool = False
    # Calls after the first, in order, each {"tool", "arguments", "result"}: a chain of calls
    # whose first is expected_tool / expected_arguments / tool_result.
    later_calls: tuple[dict[str, Any], ...] = ()

    @property
    def shows_call(self) -> bool:
        """Whether the conversation answers through a tool call (after the last user message)."""
        return any(m.get("tool_calls") for m in self.messages[len(self.prompt_messages) :])

    @property
    def prompt_messages(self) -> list[dict[str, Any]]:
        """The conversation up to and including the last user message."""
        last_user = max(i for i, m in enumerate(self.messages) if m["role"] == "user")
        return self.messages[: last_user + 1]

    @property
    def messages_before_final(self) -> list[dict[str, Any]]:
        """Everything before the closing final answer (with the tool call and its result)."""
        return self.messages[:-1]

    @property
    def final_answer(self) -> str:
        return self.messages[-1]["content"]

    def text(self) -> str:
        return harmony.render(self.messages, self.tools)

    def history_spans(self) -> list[tuple[int, int]]:
        """Character spans in text() of the assistant turns before the last user message: context
        the model reads but should not learn to write (their analysis is dropped, so they would
        teach it to skip analysis and to run on past a final answer)."""
        text, spans, position = self.text(), [], 0
        for message in self.prompt_messages:
            if message["role"] == "assistant":
                segment = harmony.assistant_text(message, is_last=False)
                begin = text.index(segment, position)
                position = begin + len(segment)
                spans.append((begin, position))
        return spans

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Task:
    """A question and how to answer it, before tools are declared and messages are built."""

    kind: str
    question: str
    tool: str | None = None
    arguments: dict[str, Any] | None = None
    thinking: str = ""
    # For tool tasks: tool result -> (final answer, expected answer).
    finish: Callable[[str], tuple[str, str]] | None = None
    final: str = ""  # for tasks answered without a tool
    answer: str | None = None
    voice: str = "template"
    # Tasks answerable either way (tool_optional): the direct route's analysis ("" for others).
    direct_thinking: str = ""
    earlier: list[dict[str, Any]] = field(default_factory=list)  # an exchange the task needs


@dataclass
class Draw:
    """The random choices of one example: templates from `rng`, entities from `split`, recorded."""

    rng: random.Random
    split: Split
    entities: list[str] = field(default_factory=list)

    def _keep(self, entity: str) -> str:
        self.entities.append(entity)
        return entity

    def number(self, low: int, high: int) -> int:
        value = lexicon.number(self.rng, low, high, self.split)
        self._keep(str(abs(value)))
        return value

    def person(self) -> str:
        return self._keep(lexicon.person_name(self.rng, self.split))

    def word(self) -> str:
        return self._keep(lexicon.text_word(self.rng, self.split))

    def country(self) -> lexicon.Country:
        country = self.rng.choice(lexicon.countries_in(self.split))
        self._keep(country.name)
        return country

    def unknown_country(self) -> str:
        return self._keep(lexicon.unknown_country_name(self.rng, self.split))

    def city(self) -> str:
        return self._keep(self.rng.choice(lexicon.countries_in(self.split)).capital)

    def date(self) -> str:
        year = self.number(1900, 2099)
        return f"{year:04d}-{self.rng.randint(1, 12):02d}-{self.rng.randint(1, 28):02d}"


@dataclass(frozen=True)
class Mixture:
    """How often each task appears, and how tools are declared."""

    weights: dict[str, float] = field(
        default_factory=lambda: {
            "calculator": 16,
            "convert_units": 10,
            "add_days": 6,
            "days_between": 5,
            "day_of_week": 6,
            "lookup_country": 14,
            "string_tool": 10,
            "greeting": 6,
            "recall": 13,
            "writing": 8,
        }
    )
    missing_tool: float = 0.15  # a tool task whose tool is not declared
    no_tools: float = 0.06  # no developer tools at all
    history: float = 0.10  # an earlier small exchange before the question
    max_declared: int = 4
    # Training conversations declare up to every built-in tool, as `noesis chat` and the voice do;
    # held-out ones keep max_declared, so that split stays what it was.
    max_declared_train: int = 7
    # Training tool questions written by noesis.tiny.paraphrase (natural voices) instead of the
    # templates; held-out examples always use the templates, so that split stays comparable.
    paraphrased: float = 0.6
    # Control-plane tasks (0 in the default mixture, so it draws no random number for them):
    long_analysis: float = 0.0  # share of examples whose analysis double-checks after the plan
    optional_call: float = 0.3  # tool_optional training examples that show the call route


DEFAULT_MIXTURE = Mixture()


def example(seed: int, split: Split, index: int, mixture: Mixture = DEFAULT_MIXTURE) -> Example:
    draw = Draw(random.Random(f"noesis-tiny/{seed}/{split}/{index}"), split)
    return _example(draw, f"{split}-{seed}-{index}", mixture)


def _example(draw: Draw, example_id: str, mixture: Mixture) -> Example:
    rng, split = draw.rng, draw.split
    kinds, weights = zip(*mixture.weights.items(), strict=True)
    kind = rng.choices(kinds, weights)[0]
    if kind == TWO_CALLS:
        return _chain_example(draw, example_id, mixture)
    task = None
    if split == "train" and kind in paraphrase.BUILDERS and rng.random() < mixture.paraphrased:
        task = _paraphrased(draw, kind)
    task = task or _generator(kind)(draw)
    if mixture.long_analysis and rng.random() < mixture.long_analysis:
        _overthink(rng, task)
    declared = _declare_tools(rng, task.tool, mixture, split)
    messages = _instructions(rng) + _history(draw, mixture) + task.earlier + [user(task.question)]
    # Either route is right for a tool_optional task: training shows the call now and then.
    show_call = not task.direct_thinking or (
        split == "train" and rng.random() < mixture.optional_call
    )
    built = _answer(task, declared, show_call)
    messages += built.messages
    return Example(
        id=example_id,
        split=split,
        task=task.kind,
        messages=messages,
        tools=schemas(declared),
        expected_tool=built.tool,
        expected_arguments=task.arguments if built.tool else None,
        tool_result=built.result,
        expected_answer=built.answer,
        entities=tuple(draw.entities),
        voice=task.voice,
        tool_optional=built.optional,
    )


def _generator(kind: str) -> Callable[[Draw], Task]:
    generator = GENERATORS.get(kind) or CONTROL_GENERATORS.get(kind)
    if generator is None:
        known = ", ".join([*GENERATORS, *CONTROL_GENERATORS, TWO_CALLS])
        raise ValueError(f"unknown task kind {kind!r} in the mixture (known: {known})")
    return generator


def _paraphrased(draw: Draw, kind: str) -> Task | None:
    """The task with its question in a natural voice, or None when the natural evaluation split
    asks the very same question (then the templates phrase it instead)."""
    voice = paraphrase.pick_voice(draw.rng)
    phrased = paraphrase.BUILDERS[kind](draw, voice)
    if asked_by_evaluation(phrased.question):
        return None
    task = TOOL_TASKS[kind](draw, phrased.question, phrased.arguments)
    task.voice = f"{voice.numbers}/{voice.surface}"
    return task


EVALUATION_SEED = 1234  # harness.EvalConfig.corpus_seed, the seed `noesis eval tools` uses
EVALUATION_ITEMS = 2000  # of the natural split at that seed, kept out of training


@functools.cache
def _evaluation_questions() -> frozenset[str]:
    from noesis.tiny import natural  # it imports this module

    items = natural.generate(EVALUATION_SEED, EVALUATION_ITEMS)
    return frozenset(_normalized(x.messages[0]["content"]) for x in items)


def _normalized(question: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", question.lower()).split())


def asked_by_evaluation(question: str) -> bool:
    """Whether the natural split (at the evaluation seed) asks this question, up to case,
    punctuation and spacing: such a question never enters the training corpus."""
    return _normalized(question) in _evaluation_questions()


def generate(
    seed: int, split: Split, count: int, start: int = 0, mixture: Mixture = DEFAULT_MIXTURE
) -> list[Example]:
    return [example(seed, split, i, mixture) for i in range(start, start + count)]


CONTROL_SPLIT = "control"


def control_examples(seed: int, count: int, start: int = 0) -> list[Example]:
    """The `control` evaluation split: CONTROL_EVAL_MIXTURE over held-out entities, from a seed
    stream of its own (neither the held-out split's nor the training split's)."""
    return [control_example(seed, i) for i in range(start, start + count)]


def control_example(seed: int, index: int) -> Example:
    draw = Draw(random.Random(f"noesis-tiny-control/{seed}/{index}"), "heldout")
    return _example(draw, f"{CONTROL_SPLIT}-{seed}-{index}", CONTROL_EVAL_MIXTURE)


def texts(
    seed: int,
    split: Split,
    count: int,
    start: int = 0,
    doc_every: int = 6,
    mixture: Mixture = DEFAULT_MIXTURE,
) -> Iterator[str]:
    """Harmony conversations, with a plain English document in place of every `doc_every`-th."""
    for text, _ in training_items(seed, split, count, start, doc_every, mixture):
        yield text


def training_items(
    seed: int,
    split: Split,
    count: int,
    start: int = 0,
    doc_every: int = 6,
    mixture: Mixture = DEFAULT_MIXTURE,
) -> Iterator[tuple[str, list[tuple[int, int]]]]:
    """What texts() yields, each with the character spans not to train on (history_spans)."""
    for i in range(start, start + count):
        if doc_every and i % doc_every == doc_every - 1:
            yield document(seed, split, i), []
        else:
            item = example(seed, split, i, mixture)
            yield item.text(), item.history_spans()


def document(seed: int, split: Split, index: int) -> str:
    rng = random.Random(f"noesis-tiny-doc/{seed}/{split}/{index}")
    return english.document(rng, tuple(lexicon.person_name(rng, split) for _ in range(4)))


# ---------------------------------------------------------------- messages


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def tool_call_message(
    thinking: str, name: str, arguments: dict[str, Any], call_id: str = "call_0"
) -> dict[str, Any]:
    call = {"name": name, "arguments": json.dumps(arguments, separators=(",", ":"))}
    return {
        "role": "assistant",
        "thinking": thinking,
        "tool_calls": [{"id": call_id, "type": "function", "function": call}],
    }


@dataclass
class _Answer:
    messages: list[dict[str, Any]]
    tool: str | None
    result: str | None
    answer: str | None
    optional: bool = False  # the call (tool, result) may be made or not


def _answer(task: Task, declared: list[str], show_call: bool = True) -> _Answer:
    if task.tool is None:
        final = {"role": "assistant", "thinking": task.thinking, "content": task.final}
        return _Answer([final], None, None, task.answer)
    if task.direct_thinking and (task.tool not in declared or not show_call):
        return _direct_answer(task, declared)
    if task.tool not in declared:
        thinking, final = _missing_tool(task.tool)
        return _Answer(
            [{"role": "assistant", "thinking": thinking, "content": final}], None, None, CANNOT
        )
    assert task.arguments is not None and task.finish is not None
    result = execute(task.tool, json.dumps(task.arguments))
    if result.startswith(ERROR_PREFIX):
        final_text = (
            f"Sorry, the {task.tool} tool returned an error: {result[len(ERROR_PREFIX) :]}."
        )
        answer = ERROR_ANSWER
    else:
        final_text, answer = task.finish(result)
    messages = [
        tool_call_message(task.thinking, task.tool, task.arguments),
        {"role": "tool", "tool_call_id": "call_0", "name": task.tool, "content": result},
        {"role": "assistant", "content": final_text},
    ]
    return _Answer(messages, task.tool, result, answer, optional=bool(task.direct_thinking))


def _direct_answer(task: Task, declared: list[str]) -> _Answer:
    """A tool_optional task answered without the call: the call stays expected-if-made where its
    tool is declared; without the tool, answering directly is the one right move."""
    assert task.tool is not None and task.arguments is not None
    final = {"role": "assistant", "thinking": task.direct_thinking, "content": task.final}
    if task.tool not in declared:
        return _Answer([final], None, None, task.answer)
    result = execute(task.tool, json.dumps(task.arguments))
    return _Answer([final], task.tool, result, task.answer, optional=True)


_PURPOSES = {
    "calculator": ("a calculation", "calculate that"),
    "convert_units": ("a unit conversion", "convert units"),
    "add_days": ("a date calculation", "work out that date"),
    "days_between": ("a date calculation", "count those days"),
    "day_of_week": ("a weekday", "find the weekday"),
    "lookup_country": ("country information", "look that up"),
    "string_tool": ("a text operation", "do that text operation"),
}


def _missing_tool(tool: str) -> tuple[str, str]:
    purpose, action = _PURPOSES[tool]
    thinking = f"The user wants {purpose}, but the {tool} tool is not available."
    return thinking, f"Sorry, I {CANNOT} {action} without the {tool} tool."


def _declare_tools(
    rng: random.Random, needed: str | None, mixture: Mixture, split: Split
) -> list[str]:
    if rng.random() < mixture.no_tools:
        return []
    others = [name for name in TOOLS if name != needed]
    most = mixture.max_declared_train if split == "train" else mixture.max_declared
    count = rng.randint(1, most)
    if needed is not None and rng.random() >= mixture.missing_tool:
        declared = [needed] + rng.sample(others, min(count - 1, len(others)))
    else:
        declared = rng.sample(others, min(count, len(others)))
    rng.shuffle(declared)
    return declared


INSTRUCTIONS = (
    "You are a helpful assistant.",
    "Use the tools when they help. Keep answers short.",
    "Answer clearly and briefly.",
    "Be friendly and precise.",
    "Think step by step, then answer in one sentence.",
    "Only call a tool when you need it.",
)


def _instructions(rng: random.Random) -> list[dict[str, Any]]:
    if rng.random() < 0.3:
        return []
    return [{"role": "developer", "content": rng.choice(INSTRUCTIONS)}]


def _history(draw: Draw, mixture: Mixture) -> list[dict[str, Any]]:
    """An earlier exchange answered without tools; its analysis is dropped, as gpt-oss does."""
    if draw.rng.random() >= mixture.history:
        return []
    earlier = draw.rng.choice((_greeting, _recall))(draw)
    return [user(earlier.question), {"role": "assistant", "content": earlier.final}]


# ---------------------------------------------------------------- arithmetic


_WORD_OPS = {"+": "plus", "-": "minus", "*": "times", "/": "divided by"}
_ASK = ("What is {}?", "Calculate {}.", "Compute {}.", "How much is {}?", "Please work out {}.")


def _calculator(d: Draw) -> Task:
    rng = d.rng
    shape = rng.choices(("binary", "ternary", "percent", "square", "zero"), (60, 22, 8, 7, 3))[0]
    expression, question = _ARITHMETIC[shape](d)
    display = question
    if shape in ("binary", "ternary") and rng.random() < 0.5:
        display = rng.choice(_ASK).format(_spaced(expression) if rng.random() < 0.5 else expression)
    return _calculator_task(d, display, {"expression": expression})


def _calculator_task(d: Draw, question: str, arguments: dict[str, Any]) -> Task:
    rng, expression = d.rng, arguments["expression"]
    thinking = rng.choice(
        (
            f"The user wants {expression}. I will use the calculator.",
            f"This needs arithmetic: {expression}. Use the calculator.",
            f"Compute {expression} with the calculator tool.",
        )
    )

    def finish(result: str) -> tuple[str, str]:
        text = rng.choice((f"{expression} = {result}.", f"The answer is {result}."))
        return text, result

    return Task("calculator", question, "calculator", arguments, thinking, finish)


def _spaced(expression: str) -> str:
    for op in "+-*/":
        expression = expression.replace(op, f" {op} ")
    return expression.replace("*  *", "**")


def _binary(d: Draw) -> tuple[str, str]:
    rng = d.rng
    op = rng.choice("+-*/")
    if op == "*":
        a, b = d.number(2, 99), d.number(2, 999)
    elif op == "/":
        b = d.number(2, 50)
        a = d.number(2, 2000)
    else:
        a, b = d.number(2, 9999), d.number(2, 9999)
    return f"{a}{op}{b}", f"What is {a} {_WORD_OPS[op]} {b}?"


def _ternary(d: Draw) -> tuple[str, str]:
    rng = d.rng
    a, b, c = (d.number(2, 200) for _ in range(3))
    op1, op2 = rng.choice("+-*"), rng.choice("+-*")
    if rng.random() < 0.5:
        return (
            f"({a}{op1}{b}){op2}{c}",
            f"What is {a} {_WORD_OPS[op1]} {b}, then {_WORD_OPS[op2]} {c}?",
        )
    return f"{a}{op1}{b}{op2}{c}", f"What is {a} {_WORD_OPS[op1]} {b} {_WORD_OPS[op2]} {c}?"


def _percent(d: Draw) -> tuple[str, str]:
    p, n = d.number(1, 99), d.number(10, 5000)
    return f"{n}*{p}/100", f"What is {p}% of {n}?"


def _square(d: Draw) -> tuple[str, str]:
    a = d.number(2, 999)
    return f"{a}**2", f"What is {a} squared?"


def _zero(d: Draw) -> tuple[str, str]:
    a = d.number(2, 999)
    return f"{a}/0", f"What is {a} divided by 0?"


_ARITHMETIC = {
    "binary": _binary,
    "ternary": _ternary,
    "percent": _percent,
    "square": _square,
    "zero": _zero,
}


# ---------------------------------------------------------------- units


UNIT_ALIASES: dict[str, tuple[str, ...]] = {
    "kilometer": ("km", "kilometers"),
    "meter": ("meters", "m"),
    "centimeter": ("cm", "centimeters"),
    "mile": ("miles",),
    "foot": ("feet", "ft"),
    "inch": ("inches",),
    "kilogram": ("kg", "kilograms"),
    "gram": ("grams", "g"),
    "pound": ("pounds", "lb"),
    "ounce": ("ounces", "oz"),
    "liter": ("liters", "L"),
    "milliliter": ("milliliters", "ml"),
    "gallon": ("gallons",),
    "celsius": ("degrees Celsius", "Celsius"),
    "fahrenheit": ("degrees Fahrenheit", "Fahrenheit"),
    "kelvin": ("kelvins", "kelvin"),
}
_UNIT_ASK = (
    "Convert {v} {a} to {b}.",
    "How many {b} are in {v} {a}?",
    "What is {v} {a} in {b}?",
    "{v} {a} is how many {b}?",
)


def _convert_units(d: Draw) -> Task:
    rng = d.rng
    dimension = rng.choice(("length", "mass", "volume", "temperature"))
    source, target = rng.sample([u for u in UNITS.values() if u.dimension == dimension], 2)
    low, high = (-40, 250) if dimension == "temperature" else (1, 900)
    value: float = d.number(low, high)
    if dimension != "temperature" and rng.random() < 0.2:
        value += 0.5
    shown = format_number(value)
    a, b = rng.choice(UNIT_ALIASES[source.name]), rng.choice(UNIT_ALIASES[target.name])
    question = rng.choice(_UNIT_ASK).format(v=shown, a=a, b=b)
    arguments = {"value": value, "from_unit": source.name, "to_unit": target.name}
    return _convert_units_task(d, question, arguments)


def _convert_units_task(d: Draw, question: str, arguments: dict[str, Any]) -> Task:
    source, target = UNITS[arguments["from_unit"]], UNITS[arguments["to_unit"]]
    shown = format_number(arguments["value"])
    thinking = f"Convert {shown} {source.name} to {target.name} with convert_units."

    def finish(result: str) -> tuple[str, str]:
        number = result.split(" = ")[1].split(" ")[0]
        return f"{shown} {source.plural} is {number} {target.plural}.", number

    return Task("convert_units", question, "convert_units", arguments, thinking, finish)


# ---------------------------------------------------------------- dates


MONTHS = (
    "January February March April May June July August September October November December".split()
)


def _spoken(iso: str, rng: random.Random) -> str:
    """The date as the user writes it: ISO most of the time, sometimes 'March 5, 2024'."""
    if rng.random() < 0.7:
        return iso
    year, month, day = iso.split("-")
    return f"{MONTHS[int(month) - 1]} {int(day)}, {year}"


def _add_days(d: Draw) -> Task:
    rng = d.rng
    start, days = d.date(), d.number(1, 500)
    shown = _spoken(start, rng)
    before = rng.random() < 0.3
    if before:
        question = rng.choice(
            ("What date is {n} days before {d}?", "What was the date {n} days before {d}?")
        )
    else:
        question = rng.choice(
            (
                "What date is {n} days after {d}?",
                "Add {n} days to {d}.",
                "If today is {d}, what date will it be in {n} days?",
            )
        )
    arguments = {"date": start, "days": -days if before else days}
    return _add_days_task(d, question.format(n=days, d=shown), arguments)


def _add_days_task(d: Draw, question: str, arguments: dict[str, Any]) -> Task:
    start, signed = arguments["date"], arguments["days"]
    word = "before" if signed < 0 else "after"
    thinking = f"Start at {start} and add {signed} days with add_days."

    def finish(result: str) -> tuple[str, str]:
        return f"{abs(signed)} days {word} {start} is {result}.", result

    return Task("add_days", question, "add_days", arguments, thinking, finish)


def _days_between(d: Draw) -> Task:
    rng = d.rng
    start, end = sorted((d.date(), d.date()))
    if rng.random() < 0.2:
        start, end = end, start
    a, b = _spoken(start, rng), _spoken(end, rng)
    question = rng.choice(
        (
            "How many days are there between {a} and {b}?",
            "How many days from {a} to {b}?",
            "Count the days from {a} until {b}.",
        )
    ).format(a=a, b=b)
    return _days_between_task(d, question, {"start": start, "end": end})


def _days_between_task(d: Draw, question: str, arguments: dict[str, Any]) -> Task:
    start, end = arguments["start"], arguments["end"]
    thinking = f"Count the days from {start} to {end} with days_between."

    def finish(result: str) -> tuple[str, str]:
        return f"There are {result} days from {start} to {end}.", result

    return Task("days_between", question, "days_between", arguments, thinking, finish)


def _day_of_week(d: Draw) -> Task:
    rng = d.rng
    date = d.date()
    question = rng.choice(
        (
            "What day of the week is {d}?",
            "Which weekday was {d}?",
            "On what day of the week does {d} fall?",
        )
    ).format(d=_spoken(date, rng))
    return _day_of_week_task(d, question, {"date": date})


def _day_of_week_task(d: Draw, question: str, arguments: dict[str, Any]) -> Task:
    date = arguments["date"]
    thinking = f"Find the weekday of {date} with day_of_week."

    def finish(result: str) -> tuple[str, str]:
        return f"{date} is a {result}.", result

    return Task("day_of_week", question, "day_of_week", arguments, thinking, finish)


# ---------------------------------------------------------------- country table


_COUNTRY_ASK = {
    "capital": (
        "What is the capital of {c}?",
        "Which city is the capital of {c}?",
        "Tell me the capital of {c}.",
    ),
    "population": ("What is the population of {c}?", "How many people live in {c}?"),
    "currency": ("What currency does {c} use?", "What is the currency of {c}?"),
}
_COUNTRY_FINAL = {
    "capital": "The capital of {c} is {r}.",
    "population": "{c} has a population of {r}.",
    "currency": "The currency of {c} is the {r}.",
}


def _lookup_country(d: Draw) -> Task:
    rng = d.rng
    if rng.random() < 0.04:
        name = d.unknown_country()
    else:
        name = d.country().name
    what = rng.choices(("capital", "population", "currency"), (45, 30, 25))[0]
    question = rng.choice(_COUNTRY_ASK[what]).format(c=name)
    return _lookup_country_task(d, question, {"country": name, "field": what})


def _lookup_country_task(d: Draw, question: str, arguments: dict[str, Any]) -> Task:
    name, what = arguments["country"], arguments["field"]
    thinking = f"Look up the {what} of {name} with lookup_country."

    def finish(result: str) -> tuple[str, str]:
        return _COUNTRY_FINAL[what].format(c=name, r=result), result

    return Task("lookup_country", question, "lookup_country", arguments, thinking, finish)


# ---------------------------------------------------------------- strings


def _string_tool(d: Draw) -> Task:
    rng = d.rng
    word = d.word()
    operation = rng.choice(("reverse", "uppercase", "lowercase", "length", "count_letter"))
    text = word.capitalize() if operation == "lowercase" and rng.random() < 0.5 else word
    text = text.upper() if operation == "lowercase" and text == word else text
    letter = rng.choice(word) if rng.random() < 0.85 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    question = rng.choice(_STRING_ASK[operation]).format(w=text, l=letter)
    arguments = {"operation": operation, "text": text}
    if operation == "count_letter":
        arguments["letter"] = letter
    return _string_tool_task(d, question, arguments)


def _string_tool_task(d: Draw, question: str, arguments: dict[str, Any]) -> Task:
    operation, text, letter = arguments["operation"], arguments["text"], arguments.get("letter")
    thinking = f"Use string_tool with {operation} on '{text}'."

    def finish(result: str) -> tuple[str, str]:
        return _STRING_FINAL[operation].format(w=text, l=letter, r=result), result

    return Task("string_tool", question, "string_tool", arguments, thinking, finish)


_STRING_ASK = {
    "reverse": (
        "Reverse the word '{w}'.",
        "What is '{w}' spelled backwards?",
        "Write {w} backwards.",
    ),
    "uppercase": ("Write '{w}' in uppercase.", "Convert '{w}' to capital letters."),
    "lowercase": ("Make '{w}' lowercase.", "Write '{w}' in lowercase letters."),
    "length": (
        "How many letters are in '{w}'?",
        "How long is the word '{w}'?",
        "Count the characters in '{w}'.",
    ),
    "count_letter": (
        "How many times does the letter '{l}' appear in '{w}'?",
        "Count the letter '{l}' in '{w}'.",
    ),
}
_STRING_FINAL = {
    "reverse": "'{w}' backwards is '{r}'.",
    "uppercase": "In uppercase, '{w}' is '{r}'.",
    "lowercase": "In lowercase, '{w}' is '{r}'.",
    "length": "'{w}' has {r} letters.",
    "count_letter": "The letter '{l}' appears {r} times in '{w}'.",
}


# ---------------------------------------------------------------- answered without a tool


_SMALL_TALK = (
    (
        ("Hi!", "Hello!", "Hello there.", "Good morning!", "Hey, how are you?"),
        "The user is greeting me. No tool is needed.",
        "Hello! How can I help you today?",
        "help",
    ),
    (
        ("Thanks!", "Thank you very much.", "Thanks for the help."),
        "The user is thanking me. No tool is needed.",
        "You're welcome! Let me know if you need anything else.",
        "welcome",
    ),
    (
        ("Who are you?", "What is your name?"),
        "The user asks who I am. No tool is needed.",
        "I am noesis-tiny, a small assistant that answers questions and uses tools.",
        "noesis-tiny",
    ),
    (
        ("Bye!", "Goodbye.", "See you later."),
        "The user is saying goodbye. No tool is needed.",
        "Goodbye! Have a nice day.",
        "Goodbye",
    ),
)


def _greeting(d: Draw) -> Task:
    rng = d.rng
    questions, thinking, final, answer = rng.choice(_SMALL_TALK)
    return Task("greeting", rng.choice(questions), thinking=thinking, final=final, answer=answer)


def _recall(d: Draw) -> Task:
    """A fact stated in the question, asked back: answered directly even when tools are declared."""
    question, final, answer = _stated_fact(d)
    thinking = d.rng.choice(
        (
            "The answer is in the message. No tool is needed.",
            "The user already told me. Answer directly.",
        )
    )
    return Task("recall", question, thinking=thinking, final=final, answer=answer)


def _stated_fact(d: Draw) -> tuple[str, str, str]:
    """(question, final answer, expected answer)"""
    rng = d.rng
    match rng.randrange(9):
        case 0:
            name = d.person()
            return f"My name is {name}. What is my name?", f"Your name is {name}.", name
        case 1:
            city = d.city()
            return f"I live in {city}. Where do I live?", f"You live in {city}.", city
        case 2:
            color = rng.choice(english.COLORS)
            question = f"My favorite color is {color}. What is my favorite color?"
            return question, f"Your favorite color is {color}.", color
        case 3:
            n, item = d.number(2, 99), rng.choice(("apples", "books", "coins", "pencils", "cards"))
            return f"I have {n} {item}. How many {item} do I have?", f"You have {n} {item}.", str(n)
        case 4:
            code = d.number(1000, 9999)
            question = f"The door code is {code}. What is the door code?"
            return question, f"The door code is {code}.", str(code)
        case 5:
            animal, name = rng.choice(english.ANIMALS), d.person()
            question = f"My {animal} is called {name}. What is my {animal} called?"
            return question, f"Your {animal} is called {name}.", name
        case 6:
            name, n = d.person(), d.number(2, 99)
            return (
                f"{name} is {n} years old. How old is {name}?",
                f"{name} is {n} years old.",
                str(n),
            )
        case 7:
            name, date = d.person(), d.date()
            question = f"{name} was born on {date}. When was {name} born?"
            return question, f"{name} was born on {date}.", date
        case _:
            day = rng.choice(WEEKDAYS)
            question = f"The meeting is on {day}. Which day is the meeting?"
            return question, f"The meeting is on {day}.", day


def _writing(d: Draw) -> Task:
    rng = d.rng
    animal = rng.choice(english.ANIMALS)
    kind = rng.randrange(3)
    if kind == 0:
        question = rng.choice(("Write a sentence about a {a}.", "Say something about a {a}."))
        return Task(
            "writing",
            question.format(a=animal),
            thinking=f"A sentence about a {animal}. I can write it myself, no tool is needed.",
            final=english.about(rng, animal),
            answer=animal,
        )
    if kind == 1:
        name = d.person()
        return Task(
            "writing",
            f"Tell me a short story about {name} and a {animal}.",
            thinking="A short story. I can write it myself, no tool is needed.",
            final=english.story(rng, name, animal),
            answer=name,
        )
    return Task(
        "writing",
        rng.choice(("Tell me a fact.", "Tell me something interesting.")),
        thinking="The user wants a simple fact. No tool is needed.",
        final=rng.choice(english.FACTS),
        answer=None,
    )


# ---------------------------------------------------------------- control plane: long analysis


def _overthink(rng: random.Random, task: Task) -> None:
    """Lengthen the task's analysis as reasoning models do: the plan stays first (what is asked,
    the tool or "No tool is needed", the arguments), then one to three sentences that double-check
    or restate it and add nothing. They restate this task's own values, from its split."""
    count = rng.randint(1, 3)
    if task.tool is None:
        task.thinking = _checked(rng, task.thinking, _direct_checks(task), count)
        return
    assert task.arguments is not None
    task.thinking = _checked(rng, task.thinking, _tool_checks(task.tool, task.arguments), count)
    if task.direct_thinking:
        task.direct_thinking = _checked(rng, task.direct_thinking, _direct_checks(task), count)


def _checked(rng: random.Random, plan: str, checks: list[str], count: int) -> str:
    return " ".join([plan, *rng.sample(checks, min(count, len(checks)))])


def _tool_checks(tool: str, a: dict[str, Any]) -> list[str]:
    """Sentences that re-read a call's arguments: true of them, and useless for the call."""
    match tool:
        case "calculator":
            e = a["expression"]
            return [f"Let me re-read the expression: {e}.",
                    f"I should pass {e} exactly as written.",
                    "The calculator follows the usual order of operations.",
                    "No units are involved, so the result is a plain number."]  # fmt: skip
        case "convert_units":
            v, s, t = format_number(a["value"]), UNITS[a["from_unit"]], UNITS[a["to_unit"]]
            return [f"The value is {v} {s.plural}.", f"The target unit is {t.name}.",
                    f"Both are units of {s.dimension}, so the conversion works.",
                    "I should not round the value before converting.",
                    f"So the call goes from {s.name} to {t.name}."]  # fmt: skip
        case "add_days":
            d, n = a["date"], a["days"]
            return [f"The date {d} is already in YYYY-MM-DD form.",
                    f"It is {abs(n)} days {'before' if n < 0 else 'after'}, so days is {n}.",
                    "The tool handles month ends and leap years.",
                    f"Let me re-read the start date: {d}."]  # fmt: skip
        case "days_between":
            return ["Both dates are in YYYY-MM-DD form.",
                    f"The start is {a['start']} and the end is {a['end']}.",
                    "The start date goes first.",
                    "The tool counts the days, so I do not need to."]  # fmt: skip
        case "day_of_week":
            d = a["date"]
            return [f"The date is {d}, in YYYY-MM-DD form.", f"The year is {d[:4]}.",
                    "The tool knows the calendar, so I do not count days myself.",
                    f"Let me re-read the date: {d}."]  # fmt: skip
        case "lookup_country":
            c, f = a["country"], a["field"]
            return [f"The country is {c}.", f"Let me re-read the name: {c}.",
                    f"The field is {f}.", f"I want the {f}, nothing else."]  # fmt: skip
        case "string_tool":
            t, op = a["text"], a["operation"]
            last = f"The letter is '{a['letter']}'." if "letter" in a else \
                "Case matters, so I copy the text exactly."  # fmt: skip
            return [f"The text is '{t}'.", f"Let me re-read the word: {t}.",
                    f"The operation is {op}.", last]  # fmt: skip
    raise ValueError(f"no checks for tool {tool!r}")


def _direct_checks(task: Task) -> list[str]:
    """Sentences that restate a direct answer's grounds."""
    checks = ["Nothing needs to be computed or looked up.", "I should keep the answer short."]
    if task.kind == "greeting":
        return [*checks, "It is a short friendly message.", "I should answer politely."]
    if task.kind == "writing":
        about = [f"The topic is {task.answer}."] if task.answer else []
        return [*checks, "I can write this from what I know.", *about]
    return [*checks, f"Let me re-read the message: the answer is {task.answer}.",
            "The user said it directly, so I can repeat it."]  # fmt: skip


# ---------------------------------------------------------------- control plane: either route


def _optional_tool(d: Draw) -> Task:
    """A question a tool could answer, but whose answer is at hand: a single-digit sum, a weekday
    the user gave with its date, a capital the user stated earlier in the conversation."""
    task, direct_thinking, final, answer = d.rng.choice(_EITHER_ROUTE)(d)
    task.kind, task.direct_thinking = OPTIONAL_TOOL, direct_thinking
    task.final, task.answer = final, answer
    return task


def _small_sum(d: Draw) -> tuple[Task, str, str, str]:
    rng = d.rng
    a, b = d.number(1, 9), d.number(1, 9)
    total = str(a + b)
    question = rng.choice(("What is {a} plus {b}?", "What is {a} + {b}?", "Quick one: {a} + {b}?",
                           "How much is {a} and {b}?")).format(a=a, b=b)  # fmt: skip
    thinking = rng.choice(
        (
            f"{a} + {b} is simple: {total}. No tool is needed.",
            f"A small sum: {a} + {b} = {total}. I can answer directly.",
        )
    )
    final = rng.choice((f"{a} + {b} = {total}.", f"It is {total}."))
    return _calculator_task(d, question, {"expression": f"{a}+{b}"}), thinking, final, total


def _weekday_given(d: Draw) -> tuple[Task, str, str, str]:
    rng = d.rng
    date = d.date()
    weekday = execute("day_of_week", json.dumps({"date": date}))
    shown = _spoken(date, rng)
    event = rng.choice(("appointment", "meeting", "flight", "party", "exam"))
    question = rng.choice((
        "My {e} is on {w}, {d}. What day of the week is my {e}?",
        "My {e} is on {d}, a {w}. Which weekday is my {e}?",
        "The {e} is on {w} {d}. On what day of the week is the {e}?",
    )).format(e=event, w=weekday, d=shown)  # fmt: skip
    thinking = rng.choice(
        (
            f"The user already said {date} is a {weekday}. No tool is needed.",
            f"The weekday is in the message: {weekday}. Answer directly.",
        )
    )
    final = f"Your {event} is on a {weekday}."
    return _day_of_week_task(d, question, {"date": date}), thinking, final, weekday


def _stated_capital(d: Draw) -> tuple[Task, str, str, str]:
    rng = d.rng
    country = d.country()
    name, capital = country.name, country.capital
    said = rng.choice((f"I read that the capital of {name} is {capital}.",
                       f"Fun fact: {capital} is the capital of {name}."))  # fmt: skip
    question = rng.choice((f"What is the capital of {name} again?",
                           f"Remind me, what is the capital of {name}?"))  # fmt: skip
    thinking = f"The user told me earlier that the capital of {name} is {capital}."
    thinking += " No tool is needed."
    task = _lookup_country_task(d, question, {"country": name, "field": "capital"})
    reply = rng.choice(("Thanks for sharing!", "Good to know."))
    task.earlier = [user(said), {"role": "assistant", "content": reply}]
    return task, thinking, f"The capital of {name} is {capital}.", capital


_EITHER_ROUTE = (_small_sum, _weekday_given, _stated_capital)


# ---------------------------------------------------------------- control plane: two calls


@dataclass
class _Step:
    thinking: str
    tool: str
    arguments: dict[str, Any]
    result: str = ""


@dataclass
class _Chain:
    question: str
    steps: list[_Step]
    finish: Callable[[list[str]], tuple[str, str]]  # results -> (final answer, expected answer)


def _chain_example(draw: Draw, example_id: str, mixture: Mixture) -> Example:
    """A question needing two calls in a row (the second's arguments come from the first's
    result): call, result, call, result, final. Both tools declared, unless one is missing (the
    mixture's missing_tool share), which is refused like a single missing tool."""
    rng = draw.rng
    chain = rng.choice(_CHAINS)(draw)
    first = chain.steps[0]
    if mixture.long_analysis and rng.random() < mixture.long_analysis:
        first.thinking = _checked(rng, first.thinking, _tool_checks(first.tool, first.arguments),
                                  rng.randint(1, 3))  # fmt: skip
    needed = [step.tool for step in chain.steps]
    declared, missing = _declare_chain(rng, needed, mixture, draw.split)
    messages = _instructions(rng) + _history(draw, mixture) + [user(chain.question)]
    tool = arguments = result = None
    later: tuple[dict[str, Any], ...] = ()
    if missing is not None:
        thinking, final = _missing_tool(missing)
        messages.append({"role": "assistant", "thinking": thinking, "content": final})
        answer: str | None = CANNOT
    else:
        for index, step in enumerate(chain.steps):
            call_id = f"call_{index}"
            messages += [tool_call_message(step.thinking, step.tool, step.arguments, call_id),
                         {"role": "tool", "tool_call_id": call_id, "name": step.tool,
                          "content": step.result}]  # fmt: skip
        final, answer = chain.finish([step.result for step in chain.steps])
        messages.append({"role": "assistant", "content": final})
        tool, arguments, result = first.tool, first.arguments, first.result
        later = tuple({"tool": s.tool, "arguments": s.arguments, "result": s.result}
                      for s in chain.steps[1:])  # fmt: skip
    return Example(
        id=example_id, split=draw.split, task=TWO_CALLS, messages=messages,
        tools=schemas(declared), expected_tool=tool, expected_arguments=arguments,
        tool_result=result, expected_answer=answer, entities=tuple(draw.entities),
        later_calls=later,
    )  # fmt: skip


def _declare_chain(
    rng: random.Random, needed: list[str], mixture: Mixture, split: Split
) -> tuple[list[str], str | None]:
    """(declared tools, the needed tool left out or None)."""
    if rng.random() < mixture.no_tools:
        return [], needed[0]
    others = [name for name in TOOLS if name not in needed]
    most = mixture.max_declared_train if split == "train" else mixture.max_declared
    declared = needed + rng.sample(others, rng.randint(0, max(0, most - len(needed))))
    missing = rng.choice(needed) if rng.random() < mixture.missing_tool else None
    declared = [name for name in declared if name != missing]
    rng.shuffle(declared)
    return declared, missing


def _run(step: _Step) -> _Step:
    step.result = execute(step.tool, json.dumps(step.arguments))
    assert not step.result.startswith(ERROR_PREFIX), (step, step.result)
    return step


def _weekday_after(d: Draw) -> _Chain:
    rng = d.rng
    start, days = d.date(), d.number(1, 500)
    before = rng.random() < 0.3
    signed, word = (-days, "before") if before else (days, "after")
    question = rng.choice((
        "What day of the week is {n} days {w} {d}?", "Which weekday is {n} days {w} {d}?",
        "What weekday falls {n} days {w} {d}?",
    )).format(n=days, w=word, d=_spoken(start, rng))  # fmt: skip
    first = _run(_Step(f"First add {signed} days to {start} with add_days, then find the weekday "
                       "of that date with day_of_week.", "add_days",
                       {"date": start, "days": signed}))  # fmt: skip
    second = _run(_Step(f"add_days gave {first.result}. Now find its weekday with day_of_week.",
                        "day_of_week", {"date": first.result}))  # fmt: skip

    def finish(results: list[str]) -> tuple[str, str]:
        return f"{days} days {word} {start} is {results[0]}, a {results[1]}.", results[1]

    return _Chain(question, [first, second], finish)


def _capital_letters(d: Draw) -> _Chain:
    rng = d.rng
    name = d.country().name
    operation = rng.choice(("length", "reverse", "uppercase"))
    question = rng.choice(_CAPITAL_TEXT_ASK[operation]).format(c=name)
    first = _run(_Step(f"First look up the capital of {name} with lookup_country, then use "
                       f"string_tool with {operation} on it.", "lookup_country",
                       {"country": name, "field": "capital"}))  # fmt: skip
    capital = first.result
    second = _run(_Step(f"The capital is {capital}. Now use string_tool with {operation} on "
                        f"'{capital}'.", "string_tool",
                        {"operation": operation, "text": capital}))  # fmt: skip

    def finish(results: list[str]) -> tuple[str, str]:
        r = results[1]
        final = {
            "length": f"The capital of {name} is {capital}, which has {r} letters.",
            "reverse": f"The capital of {name} is {capital}; backwards it is '{r}'.",
            "uppercase": f"The capital of {name} is {capital}; in uppercase it is '{r}'.",
        }
        return final[operation], r

    return _Chain(question, [first, second], finish)


_CAPITAL_TEXT_ASK = {
    "length": ("How many letters are in the capital of {c}?",
               "How long is the name of the capital of {c}?"),
    "reverse": ("Spell the capital of {c} backwards.",
                "What is the capital of {c} written backwards?"),
    "uppercase": ("Write the capital of {c} in uppercase.",
                  "What is the capital of {c} in capital letters?"),
}  # fmt: skip


def _span_in_units(d: Draw) -> _Chain:
    rng = d.rng
    start, end = sorted((d.date(), d.date()))
    unit, operator = rng.choice((("weeks", "/7"), ("hours", "*24")))
    question = rng.choice(("How many {u} are there between {a} and {b}?",
                           "How many {u} from {a} to {b}?")).format(
        u=unit, a=_spoken(start, rng), b=_spoken(end, rng))  # fmt: skip
    first = _run(_Step(f"First count the days from {start} to {end} with days_between, then "
                       f"convert them to {unit} with the calculator.", "days_between",
                       {"start": start, "end": end}))  # fmt: skip
    expression = f"{first.result}{operator}"
    second = _run(_Step(f"There are {first.result} days. Now compute {expression} with the "
                        "calculator.", "calculator", {"expression": expression}))  # fmt: skip

    def finish(results: list[str]) -> tuple[str, str]:
        return (f"There are {results[0]} days from {start} to {end}, which is {results[1]} "
                f"{unit}.", results[1])  # fmt: skip

    return _Chain(question, [first, second], finish)


_CHAINS = (_weekday_after, _capital_letters, _span_in_units)


GENERATORS: dict[str, Callable[[Draw], Task]] = {
    "calculator": _calculator,
    "convert_units": _convert_units,
    "add_days": _add_days,
    "days_between": _days_between,
    "day_of_week": _day_of_week,
    "lookup_country": _lookup_country,
    "string_tool": _string_tool,
    "greeting": _greeting,
    "recall": _recall,
    "writing": _writing,
}
# A tool task from its question and call: the analysis and the final answer around the call.
TOOL_TASKS: dict[str, Callable[[Draw, str, dict[str, Any]], Task]] = {
    "calculator": _calculator_task,
    "convert_units": _convert_units_task,
    "add_days": _add_days_task,
    "days_between": _days_between_task,
    "day_of_week": _day_of_week_task,
    "lookup_country": _lookup_country_task,
    "string_tool": _string_tool_task,
}

# The control-plane task kinds: in CONTROL_MIXTURE and the control split, never in the default.
OPTIONAL_TOOL = "optional_tool"  # answerable with or without its tool (Example.tool_optional)
TWO_CALLS = "two_calls"  # two calls in a row (Example.later_calls)
CONTROL_GENERATORS: dict[str, Callable[[Draw], Task]] = {OPTIONAL_TOOL: _optional_tool}

# Training: the default mixture, 15% of its conversations of the two new kinds, and a quarter of
# all analyses lengthened. Evaluation (control split): about a third of the new kinds. What an
# exit after the plan can cut, counted on the control split's reference conversations (400, the
# bundled tokenizer): the checks are 27 tokens where they appear; at long_analysis 0.25 they are
# 9% of the tokens to answer (84), at 1.0 28% (98). A lever's -30% needs most turns lengthened.
CONTROL_MIXTURE = Mixture(
    weights={**DEFAULT_MIXTURE.weights, OPTIONAL_TOOL: 7, TWO_CALLS: 10}, long_analysis=0.25
)
CONTROL_EVAL_MIXTURE = Mixture(
    weights={**DEFAULT_MIXTURE.weights, OPTIONAL_TOOL: 24, TWO_CALLS: 30}, long_analysis=0.25
)
MIXTURES: dict[str, Mixture] = {"default": DEFAULT_MIXTURE, "control": CONTROL_MIXTURE}


def mixture_named(name: str, long_analysis: float | None = None) -> Mixture:
    """A mixture by name (MIXTURES), with its long_analysis share replaced when given."""
    if name not in MIXTURES:
        raise ValueError(f"unknown mixture {name!r} (available: {', '.join(MIXTURES)})")
    mixture = MIXTURES[name]
    if long_analysis is None:
        return mixture
    if not 0.0 <= long_analysis <= 1.0:
        raise ValueError(f"long_analysis must be in [0, 1], got {long_analysis}")
    return dataclasses.replace(mixture, long_analysis=long_analysis)
