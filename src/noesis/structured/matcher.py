"""The grammar-matcher seam: what a constraint looks like to the sampler, the specs that describe
one, and the errors a caller sees when a spec cannot be compiled."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from noesis.errors import InvalidRequest

if TYPE_CHECKING:  # the planner imports specs and the protocol; it must not pull in torch
    import torch

GrammarKind = Literal["json_schema", "json_object", "regex", "lark"]
GRAMMAR_KINDS: tuple[GrammarKind, ...] = ("json_schema", "json_object", "regex", "lark")


class GrammarError(InvalidRequest):
    """A grammar spec cannot be compiled (bad syntax, bad schema, or beyond the engine's limits)."""


class UnsupportedSchema(GrammarError):
    """The JSON schema uses keywords the grammar engine cannot enforce; `keywords` names them."""

    def __init__(self, keywords: tuple[str, ...], detail: str) -> None:
        names = ", ".join(keywords)
        super().__init__(
            f"JSON schema keyword(s) not supported for constrained decoding: {names} ({detail})"
        )
        self.keywords = keywords


class UnsatisfiableSchema(GrammarError):
    """No JSON value satisfies the schema (a `false` schema, an empty enum, ...)."""


class GrammarTooComplex(GrammarError):
    """The grammar is beyond one of the compiler's limits; `limit` names the GrammarLimits field
    (compile_timeout_s, max_grammar_size, max_lexer_states, initial_lexer_fuel, step_lexer_fuel,
    step_max_items or max_items_in_row)."""

    def __init__(self, limit: str, detail: str) -> None:
        super().__init__(f"grammar too complex ({limit}): {detail}")
        self.limit = limit


@dataclass(frozen=True)
class GrammarSpec:
    """What to enforce. `source` is text (schema as JSON, regex, Lark) so specs hash as cache keys.

    `compact_json` forbids optional whitespace in JSON (items joined by "," and keys by ":").
    """

    kind: GrammarKind
    source: str
    compact_json: bool = False

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; supported: {GRAMMAR_KINDS}")

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool, compact: bool = False) -> GrammarSpec:
        if not isinstance(schema, dict | bool):
            raise GrammarError(f"a JSON schema must be an object or a boolean, not {schema!r}")
        # Key order is kept: the grammar writes object properties in schema order.
        return cls("json_schema", json.dumps(schema), compact)

    @classmethod
    def json_object(cls, compact: bool = False) -> GrammarSpec:
        return cls("json_object", '{"type": "object"}', compact)

    @classmethod
    def regex(cls, pattern: str) -> GrammarSpec:
        """A regex in Rust `regex` syntax, matched against the whole output."""
        if not pattern:
            raise GrammarError("empty regex")
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> GrammarSpec:
        if not grammar.strip():
            raise GrammarError("empty Lark grammar")
        return cls("lark", grammar)

    @property
    def schema(self) -> Any:
        """The JSON schema of a json_schema / json_object spec."""
        assert self.kind in ("json_schema", "json_object"), self.kind
        return json.loads(self.source)


@runtime_checkable
class GrammarMatcher(Protocol):
    """One request's constraint state, advanced token by token.

    The bitmask is int32 [B, ceil(V / 32)]: bit `t % 32` of word `t // 32` set means token t is
    allowed. Ids past the tokenizer's vocabulary (model padding) are never allowed.
    """

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False (state unchanged) when the grammar forbids it."""
        ...

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (a contiguous int32 CPU tensor)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (rejected speculative tokens)."""
        ...

    def is_terminated(self) -> bool:
        """True when no further token can be accepted (the output is complete)."""
        ...

    def is_accepting(self) -> bool:
        """True when the tokens so far form a complete match, so generation may stop here."""
        ...

    def reset(self) -> None:
        """Back to the initial state, as if no token had been accepted."""
        ...

    def error(self) -> str | None:
        """Why the matcher broke down for good (a limit hit while matching), None while sound.
        A token the grammar merely forbids is not an error."""
        ...
