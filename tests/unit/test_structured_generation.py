"""Constrained generation end to end on a random-weight Llama with the bundled vocabulary: the
MaskFiller's bitmask applied to the logits, then noesis.sampling.sampler.sample at temperature 1.
Every output must parse and validate with `jsonschema`."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch

from noesis.sampling.sampler import SamplingTensors, sample
from noesis.structured import GrammarCompiler, GrammarSpec, MaskFiller, apply_token_bitmask_
from noesis.tokenizer import Tokenizer

MODEL_DIR = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
VOCAB = 8192 + 64  # padded, as checkpoints often are
SEEDS = (0, 1, 2, 3)
MAX_NEW_TOKENS = 160
NAME = {"type": "string", "maxLength": 8}

SCHEMAS: list[dict] = [
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "number", "minimum": 0, "maximum": 1},
    {"type": "boolean"},
    {"enum": ["red", "green", "blue", 7, None]},
    {"const": {"version": 2}},
    {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    {"type": "string", "minLength": 2, "maxLength": 6},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "uuid"},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 2,
     "maxItems": 4},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 3},
    {"type": "array", "prefixItems": [{"type": "boolean"}, NAME], "items": False},
    {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0,
     "maximum": 120}}, "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": NAME, "c": {"type": "null"}},
     "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "id": {"type": "integer", "exclusiveMinimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": NAME, "maxItems": 3}},
        "required": ["id", "tags"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 10, "maximum": 20}, NAME]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "null"},
     {"type": "number", "minimum": -1.5, "maximum": 1.5}]}}, "required": ["value"],
     "additionalProperties": False},
    {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
     "temperature": {"type": "number", "minimum": -40, "maximum": 60}},
     "required": ["unit", "temperature"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
     "days": {"type": "integer", "minimum": -365, "maximum": 365}}, "required": ["date", "days"],
     "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 1, "maxItems": 2,
     "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer",
     "minimum": -9, "maximum": 9}}}}, "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": NAME},
     "required": ["ok"], "additionalProperties": False},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
     "maximum": 99}, "y": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["x", "y"], "additionalProperties": False}},
     "type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"email": {"type": "string", "format": "email",
     "maxLength": 20}}, "required": ["email"], "additionalProperties": False},
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(MODEL_DIR)


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler.from_tokenizer(tokenizer, VOCAB)


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def generate(model, compiler, spec: GrammarSpec, seeds=SEEDS) -> list[list[int]]:
    """One constrained sample per seed, batched; a row stops when its grammar is complete."""
    matchers = [compiler.matcher(spec) for _ in seeds]
    outputs: list[list[int]] = [[] for _ in seeds]
    done = [False] * len(seeds)
    token_ids = torch.full((len(seeds), 1), 1)  # <|startoftext|>
    filler = MaskFiller(VOCAB, len(seeds))
    try:
        for step in range(MAX_NEW_TOKENS):
            filler.start([None if d else m for d, m in zip(done, matchers, strict=True)])
            with torch.no_grad():
                logits = model(token_ids).logits[:, -1].float()  # [B, V]
            bitmask = filler.result("cpu")
            next_ids = sample(apply_token_bitmask_(logits, bitmask), tensors(seeds, step)).token_ids
            for row, token in enumerate(next_ids.tolist()):
                if not done[row]:
                    assert matchers[row].accept_token(token), (row, token, outputs[row])
                    outputs[row].append(token)
                    done[row] = matchers[row].is_terminated()
            if all(done):
                return outputs
            token_ids = torch.cat([token_ids, next_ids[:, None]], dim=1)
    finally:
        filler.close()
    raise AssertionError(f"unfinished after {MAX_NEW_TOKENS} tokens: {outputs}")


def tensors(seeds, step: int) -> SamplingTensors:
    batch = len(seeds)
    return SamplingTensors(
        temperature=torch.ones(batch),
        top_k=None,
        top_p=None,
        min_p=None,
        seeds=torch.tensor(seeds, dtype=torch.int64) * 7919 + 11,
        steps=torch.full((batch,), step, dtype=torch.int64),
        all_greedy=False,
    )


def decode(tokenizer, token_ids: list[int]) -> str:
    return tokenizer.decode([t for t in token_ids if t != 0], skip_special_tokens=False)


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "flexible-whitespace"])
def test_constrained_outputs_parse_and_validate(model, compiler, tokenizer, compact):
    assert len(SCHEMAS) >= 20
    schemas = SCHEMAS if compact else SCHEMAS[12:16]  # whitespace runs make a few slower
    distinct = set()
    for schema in schemas:
        validator = jsonschema.Draft202012Validator(
            schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
        )
        spec = GrammarSpec.json_schema(schema, compact=compact)
        for token_ids in generate(model, compiler, spec):
            text = decode(tokenizer, token_ids)
            value = json.loads(text)
            errors = [e.message for e in validator.iter_errors(value)]
            assert not errors, (schema, text, errors)
            distinct.add(text)
    # Sampling at temperature 1 explores: seeds give different outputs.
    assert len(distinct) > len(schemas) * 2
