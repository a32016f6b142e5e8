"""Harmony turn grammar: the bundled model's gold turns pass; tool syntax in a final, bad
arguments and calls that tool_choice forbids do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from noesis.structured import GrammarCompiler, GrammarError, UnsupportedSchema
from noesis.structured.harmony_grammar import harmony_turn_spec
from noesis.tiny import corpus, harmony
from noesis.tiny.tools import schemas
from noesis.tokenizer import Tokenizer

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
TOOLS = schemas(["calculator", "lookup_country", "add_days"])
CALC = "<|channel|>commentary to=functions.calculator <|constrain|>json<|message|>"
LOOKUP = "<|channel|>commentary to=functions.lookup_country <|constrain|>json<|message|>"
ANALYSIS = "<|channel|>analysis<|message|>The user wants a calculation.<|end|><|start|>assistant"
FINAL = "<|channel|>final<|message|>"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler.from_tokenizer(tokenizer, 8192)


def accepts(compiler, tokenizer, text: str, **options) -> bool:
    """Every token of `text` accepted in turn, ending in a complete turn."""
    matcher = compiler.matcher(harmony_turn_spec(**options))
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(t) for t in token_ids) and matcher.is_accepting()


def gold_turns(example: corpus.Example) -> list[str]:
    """What the model should write after each `<|start|>assistant` of the example's answer."""
    turns = []
    for index in range(len(example.prompt_messages), len(example.messages)):
        if example.messages[index]["role"] != "assistant":
            continue
        prompt = harmony.render(example.messages[:index], example.tools, True)
        full = harmony.render(example.messages[: index + 1], example.tools)
        assert full.startswith(prompt)
        turns.append(full[len(prompt) :])
    return turns


def test_every_gold_turn_of_the_corpus_is_accepted(compiler, tokenizer):
    examples = corpus.generate(0, "train", 250) + corpus.generate(0, "heldout", 100)
    checked = {"call": 0, "final": 0}
    for example in examples:
        for turn in gold_turns(example):
            matcher = compiler.matcher(harmony_turn_spec(example.tools))
            token_ids = tokenizer.encode(turn, add_special_tokens=False)
            for position, token in enumerate(token_ids):
                assert matcher.accept_token(token), (example.id, turn, position)
            assert matcher.is_accepting() and matcher.is_terminated(), (example.id, turn)
            checked["call" if turn.endswith("<|call|>") else "final"] += 1
    assert checked["call"] > 100 and checked["final"] > 300, checked


def test_valid_turn_shapes(compiler, tokenizer):
    call = CALC + '{"expression":"2+3"}<|call|>'
    assert accepts(compiler, tokenizer, call, tools=TOOLS)
    assert accepts(compiler, tokenizer, ANALYSIS + call, tools=TOOLS)
    assert accepts(
        compiler, tokenizer, ANALYSIS + ANALYSIS + FINAL + "It is 5.<|return|>", tools=TOOLS
    )
    assert accepts(compiler, tokenizer, FINAL + "Hello!<|return|>")  # no tools at all
    assert not accepts(compiler, tokenizer, FINAL + "Hello!")  # unfinished
    assert not accepts(compiler, tokenizer, FINAL + "Hello!<|end|>")  # a final closes with return


@pytest.mark.parametrize(
    "final_text",
    [
        "Let me call it.<|call|>",
        "Sure<|start|>assistant" + CALC + '{"expression":"1"}<|call|>',
        'Sure to=functions.calculator {"expression":"1"}',
        "Spelled out <|call|> markers",
        "<|constrain|>json",
    ],
)
def test_final_cannot_contain_tool_syntax(compiler, tokenizer, final_text):
    assert not accepts(compiler, tokenizer, FINAL + final_text + "<|return|>", tools=TOOLS)


def test_final_text_spelled_out_special_markers_are_rejected(compiler, tokenizer):
    matcher = compiler.matcher(harmony_turn_spec(TOOLS))
    assert all(matcher.accept_token(t) for t in tokenizer.encode(FINAL + "a", False))
    spelled = [tokenizer.token_to_id("<"), tokenizer.token_to_id("|")]
    assert matcher.accept_token(spelled[0]) and not matcher.accept_token(spelled[1])


@pytest.mark.parametrize(
    "arguments",
    [
        '{"expression":5}',  # wrong type
        "{}",  # missing required
        '{"expression":"1+1","extra":true}',  # additionalProperties false
        '{"expression":""}',  # minLength 1
        '{"expression":"1+1"',  # unterminated
    ],
)
def test_schema_violating_arguments_are_rejected(compiler, tokenizer, arguments):
    assert not accepts(compiler, tokenizer, CALC + arguments + "<|call|>", tools=TOOLS)


def test_arguments_follow_each_tools_own_schema(compiler, tokenizer):
    lookup_ok = LOOKUP + '{"country":"Peru","field":"capital"}<|call|>'
    lookup_bad = LOOKUP + '{"country":"Peru","field":"anthem"}<|call|>'
    assert accepts(compiler, tokenizer, lookup_ok, tools=TOOLS)
    assert not accepts(compiler, tokenizer, lookup_bad, tools=TOOLS)
    undeclared = "<|channel|>commentary to=functions.day_of_week <|constrain|>json<|message|>"
    assert not accepts(
        compiler, tokenizer, undeclared + '{"date":"2020-01-01"}<|call|>', tools=TOOLS
    )


def test_tool_choice_none_required_and_named(compiler, tokenizer):
    call = ANALYSIS + CALC + '{"expression":"2*4"}<|call|>'
    final = ANALYSIS + FINAL + "Eight.<|return|>"
    lookup = LOOKUP + '{"country":"Chad","field":"currency"}<|call|>'
    assert accepts(compiler, tokenizer, call, tools=TOOLS, tool_choice="auto")
    assert accepts(compiler, tokenizer, final, tools=TOOLS, tool_choice="auto")
    assert not accepts(compiler, tokenizer, call, tools=TOOLS, tool_choice="none")
    assert accepts(compiler, tokenizer, final, tools=TOOLS, tool_choice="none")
    assert accepts(compiler, tokenizer, call, tools=TOOLS, tool_choice="required")
    assert not accepts(compiler, tokenizer, final, tools=TOOLS, tool_choice="required")
    named = {"type": "function", "function": {"name": "lookup_country"}}
    assert accepts(compiler, tokenizer, lookup, tools=TOOLS, tool_choice=named)
    assert not accepts(compiler, tokenizer, call, tools=TOOLS, tool_choice=named)
    assert not accepts(compiler, tokenizer, final, tools=TOOLS, tool_choice=named)


def test_response_format_constrains_the_final(compiler, tokenizer):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "integer"}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    json_schema = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    assert accepts(
        compiler,
        tokenizer,
        FINAL + '{"answer":8}<|return|>',
        tools=TOOLS,
        response_format=json_schema,
    )
    # compact JSON: no optional whitespace, which a model could otherwise repeat without end
    assert not accepts(
        compiler,
        tokenizer,
        FINAL + '{"answer": 8}<|return|>',
        tools=TOOLS,
        response_format=json_schema,
    )
    assert not accepts(
        compiler,
        tokenizer,
        FINAL + '{"answer": "8"}<|return|>',
        tools=TOOLS,
        response_format=json_schema,
    )
    assert not accepts(
        compiler, tokenizer, FINAL + "Eight.<|return|>", response_format={"type": "json_object"}
    )
    assert accepts(
        compiler,
        tokenizer,
        ANALYSIS + FINAL + '{"x":[1]}<|return|>',
        response_format={"type": "json_object"},
    )
    # A tool call is still allowed under auto, with its own schema.
    assert accepts(
        compiler,
        tokenizer,
        CALC + '{"expression":"8"}<|call|>',
        tools=TOOLS,
        response_format=json_schema,
    )


def test_bad_options_raise(compiler):
    with pytest.raises(GrammarError, match="required.*needs at least one tool"):
        harmony_turn_spec([], tool_choice="required")
    with pytest.raises(GrammarError, match="not among the tools"):
        harmony_turn_spec(TOOLS, {"type": "function", "function": {"name": "nope"}})
    with pytest.raises(GrammarError, match="tool_choice must be"):
        harmony_turn_spec(TOOLS, "sometimes")
    with pytest.raises(GrammarError, match="invalid name"):
        harmony_turn_spec([{"type": "function", "function": {"name": "a b"}}])
    with pytest.raises(GrammarError, match="declared twice"):
        harmony_turn_spec(TOOLS + TOOLS[:1])
    with pytest.raises(GrammarError, match="response_format type"):
        harmony_turn_spec(TOOLS, response_format={"type": "xml"})
    unsupported = [
        {
            "type": "function",
            "function": {"name": "tagger", "parameters": {"type": "array", "uniqueItems": True}},
        }
    ]
    with pytest.raises(UnsupportedSchema, match="uniqueItems"):
        compiler.compile(harmony_turn_spec(unsupported))


def test_turn_grammar_on_the_o200k_harmony_vocabulary():
    """The same grammar over gpt-oss's vocabulary, whose Harmony specials sit near 200k."""
    pytest.importorskip("tiktoken")
    vocab = pytest.importorskip("noesis.harmony.vocab")
    try:
        encoding = vocab.o200k_harmony()
    except vocab.VocabularyMissing as exc:
        pytest.skip(str(exc))
    compiler = GrammarCompiler.from_tiktoken(encoding, 201_088 + 1)
    spec = harmony_turn_spec(TOOLS)
    call = ANALYSIS + LOOKUP + '{"country":"Peru","field":"capital"}<|call|>'
    for text, expected in [
        (call, True),
        (FINAL + "Lima.<|return|>", True),
        (FINAL + "x<|call|>", False),
        (CALC + '{"expression":1}<|call|>', False),
    ]:
        matcher = compiler.matcher(spec)
        token_ids = encoding.encode(text, allowed_special="all")
        accepted = all(matcher.accept_token(t) for t in token_ids) and matcher.is_accepting()
        assert accepted == expected, text


def test_response_format_is_read_once_for_every_path():
    from noesis.structured.harmony_grammar import response_format_schema

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert response_format_schema(None) is None
    assert response_format_schema({"type": "text"}) is None
    assert response_format_schema({"type": "json_object"}) == {"type": "object"}
    wrapped = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    assert response_format_schema(wrapped) == schema
    as_text = {"type": "json_schema", "json_schema": {"schema": '{"type": "object"}'}}
    assert response_format_schema(as_text) == {"type": "object"}
    for bad, message in [
        ({}, "with a 'type'"),
        ({"type": "yaml"}, "response_format type must be"),
        ({"type": "json_schema"}, "needs"),
        ({"type": "json_schema", "json_schema": {"schema": "{oops"}}, "not valid JSON"),
        ({"type": "json_schema", "json_schema": {"schema": [1]}}, "must be a JSON object"),
    ]:
        with pytest.raises(GrammarError, match=message):
            response_format_schema(bad)
