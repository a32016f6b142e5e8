"""Grammar compiler and matcher (llguidance backend) on the bundled noesis-tiny tokenizer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from noesis.structured import (
    GrammarCompiler,
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    UnsatisfiableSchema,
    UnsupportedSchema,
    allocate_token_bitmask,
)
from noesis.tokenizer import Tokenizer

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
PADDED_VOCAB = 8192 + 40  # a model vocabulary wider than the tokenizer's 8192 ids
POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
    "required": ["x", "y"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler.from_tokenizer(tokenizer, PADDED_VOCAB)


def allowed_ids(matcher, vocab_size=PADDED_VOCAB) -> set[int]:
    bitmask = allocate_token_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    bits = (bitmask[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return set(bits.flatten()[:vocab_size].nonzero().flatten().tolist())


def feed(matcher, tokenizer, text: str) -> bool:
    return all(matcher.accept_token(t) for t in tokenizer.encode(text, add_special_tokens=False))


def test_matcher_follows_the_protocol_and_accepts_a_valid_object(compiler, tokenizer):
    matcher = compiler.matcher(GrammarSpec.json_schema(POINT))
    assert isinstance(matcher, GrammarMatcher)
    assert not matcher.is_accepting()
    assert feed(matcher, tokenizer, '{"x": 1, "y": -20}')
    assert matcher.is_accepting() and matcher.is_terminated()
    end = tokenizer.token_to_id("<|endoftext|>")
    assert allowed_ids(matcher) == {end}  # a complete object takes only the end token
    assert matcher.accept_token(end)


def test_rejected_token_leaves_the_state_unchanged(compiler, tokenizer):
    matcher = compiler.matcher(GrammarSpec.json_schema(POINT))
    assert feed(matcher, tokenizer, '{"x": 1')
    before = allowed_ids(matcher)
    letter = tokenizer.encode("a", add_special_tokens=False)[0]
    assert not matcher.accept_token(letter)
    assert not matcher.accept_token(5)  # <|channel|>: special tokens are never JSON
    assert not matcher.accept_token(PADDED_VOCAB + 3)  # outside the vocabulary
    assert allowed_ids(matcher) == before
    assert feed(matcher, tokenizer, ', "y": 2}') and matcher.is_accepting()


def test_rollback_and_reset_restore_earlier_states(compiler, tokenizer):
    matcher = compiler.matcher(GrammarSpec.json_schema(POINT))
    start = allowed_ids(matcher)
    ids = tokenizer.encode('{"x": 7, "y": 8}', add_special_tokens=False)
    assert all(matcher.accept_token(t) for t in ids[:4])
    middle = allowed_ids(matcher)
    assert all(matcher.accept_token(t) for t in ids[4:])
    matcher.rollback(len(ids) - 4)
    assert allowed_ids(matcher) == middle and not matcher.is_accepting()
    matcher.reset()
    assert allowed_ids(matcher) == start
    with pytest.raises(ValueError, match="roll back"):
        matcher.rollback(3)


def test_padded_vocab_ids_are_never_allowed(compiler):
    matcher = compiler.matcher(GrammarSpec.regex(r"(?s:.*)"))  # any text at all
    allowed = allowed_ids(matcher)
    assert len(allowed) > 8000
    assert not allowed & set(range(8192, PADDED_VOCAB))
    assert not matcher.accept_token(8192 + 5)


def test_compiled_grammars_are_cached_by_spec(compiler):
    spec = GrammarSpec.json_schema(POINT)
    assert compiler.compile(spec) is compiler.compile(GrammarSpec.json_schema(dict(POINT)))
    first, second = compiler.matcher(spec), compiler.matcher(spec)
    assert first.ll_matcher is not second.ll_matcher  # independent states


def test_regex_lark_and_json_object_specs(compiler, tokenizer):
    regex = compiler.matcher(GrammarSpec.regex(r"(yes|no)"))
    assert feed(regex, tokenizer, "yes") and regex.is_accepting()
    assert not compiler.matcher(GrammarSpec.regex(r"(yes|no)")).accept_token(
        tokenizer.encode("maybe", add_special_tokens=False)[0]
    )
    lark = compiler.matcher(GrammarSpec.lark('start: "a" b\nb: "b"+'))
    assert feed(lark, tokenizer, "abbb") and lark.is_accepting()
    json_object = compiler.matcher(GrammarSpec.json_object())
    assert not feed(json_object, tokenizer, "[1]")
    json_object = compiler.matcher(GrammarSpec.json_object())
    assert feed(json_object, tokenizer, '{"any": [1, {"b": null}]}') and json_object.is_accepting()


def test_compact_json_forbids_optional_whitespace(compiler, tokenizer):
    compact = GrammarSpec.json_schema(POINT, compact=True)
    assert feed(compiler.matcher(compact), tokenizer, '{"x":1,"y":2}')
    assert not feed(compiler.matcher(compact), tokenizer, '{"x": 1, "y": 2}')


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "array", "uniqueItems": True}, "uniqueItems"),
        ({"type": "array", "contains": {"type": "integer"}}, "contains"),
        ({"not": {"type": "string"}}, "not"),
        ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if"),
        ({"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired"),
        ({"type": "object", "dependentSchemas": {"a": {}}}, "dependentSchemas"),
        ({"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames"),
        ({"type": "object", "unevaluatedProperties": False}, "unevaluatedProperties"),
        ({"oneOf": [{"type": "integer"}, {"minimum": 2}]}, "oneOf"),
        ({"$ref": "https://example.com/remote.json"}, "$ref"),
        (
            {"type": "object", "patternProperties": {"a.*": {}, ".*b": {"type": "integer"}}},
            "patternProperties",
        ),
    ],
)
def test_unsupported_keywords_fail_at_compile_time_naming_the_keyword(compiler, schema, keyword):
    with pytest.raises(UnsupportedSchema, match=re.escape(keyword)) as caught:
        compiler.compile(GrammarSpec.json_schema(schema))
    assert keyword in caught.value.keywords


def test_unknown_formats_are_annotations_known_ones_are_enforced(compiler, tokenizer):
    """Draft 2020-12: a format llguidance does not know leaves the string unconstrained; one it
    knows still constrains; `not` beside it is still refused; data named "format" is kept."""
    schema = {"type": "object", "properties": {
        "link": {"type": "string", "format": "iri-reference"},
        "day": {"type": "string", "format": "date"},
        "format": {"enum": ["a"]},
    }, "required": ["link", "day", "format"]}  # fmt: skip
    good = '{"link": "no such check", "day": "2024-02-29", "format": "a"}'
    assert feed(compiler.matcher(GrammarSpec.json_schema(schema)), tokenizer, good)
    bad_day = '{"link": "x", "day": "yesterday"'
    assert not feed(compiler.matcher(GrammarSpec.json_schema(schema)), tokenizer, bad_day)
    with pytest.raises(UnsupportedSchema, match="not"):
        compiler.compile(GrammarSpec.json_schema({"format": "x-custom", "not": {"type": "null"}}))


def test_unsupported_keyword_nested_in_a_property_or_a_lark_grammar(compiler):
    nested = {"type": "object", "properties": {"tags": {"type": "array", "uniqueItems": True}}}
    with pytest.raises(UnsupportedSchema, match="uniqueItems"):
        compiler.compile(GrammarSpec.json_schema(nested))
    lark = "start: %json " + json.dumps({"not": {"type": "null"}})
    with pytest.raises(UnsupportedSchema, match="not"):
        compiler.compile(GrammarSpec.lark(lark))


def test_bad_specs_raise_grammar_errors(compiler):
    with pytest.raises(UnsatisfiableSchema):
        compiler.compile(GrammarSpec.json_schema({"enum": []}))
    with pytest.raises(GrammarError, match="regex"):
        compiler.compile(GrammarSpec.regex("(unclosed"))
    with pytest.raises(GrammarError, match="lark"):
        compiler.compile(GrammarSpec.lark("start: undefined_rule"))
    with pytest.raises(GrammarError, match="JSON schema"):
        GrammarSpec.json_schema(["not", "a", "schema"])
    with pytest.raises(GrammarError, match="unknown grammar kind"):
        GrammarSpec("yaml", "a: b")


def test_float_counts_are_integers(compiler, tokenizer):
    matcher = compiler.matcher(GrammarSpec.json_schema({"type": "array", "maxItems": 2.0}))
    assert feed(matcher, tokenizer, "[1, 2")
    assert not feed(matcher, tokenizer, ",")  # a third item would break maxItems
    assert feed(matcher, tokenizer, "]") and matcher.is_accepting()


def test_compiler_from_other_tokenizer_types(tokenizer):
    from tokenizers import Tokenizer as RustTokenizer
    from transformers import PreTrainedTokenizerFast

    rust = RustTokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    fast = PreTrainedTokenizerFast(tokenizer_file=str(MODEL_DIR / "tokenizer.json"))
    for source in (rust, fast):
        compiler = GrammarCompiler.from_tokenizer(source, 8192)
        matcher = compiler.matcher(GrammarSpec.json_schema(POINT))
        assert feed(matcher, tokenizer, '{"x": 3, "y": 4}') and matcher.is_accepting()
    assert rust.padding is None  # the caller's tokenizer is not modified
    with_eos = PreTrainedTokenizerFast(
        tokenizer_file=str(MODEL_DIR / "tokenizer.json"), eos_token="<|endoftext|>"
    )
    assert GrammarCompiler.from_tokenizer(with_eos, 8192).ll_tokenizer.eos_tokens == [0]


def test_harmony_delimiters_are_not_end_tokens(compiler, tokenizer):
    # noesis-tiny's EOS ids are <|return|>, <|call|>, <|endoftext|>: a Harmony turn grammar
    # names the first two, so only <|endoftext|> ends a complete match.
    assert set(tokenizer.eos_token_ids) == {0, 7, 8}
    assert compiler.ll_tokenizer.eos_tokens == [0]


def test_compiler_rejects_bad_inputs(tokenizer):
    with pytest.raises(GrammarError, match="smaller than the tokenizer"):
        GrammarCompiler.from_tokenizer(tokenizer, 100)
    with pytest.raises(GrammarError, match="cannot build a grammar compiler from dict"):
        GrammarCompiler.from_tokenizer({}, 8192)
