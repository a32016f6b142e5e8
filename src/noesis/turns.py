"""Assistant turns for Harmony models: render the conversation, constrain sampling to a valid turn
(free analysis, schema-valid tool arguments, a final without tool syntax), parse what came out.

Used by `LLM.generate_turn` (and so `Session`) and by the server's chat endpoint with `tools` or
`response_format`. Models without Harmony tokens get `response_format` as a grammar over the
whole reply and no tool calls.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from noesis.errors import InvalidRequest
from noesis.harmony.encoding import HarmonyEncoding, UnsupportedTokenizer
from noesis.harmony.parser import ParsedTurn, parse_completion
from noesis.sampling.params import SamplingParams
from noesis.structured.harmony_grammar import harmony_turn_spec
from noesis.structured.matcher import GrammarSpec

ToolChoice = str | dict[str, Any]


def harmony_encoding(tokenizer) -> HarmonyEncoding | None:
    """The tokenizer's Harmony view, or None when it has no Harmony special tokens."""
    try:
        return HarmonyEncoding.from_tokenizer(tokenizer)
    except UnsupportedTokenizer:
        return None


def response_format_spec(response_format: dict[str, Any] | None) -> GrammarSpec | None:
    """OpenAI `response_format` -> a grammar over the reply (None for text)."""
    kind = _format_kind(response_format)
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object(compact=True)
    return GrammarSpec.json_schema(_format_schema(response_format), compact=True)


def turn_params(
    params: SamplingParams,
    encoding: HarmonyEncoding | None,
    tools: list[dict[str, Any]] | None,
    tool_choice: ToolChoice,
    response_format: dict[str, Any] | None,
    constrained: bool = True,
) -> SamplingParams:
    """`params` set up for one assistant turn: special tokens kept in the output (the parser
    reads them), stops at <|return|>/<|call|>, and the turn grammar when `constrained`."""
    if encoding is None:
        if tools or tool_choice not in ("none", None):
            raise InvalidRequest(
                "tools need a model whose chat format has tool-call syntax noesis can enforce "
                "(Harmony special tokens); this model's tokenizer has none"
            )
        grammar = response_format_spec(response_format) if constrained else None
        return dataclasses.replace(params, grammar=grammar)
    _format_kind(response_format)  # validate even when unconstrained
    grammar = harmony_turn_spec(tools, tool_choice, response_format) if constrained else None
    actions = encoding.stop_tokens_for_assistant_actions()
    stops = tuple(dict.fromkeys(params.stop_token_ids + actions))
    return dataclasses.replace(
        params, grammar=grammar, skip_special_tokens=False, stop_token_ids=stops
    )


def parse_turn(encoding: HarmonyEncoding, token_ids: list[int]) -> ParsedTurn:
    """The generated ids of a turn (the prompt ended with `<|start|>assistant`)."""
    return parse_completion(encoding, token_ids)


def _format_kind(response_format: dict[str, Any] | None) -> str:
    if response_format is None:
        return "text"
    if not isinstance(response_format, dict) or "type" not in response_format:
        raise InvalidRequest("response_format must be an object with a 'type'")
    kind = response_format["type"]
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequest(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}"
        )
    if kind == "json_schema":
        _format_schema(response_format)
    return kind


def _format_schema(response_format: dict[str, Any]) -> dict[str, Any] | bool:
    wrapper = response_format.get("json_schema")
    if not isinstance(wrapper, dict) or "schema" not in wrapper:
        raise InvalidRequest("response_format json_schema needs {'json_schema': {'schema': {...}}}")
    schema = wrapper["schema"]
    if isinstance(schema, str):  # some clients send the schema as JSON text
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(f"response_format schema is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict | bool):
        raise InvalidRequest("response_format json_schema.schema must be a JSON object")
    return schema
