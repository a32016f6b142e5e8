"""The built-in tools (calculator, convert_units, dates, a country table, strings) as registry
Tools, with the schemas, checks and error messages noesis-tiny was trained on.

Every tool is plain Python with no side effects. Inputs the model controls are bounded before any
work is done (expression length and depth, exponents, magnitudes, finite numbers), so no call burns
CPU or memory; the executor still runs the arithmetic ones (ISOLATED) in a worker process it can
kill. `execute` runs one in-process for data generation (the training corpus, expected answers):
the result, or "error: ..." for bad input, never an exception.
"""

from __future__ import annotations

import ast
import datetime as dt
import json
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from noesis.tiny.lexicon import REAL_COUNTRIES, country_table
from noesis.tools.executor import ERROR_PREFIX
from noesis.tools.registry import InvalidToolArguments, Tool, ToolError, ToolRegistry, UnknownTool

# Tools doing arithmetic on numbers the model chose run in a worker process the executor can
# kill. Their inputs are bounded (below), so this is a second wall, not the first.
ISOLATED = ("calculator", "convert_units")
# Field names in the validator's messages: "arguments.days ...", "lacks required 'date'".
_FIELD = re.compile(r"arguments\.(\w+)|required '(\w+)'|unexpected '(\w+)'")


def builtin_tools(names: Iterable[str] | None = None) -> ToolRegistry:
    """A registry of the named built-in tools (all of them by default), in the order given."""
    names = list(TOOLS) if names is None else list(names)
    unknown = [name for name in names if name not in TOOLS]
    if unknown:
        raise UnknownTool(f"unknown built-in tools {unknown} (built-in: {', '.join(TOOLS)})")
    return ToolRegistry(TOOLS[name] for name in names)


def schemas(names: list[str] | tuple[str, ...]) -> list[dict[str, Any]]:
    """The OpenAI declarations of the named built-in tools."""
    return [TOOLS[name].schema() for name in names]


def execute(name: str, arguments_json: str) -> str:
    """Run built-in tool `name` in this process on a JSON arguments string; returns the result or
    an "error: ..." string worded as the executor words it."""
    tool = TOOLS.get(name) if isinstance(name, str) else None
    if tool is None:
        return f"{ERROR_PREFIX}unknown tool {name!r} (known: {', '.join(TOOLS)})"
    try:
        return tool.function(**tool.parse_arguments(arguments_json))
    except (InvalidToolArguments, ToolError) as exc:
        return f"{ERROR_PREFIX}{exc}"
    except Exception as exc:  # a bug or an input no bound foresaw: still a result, never a crash
        return f"{ERROR_PREFIX}tool {name!r} failed: {type(exc).__name__}: {exc}"


def parse_arguments(arguments_json: str | bytes) -> Any:
    """The JSON value of a call's arguments; ToolError (worded as the model was trained to read
    it) for text that is not JSON, is nested too deeply or holds an integer too long to read."""
    try:
        return json.loads(arguments_json)
    except RecursionError:
        raise ToolError("arguments are not valid JSON (nested too deeply)") from None
    except (ValueError, TypeError) as exc:  # JSONDecodeError is a ValueError, as is a huge int
        raise ToolError(f"arguments are not valid JSON ({exc})") from None


# ---------------------------------------------------------------- schema validation


_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
}


def validate(schema: dict[str, Any], value: Any, path: str = "arguments") -> list[str]:
    """Check `value` against the subset of JSON Schema the tools use; returns the problems found."""
    kind = schema.get("type")
    if kind is not None and not _JSON_TYPES[kind](value):
        return [f"{path} must be of type {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{path} must be one of {', '.join(map(str, schema['enum']))}"]
    if kind == "object":
        return _validate_object(schema, value, path)
    if kind == "array":
        item_schema = schema.get("items", {})
        return [
            p for i, item in enumerate(value) for p in validate(item_schema, item, f"{path}[{i}]")
        ]
    return _validate_scalar(schema, value, path)


def _validate_object(schema: dict[str, Any], value: dict[str, Any], path: str) -> list[str]:
    properties = schema.get("properties", {})
    problems = [
        f"{path} lacks required {key!r}" for key in schema.get("required", []) if key not in value
    ]
    for key, item in value.items():
        if key in properties:
            problems += validate(properties[key], item, f"{path}.{key}")
        elif schema.get("additionalProperties", True) is False:
            problems.append(f"{path} has unexpected {key!r}")
    return problems


def _validate_scalar(schema: dict[str, Any], value: Any, path: str) -> list[str]:
    problems = []
    if isinstance(value, str):
        if len(value) < schema.get("minLength", 0):
            problems.append(f"{path} is shorter than {schema['minLength']}")
        if len(value) > schema.get("maxLength", len(value)):
            problems.append(f"{path} is longer than {schema['maxLength']}")
        if "pattern" in schema and not re.fullmatch(schema["pattern"], value):
            problems.append(f"{path} does not match {schema['pattern']}")
    elif _JSON_TYPES["number"](value):
        if isinstance(value, float) and not math.isfinite(value):
            return [f"{path} must be a finite number, got {value}"]  # JSON's NaN and Infinity
        if "minimum" in schema and value < schema["minimum"]:
            problems.append(f"{path} is below {schema['minimum']}")
        if "maximum" in schema and value > schema["maximum"]:
            problems.append(f"{path} is above {schema['maximum']}")
    return problems


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": False,
    }


# ---------------------------------------------------------------- calculator


_BINARY_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPRESSION_CHARS = 200
MAX_EXPRESSION_DEPTH = 100  # nested operations; 200 characters allow at most ~100 binary ones
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e15
# A power whose result would have more digits than this is refused before it is computed, so no
# int power grows huge and no float power overflows. The digit of slack over MAX_MAGNITUDE keeps
# the estimate (a float log) from refusing a result that fits; the exact range check follows.
_MAX_POWER_DIGITS = math.log10(MAX_MAGNITUDE) + 1


def format_number(value: float) -> str:
    """Integers without a decimal point, other values to at most 6 decimals."""
    if float(value).is_integer() and abs(value) < MAX_MAGNITUDE:
        return str(int(value))
    text = f"{value:.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def calculate(expression: str) -> float:
    """Evaluate + - * / // % ** and parentheses over numbers, without eval()."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolError(f"expression is longer than {MAX_EXPRESSION_CHARS} characters")
    if "'" in expression or '"' in expression:
        # Never arithmetic, and parsing a string literal can print warnings (invalid escapes).
        raise ToolError("unsupported element in expression: a string")
    normalized = expression.replace("×", "*").replace("÷", "/").replace("^", "**")
    try:
        tree = ast.parse(normalized.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:  # ValueError: NUL bytes
        raise ToolError(f"cannot parse expression {expression!r}") from exc
    if _depth(tree.body) > MAX_EXPRESSION_DEPTH:
        raise ToolError(f"expression is nested deeper than {MAX_EXPRESSION_DEPTH} operations")
    return _evaluate(tree.body)


def _depth(root: ast.AST) -> int:
    """How deeply operations nest, counted without recursion (the tree may be deep)."""
    deepest, stack = 0, [(root, 1)]
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        stack += [(child, depth + 1) for child in ast.iter_child_nodes(node)]
    return deepest


def _evaluate(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and _JSON_TYPES["number"](node.value):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise ToolError("number is out of range")  # 1e999 parses as inf
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            result = _BINARY_OPS[type(node.op)](left, right)
        except ZeroDivisionError as exc:
            raise ToolError("division by zero") from exc
        except OverflowError as exc:  # float arithmetic past 1.8e308, int / int too large
            raise ToolError("result is out of range") from exc
        return _in_range(result)
    raise ToolError(f"unsupported element in expression: {type(node).__name__}")


def _check_power(base: float, exponent: float) -> None:
    """Refuse a power before computing it when the exponent or the result would be too big."""
    if abs(exponent) > MAX_EXPONENT:
        raise ToolError("exponent is too large")
    if base != 0 and exponent * math.log10(abs(base)) > _MAX_POWER_DIGITS:
        raise ToolError("result is out of range")


def _in_range(result: Any) -> float:
    # Compare before any float(): an int result may be too large to convert.
    if isinstance(result, complex) or not abs(result) <= MAX_MAGNITUDE:  # `not <=`: NaN too
        raise ToolError("result is out of range")
    return result


def _run_calculator(args: dict[str, Any]) -> str:
    return format_number(calculate(args["expression"]))


# ---------------------------------------------------------------- unit conversion


@dataclass(frozen=True)
class Unit:
    name: str
    plural: str
    dimension: str
    factor: float  # to the dimension's base unit (temperature: handled apart)


UNITS: dict[str, Unit] = {
    u.name: u
    for u in (
        Unit("kilometer", "kilometers", "length", 1000.0),
        Unit("meter", "meters", "length", 1.0),
        Unit("centimeter", "centimeters", "length", 0.01),
        Unit("mile", "miles", "length", 1609.344),
        Unit("foot", "feet", "length", 0.3048),
        Unit("inch", "inches", "length", 0.0254),
        Unit("kilogram", "kilograms", "mass", 1.0),
        Unit("gram", "grams", "mass", 0.001),
        Unit("pound", "pounds", "mass", 0.45359237),
        Unit("ounce", "ounces", "mass", 0.028349523125),
        Unit("liter", "liters", "volume", 1.0),
        Unit("milliliter", "milliliters", "volume", 0.001),
        Unit("gallon", "gallons", "volume", 3.785411784),
        Unit("celsius", "degrees Celsius", "temperature", 1.0),
        Unit("fahrenheit", "degrees Fahrenheit", "temperature", 1.0),
        Unit("kelvin", "kelvins", "temperature", 1.0),
    )
}


def convert(value: float, source: Unit, target: Unit) -> float:
    if source.dimension != target.dimension:
        raise ToolError(f"cannot convert {source.name} to {target.name}")
    if source.dimension == "temperature":
        return _from_kelvin(_to_kelvin(value, source.name), target.name)
    return value * source.factor / target.factor


def _to_kelvin(value: float, unit: str) -> float:
    celsius = {"celsius": value, "fahrenheit": (value - 32) * 5 / 9, "kelvin": value - 273.15}[unit]
    return celsius + 273.15


def _from_kelvin(kelvin: float, unit: str) -> float:
    celsius = kelvin - 273.15
    return {"celsius": celsius, "fahrenheit": celsius * 9 / 5 + 32, "kelvin": kelvin}[unit]


def round_quantity(value: float) -> str:
    return format_number(round(value, 2))


def _run_convert(args: dict[str, Any]) -> str:
    source, target = UNITS[args["from_unit"]], UNITS[args["to_unit"]]
    if not abs(args["value"]) <= MAX_MAGNITUDE:  # `not <=` refuses NaN as well
        raise ToolError(f"value is out of range (at most {MAX_MAGNITUDE:g} in magnitude)")
    result = convert(args["value"], source, target)
    return (
        f"{format_number(args['value'])} {source.plural} = {round_quantity(result)} {target.plural}"
    )


# ---------------------------------------------------------------- dates


DATE_PATTERN = r"\d{4}-\d{2}-\d{2}"
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def parse_date(text: str) -> dt.date:
    try:
        return dt.date.fromisoformat(text)
    except ValueError as exc:
        raise ToolError(f"{text!r} is not a valid date (YYYY-MM-DD)") from exc


def _run_add_days(args: dict[str, Any]) -> str:
    try:
        return (parse_date(args["date"]) + dt.timedelta(days=args["days"])).isoformat()
    except OverflowError as exc:
        raise ToolError("resulting date is out of range") from exc


def _run_days_between(args: dict[str, Any]) -> str:
    return str((parse_date(args["end"]) - parse_date(args["start"])).days)


def _run_day_of_week(args: dict[str, Any]) -> str:
    return WEEKDAYS[parse_date(args["date"]).weekday()]


# ---------------------------------------------------------------- country table


COUNTRY_FIELDS = ("capital", "population", "currency")


def _run_lookup(args: dict[str, Any]) -> str:
    country = country_table().get(args["country"].strip().lower())
    if country is None:
        raise ToolError(f"unknown country {args['country']!r}")
    value = getattr(country, args["field"])
    return f"{value:,}" if isinstance(value, int) else value


# ---------------------------------------------------------------- strings


STRING_OPERATIONS = ("reverse", "uppercase", "lowercase", "length", "count_letter")


def _run_string(args: dict[str, Any]) -> str:
    text, operation = args["text"], args["operation"]
    if operation == "count_letter":
        letter = args.get("letter", "")
        if len(letter) != 1:
            raise ToolError("count_letter needs 'letter', a single character")
        return str(text.lower().count(letter.lower()))
    results = {
        "reverse": lambda: text[::-1],
        "uppercase": text.upper,
        "lowercase": text.lower,
        "length": lambda: str(len(text)),
    }
    return results[operation]()


# ---------------------------------------------------------------- as registry Tools


def _builtin(
    name: str, description: str, parameters: dict[str, Any], run: Callable[[dict], str]
) -> Tool:
    return Tool(
        name=name,
        description=description,
        parameters=parameters,
        function=_Runner(run),
        parse_arguments=_SchemaArguments(parameters),
        is_async=False,
        isolated=name in ISOLATED,
    )


@dataclass(frozen=True)
class _SchemaArguments:
    """JSON parsing and the schema validator above, worded as the model was trained to read."""

    parameters: dict[str, Any]

    def __call__(self, arguments: str | Mapping[str, Any] | None) -> dict[str, Any]:
        if isinstance(arguments, Mapping):
            value: Any = dict(arguments)
        else:
            try:
                value = parse_arguments(arguments)  # type: ignore[arg-type]
            except ToolError as exc:
                raise InvalidToolArguments(str(exc)) from None
        problems = validate(self.parameters, value)
        if problems:
            raise InvalidToolArguments("; ".join(problems), _named_fields(problems))
        return value


def _named_fields(problems: list[str]) -> tuple[str, ...]:
    found = (m for problem in problems for m in _FIELD.finditer(problem))
    return tuple(dict.fromkeys(next(g for g in m.groups() if g) for m in found))


@dataclass(frozen=True)
class _Runner:
    """Calls a tool's `run(dict)` with the keyword arguments (picklable: isolated tools)."""

    run: Callable[[dict[str, Any]], str]

    def __call__(self, **arguments: Any) -> str:
        return self.run(arguments)


# ---------------------------------------------------------------- the table


def _string(description: str, **extra: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **extra}


_DATE = {"pattern": DATE_PATTERN}
# Decoding-only (noesis.structured.grounding): the text and the country are copied from the user's
# words, the country preferably one of the table's real ones. The model's declaration ignores
# x-noesis-* keys, so the prompt it reads is unchanged. (The 20,000 fictional countries are not
# listed: building them costs most of a second; a fictional name is still a span of the request.)
_GROUNDED = {"x-noesis-grounded": True}
_COUNTRY_GROUNDING = {"x-noesis-grounded": {"prefer": [row[0] for row in REAL_COUNTRIES]}}

TOOLS: dict[str, Tool] = {
    tool.name: tool
    for tool in (
        _builtin(
            "calculator",
            "Evaluates an arithmetic expression with + - * / % ** and parentheses.",
            _object(
                {"expression": _string("The expression, e.g. (2+3)*4", minLength=1)}, ["expression"]
            ),
            _run_calculator,
        ),
        _builtin(
            "convert_units",
            "Converts a quantity between units of length, mass, volume or temperature.",
            _object(
                {
                    "value": {"type": "number", "description": "The quantity to convert"},
                    "from_unit": _string("The unit of the value", enum=list(UNITS)),
                    "to_unit": _string("The unit to convert to", enum=list(UNITS)),
                },
                ["value", "from_unit", "to_unit"],
            ),
            _run_convert,
        ),
        _builtin(
            "add_days",
            "Adds a number of days (negative to go back) to a date and returns the new date.",
            _object(
                {
                    "date": _string("The start date, YYYY-MM-DD", **_DATE),
                    "days": {"type": "integer", "description": "Days to add"},
                },
                ["date", "days"],
            ),
            _run_add_days,
        ),
        _builtin(
            "days_between",
            "Counts the days from one date to another.",
            _object(
                {
                    "start": _string("The first date, YYYY-MM-DD", **_DATE),
                    "end": _string("The second date, YYYY-MM-DD", **_DATE),
                },
                ["start", "end"],
            ),
            _run_days_between,
        ),
        _builtin(
            "day_of_week",
            "Returns the weekday of a date.",
            _object({"date": _string("The date, YYYY-MM-DD", **_DATE)}, ["date"]),
            _run_day_of_week,
        ),
        _builtin(
            "lookup_country",
            "Looks up the capital, population or currency of a country in the built-in table.",
            _object(
                {
                    "country": _string("The country name", minLength=1, **_COUNTRY_GROUNDING),
                    "field": _string("What to look up", enum=list(COUNTRY_FIELDS)),
                },
                ["country", "field"],
            ),
            _run_lookup,
        ),
        _builtin(
            "string_tool",
            "Reverses, changes the case of, measures or counts letters in a text.",
            _object(
                {
                    "operation": _string("What to do", enum=list(STRING_OPERATIONS)),
                    "text": _string("The text to work on", **_GROUNDED),
                    "letter": _string("The letter to count (count_letter only)"),
                },
                ["operation", "text"],
            ),
            _run_string,
        ),
    )
}

# All seven tools in the order the bundled model uses best when it is given every one: it was
# trained with at most four declared and tends to overlook the first ones, so the tools it is asked
# for most come last. Greedy, grounded, on 11 tool questions (at least one per tool): 7 right calls,
# against 4 with calculator, convert_units, day_of_week, lookup_country alone; the TOOLS order
# loses the calculator ("What is 17 times 23?"). The string tool is overlooked in this order.
DECLARATION_ORDER = (
    "string_tool",
    "add_days",
    "days_between",
    "calculator",
    "convert_units",
    "day_of_week",
    "lookup_country",
)
