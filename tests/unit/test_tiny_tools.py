"""noesis.tiny.tools: real results, schema checks, and errors instead of exceptions."""

import json

import pytest

from noesis.tiny.lexicon import REAL_COUNTRIES, countries_in, country_table
from noesis.tiny.tools import TOOLS, calculate, execute, format_number, schemas, validate


def call(name: str, **arguments) -> str:
    return execute(name, json.dumps(arguments))


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("17*23", "391"),
        ("(5+8)*3", "39"),
        ("2+3*4", "14"),
        ("10/4", "2.5"),
        ("100/7", "14.285714"),
        ("-3+5", "2"),
        ("2**10", "1024"),
        ("240*15/100", "36"),
        ("7 × 6", "42"),
        ("2^3", "8"),
    ],
)
def test_calculator(expression, expected):
    assert call("calculator", expression=expression) == expected


@pytest.mark.parametrize(
    "expression",
    ["__import__('os').system('true')", "x+1", "1/0", "2**1000", "9**9**9", "(1", "", "True+1"],
)
def test_calculator_refuses_without_raising(expression):
    assert call("calculator", expression=expression).startswith("error: ")


def test_calculate_never_uses_names():
    with pytest.raises(Exception, match="unsupported"):
        calculate("abs(-1)")


def test_format_number():
    assert [format_number(v) for v in (3.0, 2.50, 1 / 3, -0.0000001)] == [
        "3",
        "2.5",
        "0.333333",
        "0",
    ]


def test_convert_units():
    assert call("convert_units", value=5, from_unit="kilometer", to_unit="mile") == (
        "5 kilometers = 3.11 miles"
    )
    assert call("convert_units", value=100, from_unit="celsius", to_unit="fahrenheit") == (
        "100 degrees Celsius = 212 degrees Fahrenheit"
    )
    assert call("convert_units", value=1, from_unit="kilogram", to_unit="mile").startswith("error")


def test_dates():
    assert call("add_days", date="2024-02-27", days=3) == "2024-03-01"
    assert call("add_days", date="2024-03-01", days=-1) == "2024-02-29"
    assert call("days_between", start="2024-01-01", end="2024-03-01") == "60"
    assert call("day_of_week", date="2000-01-01") == "Saturday"
    assert call("day_of_week", date="2023-02-30").startswith("error")
    assert call("add_days", date="9999-12-31", days=1).startswith("error")


def test_lookup_country_reads_the_table():
    assert call("lookup_country", country="france", field="capital") == "Paris"
    fictional = countries_in("heldout")[0]
    population = call("lookup_country", country=fictional.name, field="population")
    assert population == f"{fictional.population:,}"
    assert call("lookup_country", country="Nowhereland", field="capital").startswith("error")


def test_country_table_is_big_and_split():
    table = country_table()
    assert len(table) == len(REAL_COUNTRIES) + 20_000
    assert len(countries_in("heldout")) >= 3000
    capitals = [c.capital.lower() for c in table.values()]
    assert len(set(capitals)) == len(capitals) and not set(capitals) & set(table)


def test_string_tool():
    assert call("string_tool", operation="reverse", text="lantern") == "nretnal"
    assert call("string_tool", operation="uppercase", text="garden") == "GARDEN"
    assert call("string_tool", operation="length", text="blossom") == "7"
    assert call("string_tool", operation="count_letter", text="Blossom", letter="s") == "2"
    assert call("string_tool", operation="count_letter", text="abc").startswith("error")


@pytest.mark.parametrize(
    ("name", "arguments", "problem"),
    [
        ("calculator", "{not json", "not valid JSON"),
        ("calculator", "[1, 2]", "must be of type object"),
        ("calculator", "{}", "lacks required 'expression'"),
        ("calculator", '{"expression": 5}', "must be of type string"),
        ("calculator", '{"expression": "1", "x": 1}', "unexpected 'x'"),
        ("add_days", '{"date": "2024-01-01", "days": 1.5}', "must be of type integer"),
        ("add_days", '{"date": "01/02/2024", "days": 1}', "does not match"),
        ("lookup_country", '{"country": "France", "field": "mayor"}', "must be one of"),
        ("send_email", "{}", "unknown tool"),
    ],
)
def test_execute_reports_bad_calls(name, arguments, problem):
    result = execute(name, arguments)
    assert result.startswith("error: ") and problem in result


def test_schemas_are_openai_function_tools():
    for schema in schemas(list(TOOLS)):
        function = schema["function"]
        assert schema["type"] == "function"
        assert set(function) == {"name", "description", "parameters"}
        assert function["parameters"]["type"] == "object"
        assert set(function["parameters"]["required"]) <= set(function["parameters"]["properties"])


def test_validate_accepts_good_arguments():
    parameters = TOOLS["convert_units"].parameters
    assert validate(parameters, {"value": 2.5, "from_unit": "meter", "to_unit": "foot"}) == []
    assert validate(parameters, {"value": True, "from_unit": "meter", "to_unit": "foot"})
