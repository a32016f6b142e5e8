"""noesis.tools registry: schemas from type hints and docstrings, argument validation, the
built-in tool adapter."""

from __future__ import annotations

import functools
import json
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

from noesis.tiny import harmony
from noesis.tiny import tools as tiny_tools
from noesis.tools import (
    InvalidToolArguments,
    Tool,
    ToolDefinitionError,
    ToolExecutor,
    ToolRegistry,
    UnknownTool,
    tool,
)
from noesis.tools.builtin import builtin_tools
from noesis.tools.docstrings import parse_docstring


class Point(BaseModel):
    x: float
    y: float


@tool
def weather(
    city: str,
    units: Literal["celsius", "fahrenheit"] = "celsius",
    days: Annotated[int, Field(ge=1, le=7, description="Days ahead, 1 to 7.")] = 1,
    title: str = "",
) -> str:
    """Get the forecast for a city.

    The forecast comes from a made-up table.

    Args:
        city (str): The city name,
            in English.
        units: Temperature units.
        days: This line loses to the Annotated description.

    Returns:
        A sentence.
    """
    return f"{city}: sunny for {days} days in {units}{title}"


def parameters(item: Tool) -> dict:
    return item.schema()["function"]["parameters"]


def test_schema_from_type_hints_and_google_docstring():
    schema = weather.schema()
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "weather"
    assert schema["function"]["description"] == "Get the forecast for a city."
    params = parameters(weather)
    assert params["type"] == "object"
    assert params["required"] == ["city"]
    assert params["additionalProperties"] is False
    props = params["properties"]
    assert props["city"] == {"type": "string", "description": "The city name, in English."}
    assert props["units"]["enum"] == ["celsius", "fahrenheit"]
    assert props["units"]["default"] == "celsius"
    assert props["units"]["description"] == "Temperature units."
    assert props["days"]["description"] == "Days ahead, 1 to 7."
    assert (props["days"]["minimum"], props["days"]["maximum"]) == (1, 7)
    # A parameter named "title" survives the removal of pydantic's generated titles.
    assert props["title"] == {"type": "string", "default": ""}
    assert "title" not in json.dumps({k: v for k, v in params.items() if k != "properties"})


def test_schema_renders_as_harmony_tool_declaration():
    text = harmony.render([{"role": "user", "content": "hi"}], [weather.schema()], True)
    assert "type weather = (_: {" in text
    assert "// The city name, in English.\ncity: string," in text
    assert 'units?: "celsius" | "fahrenheit", // default: celsius' in text


def test_numpy_docstring_and_nested_model():
    def distance(a: Point, b: Point, scale: float = 1.0) -> float:
        """Euclidean distance between two points.

        Parameters
        ----------
        a, b : Point
            The two points.
        scale : float
            Multiplies the result.

        Returns
        -------
        float
        """
        return scale * ((a.x - b.x) ** 2 + (a.y - b.y) ** 2) ** 0.5

    item = ToolRegistry().register(distance)
    props = parameters(item)["properties"]
    assert item.description == "Euclidean distance between two points."
    assert props["a"]["description"] == "The two points."
    assert props["scale"] == {
        "type": "number",
        "default": 1.0,
        "description": "Multiplies the result.",
    }
    assert props["a"]["$ref"] == "#/$defs/Point"
    assert parameters(item)["$defs"]["Point"]["required"] == ["x", "y"]
    kwargs = item.parse_arguments('{"a": {"x": 0, "y": 0}, "b": {"x": 3, "y": 4}}')
    assert isinstance(kwargs["a"], Point) and item(**kwargs) == 5.0


def test_parse_docstring_sections():
    doc = parse_docstring(
        """Summary line one
        and two.

        Args:
            x: First.
            *rest: Others,
                continued.

        Raises:
            ValueError: never.
        """
    )
    assert doc.summary == "Summary line one and two."
    assert doc.params == {"x": "First.", "rest": "Others, continued."}
    assert parse_docstring(None).summary == ""
    assert parse_docstring("\n    Args:\n        y: Only args.\n    ").params == {"y": "Only args."}


def test_decorator_forms_and_direct_call():
    @tool(name="shout", description="Upper-cases text.")
    async def loud(text: str) -> str:
        return text.upper()

    assert isinstance(loud, Tool) and loud.name == "shout" and loud.is_async
    assert loud.description == "Upper-cases text."
    assert not weather.is_async
    assert weather("Oslo") == "Oslo: sunny for 1 days in celsius"


def test_parse_arguments_validates_with_pydantic():
    assert weather.parse_arguments('{"city": "Oslo", "days": "3"}') == {
        "city": "Oslo",
        "units": "celsius",
        "days": 3,
        "title": "",
    }
    assert weather.parse_arguments({"city": "Rome", "units": "fahrenheit"})["units"] == "fahrenheit"


@pytest.mark.parametrize(
    ("arguments", "fields", "words"),
    [
        ('{"units": "celsius"}', ("city",), "city: Field required"),
        ('{"city": "Oslo", "days": 9}', ("days",), "days: Input should be less than or equal to 7"),
        ('{"city": "Oslo", "units": "kelvin"}', ("units",), "units: Input should be 'celsius'"),
        ('{"city": "Oslo", "wind": true}', ("wind",), "wind: Extra inputs are not permitted"),
        ('{"city": 3}', ("city",), "city: Input should be a valid string"),
        ('{"city": "Oslo"', (), "Invalid JSON"),
        ("[1, 2]", (), "Input should be an object"),
    ],
)
def test_bad_arguments_name_the_field(arguments, fields, words):
    with pytest.raises(InvalidToolArguments) as info:
        weather.parse_arguments(arguments)
    assert info.value.fields == fields
    assert words in str(info.value)


def test_no_argument_tool_accepts_empty_arguments():
    def now() -> str:
        """The time."""
        return "noon"

    item = ToolRegistry([now]).get("now")
    assert parameters(item)["properties"] == {}
    assert item.parse_arguments("") == {} and item.parse_arguments("{}") == {}


def test_parameter_names_that_shadow_pydantic_are_fine():
    def lookup(schema: str, json: int, model_config: bool = False) -> str:
        """Looks up."""
        return f"{schema}{json}{model_config}"

    item = ToolRegistry([lookup]).get("lookup")
    assert sorted(parameters(item)["properties"]) == ["json", "model_config", "schema"]
    assert item(**item.parse_arguments('{"schema": "s", "json": 2}')) == "s2False"


def test_bad_definitions_raise_named_errors():
    def untyped(x):
        return x

    def variadic(*values: int) -> int:
        return sum(values)

    def keywords(**options: str) -> str:
        return ""

    with pytest.raises(ToolDefinitionError, match="'x' of tool 'untyped' has no type hint"):
        tool(untyped)
    with pytest.raises(ToolDefinitionError, match=r"\*args"):
        tool(variadic)
    with pytest.raises(ToolDefinitionError, match=r"\*args"):
        tool(keywords)
    with pytest.raises(ToolDefinitionError, match="lambda"):
        tool(lambda: 1)
    assert tool(lambda: 1, name="one").name == "one"
    with pytest.raises(ToolDefinitionError, match="callable"):
        tool(3)


def test_registry_rejects_duplicates_and_lists_what_it_has():
    def add(a: int, b: int) -> int:
        """Adds."""
        return a + b

    registry = ToolRegistry([weather, add])
    assert registry.names == ["weather", "add"] and len(registry) == 2 and "add" in registry
    assert [s["function"]["name"] for s in registry.schemas()] == ["weather", "add"]
    with pytest.raises(ToolDefinitionError, match="'add' is already registered"):
        registry.register(add)
    with pytest.raises(UnknownTool, match="'sub'.*registered: weather, add"):
        registry.get("sub")
    assert registry.find("sub") is None


def test_registry_of_normalizes_the_tools_argument():
    registry = ToolRegistry([weather])
    assert ToolRegistry.of(registry) is registry
    assert len(ToolRegistry.of(None)) == 0
    assert ToolRegistry.of([weather.function]).names == ["weather"]
    with pytest.raises(ToolDefinitionError, match="list"):
        ToolRegistry.of(weather)


def test_builtin_tools_keep_their_schemas():
    registry = builtin_tools()
    assert registry.names == list(tiny_tools.TOOLS)
    assert registry.schemas() == tiny_tools.schemas(list(tiny_tools.TOOLS))
    assert builtin_tools(["calculator"]).names == ["calculator"]
    with pytest.raises(UnknownTool, match="abacus"):
        builtin_tools(["abacus"])


BUILTIN_CASES = [
    ("calculator", '{"expression": "17*23"}'),
    ("calculator", '{"expression": "1/0"}'),
    ("calculator", '{"expression": ""}'),
    ("calculator", '{"expr": "1"}'),
    ("calculator", "not json"),
    ("convert_units", '{"value": 5, "from_unit": "kilometer", "to_unit": "mile"}'),
    ("convert_units", '{"value": 5, "from_unit": "kilometer", "to_unit": "gram"}'),
    ("convert_units", '{"value": "5", "from_unit": "kilometer", "to_unit": "mile"}'),
    ("add_days", '{"date": "2024-02-27", "days": 3}'),
    ("add_days", '{"date": "2024-02-30", "days": 3}'),
    ("days_between", '{"start": "2024-01-01", "end": "2024-03-01"}'),
    ("day_of_week", '{"date": "2024-07-04"}'),
    ("lookup_country", '{"country": "France", "field": "capital"}'),
    ("lookup_country", '{"country": "Atlantis", "field": "capital"}'),
    ("string_tool", '{"operation": "count_letter", "text": "banana", "letter": "a"}'),
    ("string_tool", '{"operation": "count_letter", "text": "banana"}'),
]


def test_builtin_tools_through_the_executor_match_tiny_execute():
    calls = [
        {"id": f"call_{i}", "name": name, "arguments": arguments}
        for i, (name, arguments) in enumerate(BUILTIN_CASES)
    ]
    results = ToolExecutor(builtin_tools()).run(calls)
    expected = [tiny_tools.execute(name, arguments) for name, arguments in BUILTIN_CASES]
    assert [r.content for r in results] == expected
    assert [r.ok for r in results] == [not e.startswith("error: ") for e in expected]
    assert results[0].content == "391" and results[1].error == "tool_error"
    assert results[3].error == "invalid_arguments"


def test_builtin_argument_errors_name_fields():
    item = builtin_tools().get("add_days")
    with pytest.raises(InvalidToolArguments) as info:
        item.parse_arguments('{"date": "soon", "extra": 1}')
    assert info.value.fields == ("days", "date", "extra")


def test_methods_partials_and_callable_objects_become_tools():
    class Counter:
        """Counts calls."""

        def __init__(self) -> None:
            self.count = 0

        def bump(self, by: int = 1) -> int:
            """Adds to the count."""
            self.count += by
            return self.count

        async def __call__(self, text: str) -> str:
            return text[::-1]

    counter = Counter()
    registry = ToolRegistry()
    bump = registry.register(counter.bump)
    assert (
        list(parameters(bump)["properties"]) == ["by"] and bump.description == "Adds to the count."
    )
    assert bump(**bump.parse_arguments('{"by": 2}')) == 2
    reverse = registry.register(counter, name="reverse")
    assert reverse.is_async and reverse.description == "Counts calls."
    assert list(parameters(reverse)["properties"]) == ["text"]
    scaled = registry.register(functools.partial(weather.function, units="fahrenheit"), name="f")
    assert parameters(scaled)["properties"]["units"]["default"] == "fahrenheit"
