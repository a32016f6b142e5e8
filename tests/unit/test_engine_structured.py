"""Grammars through the engine: constrained rows share batches with free ones, outputs validate,
free rows are untouched, bad schemas are refused at add time, Harmony turns parse."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from noesis import LLM, SamplingParams
from noesis.structured import GrammarSpec, UnsupportedSchema

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "tags": {"type": "array", "items": {"type": "string",
                                                                         "maxLength": 6},
                                               "maxItems": 3}},
     "required": ["ok", "tags"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 9}, {"const": "none"}]},
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(str(BUNDLED), device="cpu", dtype="float32", progress=False)


def test_constrained_and_free_requests_share_batches(llm):
    prompt = llm.tokenizer.encode("Give me data:", add_special_tokens=False)
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = llm.generate([prompt], free)[0]
    params = [free] + [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=96,
                       grammar=GrammarSpec.json_schema(schema, compact=True))
        for schema in SCHEMAS for seed in range(3)
    ]
    outputs = llm.generate([prompt] * len(params), params)
    assert outputs[0].token_ids == alone.token_ids  # a free row is untouched by its neighbours
    for schema_index, out in enumerate(outputs[1:]):
        schema = SCHEMAS[schema_index // 3]
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


def test_regex_and_lark_grammars(llm):
    prompt = llm.tokenizer.encode("Date:", add_special_tokens=False)
    date = GrammarSpec.regex(r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])")
    lark = GrammarSpec.lark('start: "yes" | "no" | "maybe"')
    outs = llm.generate([prompt] * 4, [
        SamplingParams(temperature=1.0, seed=s, max_tokens=20, grammar=g)
        for s, g in enumerate([date, date, lark, lark])
    ])
    import re

    assert all(re.fullmatch(r"20\d\d-\d\d-\d\d", o.text) for o in outs[:2]), outs
    assert all(o.text in ("yes", "no", "maybe") for o in outs[2:]), outs


def test_an_unsupported_schema_is_refused_when_added(llm):
    bad = GrammarSpec.json_schema({"type": "object", "not": {"required": ["a"]}})
    with pytest.raises(UnsupportedSchema, match="not"):
        llm.generate(["x"], SamplingParams(max_tokens=4, grammar=bad))
    assert not llm.engine.has_unfinished()  # nothing was left behind


def test_generate_turn_forces_a_named_tool_with_valid_arguments(llm):
    from noesis.tools.builtin import builtin_tools

    registry = builtin_tools(["calculator", "convert_units"])
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in registry.schemas()}
    named = {"type": "function", "function": {"name": "convert_units"}}
    turn = llm.generate_turn([{"role": "user", "content": "What is 17 times 23?"}],
                             registry.schemas(), tool_choice=named, deterministic=True)
    (call,) = turn.tool_calls
    assert call.name == "convert_units" and turn.finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.arguments), schemas["convert_units"])


def test_a_failed_step_leaves_constrained_decoding_usable(llm, monkeypatch):
    """A forward that raises mid-step (with a grammar mask being filled) must not wedge the
    mask filler: the next constrained request still runs."""
    grammar = GrammarSpec.lark('start: "yes" | "no"')
    runner = llm.engine.runner
    real = runner.forward_eager

    def broken(plan, previous=None):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(runner, "forward_eager", broken)
    (failed,) = llm.generate(["Answer:"], SamplingParams(max_tokens=4, grammar=grammar))
    assert failed.finish_reason == "error" and "injected failure" in failed.error
    monkeypatch.setattr(runner, "forward_eager", real)
    out = llm.generate(["Answer:"], SamplingParams(max_tokens=4, grammar=grammar))[0]
    assert out.text in ("yes", "no")


def test_a_cancelled_turn_is_aborted_and_says_so(llm):
    import threading

    cancel = threading.Event()
    cancel.set()
    turn = llm.generate_turn([{"role": "user", "content": "Hello!"}], cancel=cancel)
    assert turn.finish_reason == "cancelled" and turn.completion_tokens == 0
    assert not llm.engine.has_unfinished()
