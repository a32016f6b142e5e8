"""Assistant turns for Harmony models: render the conversation, constrain sampling to a valid turn
(free analysis, schema-valid tool arguments, a final without tool syntax), parse what came out.

Reached through noesis.dialects.TurnFormat, which sends the other families to their text dialect;
models with neither get `response_format` as a grammar over the whole reply and no tool calls.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from noesis.errors import InvalidRequest
from noesis.harmony.encoding import HarmonyEncoding, UnsupportedTokenizer
from noesis.sampling.params import SamplingParams
from noesis.structured.harmony_grammar import harmony_turn_spec, response_format_schema
from noesis.structured.matcher import GrammarSpec

ToolChoice = str | dict[str, Any]


def harmony_encoding(tokenizer) -> HarmonyEncoding | None:
    """The tokenizer's Harmony view, or None when it has no Harmony special tokens."""
    try:
        return HarmonyEncoding.from_tokenizer(tokenizer)
    except UnsupportedTokenizer:
        return None


def new_call_id() -> str:
    """A tool call's id, in OpenAI's shape."""
    return f"call_{uuid.uuid4().hex[:24]}"


def response_format_spec(response_format: dict[str, Any] | None) -> GrammarSpec | None:
    """OpenAI `response_format` -> a grammar over the whole reply (None for text)."""
    schema = response_format_schema(response_format)
    return None if schema is None else GrammarSpec.json_schema(schema, compact=True)


def turn_params(
    params: SamplingParams,
    encoding: HarmonyEncoding | None,
    tools: list[dict[str, Any]] | None,
    tool_choice: ToolChoice,
    response_format: dict[str, Any] | None,
    constrained: bool = True,
    messages: list[dict[str, Any]] | None = None,
) -> SamplingParams:
    """`params` set up for one assistant turn: special tokens kept in the output (the parser
    reads them), stops at <|return|>/<|call|>, and the turn grammar when `constrained`.
    `messages`, the conversation the turn answers, lets grounded arguments (`x-noesis-grounded`)
    copy only the user's words; without it they decode as their plain schema."""
    if encoding is None:
        if tools or tool_choice not in ("none", None):
            raise InvalidRequest(
                "tools need a model whose chat format has tool-call syntax noesis can enforce "
                "(Harmony special tokens, or a dialect: --tool-dialect); this model has none"
            )
        grammar = response_format_spec(response_format) if constrained else None
        return dataclasses.replace(params, grammar=grammar)
    response_format_schema(response_format)  # validated even when unconstrained
    grammar = (
        harmony_turn_spec(tools, tool_choice, response_format, messages) if constrained else None
    )
    actions = encoding.stop_tokens_for_assistant_actions()
    stops = tuple(dict.fromkeys(params.stop_token_ids + actions))
    return dataclasses.replace(
        params, grammar=grammar, skip_special_tokens=False, stop_token_ids=stops
    )
