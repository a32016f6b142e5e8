"""TurnFormat: one model's way of writing an assistant turn, whichever its family: the messages
its template reads, the SamplingParams that constrain a turn, and the parser that reads one.
Harmony models go through noesis.harmony; the others through a text dialect."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from noesis.dialects.grammar import ThinkMode, TurnOptions, dialect_turn_spec
from noesis.dialects.parser import TextTurnParser, TokenTurnParser, parse_events
from noesis.dialects.spec import (
    HARMONY,
    THINK_CLOSE,
    THINK_OPEN,
    Dialect,
    detect,
    dialect_named,
    thinks,
)
from noesis.errors import InvalidRequest
from noesis.harmony.encoding import HarmonyEncoding, UnsupportedTokenizer
from noesis.harmony.parser import HarmonyStreamParser, ParsedTurn
from noesis.harmony.parser import parse_completion as parse_harmony
from noesis.sampling.params import SamplingParams
from noesis.structured.harmony_grammar import response_format_schema
from noesis.tokenizer import Tokenizer

_PROMPT_TAIL_TOKENS = 8  # enough of the prompt's end to see an opened or closed <think>
NO_TOOL_SYNTAX = (
    "tools need a model whose chat format has tool-call syntax noesis can enforce, and this "
    "model's template shows none it knows; name the format with --tool-dialect (or "
    "LLM(tool_dialect=...)): one of hermes, llama3_json, mistral, harmony"
)


@dataclass(frozen=True)
class TurnFormat:
    """How `tokenizer`'s model writes turns. `dialect` is None for Harmony (`harmony` set)."""

    tokenizer: Tokenizer
    dialect: Dialect | None
    harmony: HarmonyEncoding | None = None
    thinks: bool = False

    @classmethod
    def of(cls, tokenizer: Tokenizer, name: str | None = None) -> TurnFormat | None:
        """The model's format, detected from its template and vocabulary, or the dialect
        `name` (noesis.dialects.spec.NAMES); None when it has no tool or reasoning syntax."""
        harmony = _harmony(tokenizer)
        vocabulary = tokenizer.backend.get_vocab(with_added_tokens=True)
        if name is not None:
            dialect = dialect_named(name)
            if dialect is None and harmony is None:
                raise UnsupportedTokenizer("--tool-dialect harmony needs Harmony special tokens")
        elif harmony is not None:
            dialect = None
        else:
            dialect = detect(tokenizer.chat_template, vocabulary)
        reasons = thinks(tokenizer.chat_template, vocabulary)
        if dialect is None and harmony is None:
            if not reasons:
                return None
            dialect = dialect_named("plain")
        return cls(tokenizer, dialect, harmony if dialect is None else None, reasons)

    @classmethod
    def plain(cls, tokenizer: Tokenizer) -> TurnFormat:
        """Turns of a model with neither tool nor reasoning syntax: the reply is the answer."""
        return cls(tokenizer, dialect_named("plain"))

    @property
    def name(self) -> str:
        return HARMONY if self.dialect is None else self.dialect.name

    @property
    def has_calls(self) -> bool:
        return self.dialect is None or self.dialect.has_calls

    @property
    def ends_at_final(self) -> bool:
        """Whether a turn is over once its final answer closes (Harmony), not only at EOS."""
        return self.dialect is None

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.dialect is None:
            return messages
        return self.dialect.template_messages(messages)

    def think_mode(self, prompt: list[int]) -> ThinkMode:
        """Whether the reply to `prompt` may reason, must finish reasoning the prompt opened
        (DeepSeek-R1 style), or may not (enable_thinking=False wrote an empty block)."""
        if not self.thinks or self.dialect is None:
            return "off"
        tail = self.tokenizer.decode(prompt[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
        tail = tail.rstrip()
        if tail.endswith(THINK_OPEN):
            return "open"
        return "off" if tail.endswith(THINK_CLOSE) else "optional"

    def stream_parser(self, prompt: list[int]):
        """A fresh parser of the reply to `prompt`: feed(token_id), feed_all, finish."""
        if self.dialect is None:
            return HarmonyStreamParser(self.harmony)
        mode = self.think_mode(prompt)
        text = TextTurnParser(self.dialect, self.thinks, in_think=mode == "open")
        return TokenTurnParser(self.tokenizer, text, self._end_ids())

    def parse(self, token_ids: list[int], prompt: list[int]) -> ParsedTurn:
        if self.dialect is None:
            return parse_harmony(self.harmony, token_ids)
        return parse_events(self.stream_parser(prompt), token_ids)

    def params(
        self,
        base: SamplingParams,
        prompt: list[int],
        tools: list[dict[str, Any]] | None,
        options: TurnOptions,
        constrained: bool = True,
    ) -> SamplingParams:
        """`base` set up for one turn: special tokens kept (the parser reads the markers) and,
        when `constrained`, the turn grammar."""
        if self.dialect is None:
            from noesis.turns import turn_params

            return turn_params(base, self.harmony, tools, options.tool_choice,
                               options.response_format, constrained, options.messages)  # fmt: skip
        if tools and options.tool_choice != "none" and not self.dialect.has_calls:
            raise InvalidRequest(NO_TOOL_SYNTAX)
        response_format_schema(options.response_format)  # validated even when unconstrained
        options = dataclasses.replace(options, think=self.think_mode(prompt))
        grammar = dialect_turn_spec(self.dialect, self.grammar_token, tools, options)
        if not (constrained and _needs_grammar(tools, options)):
            grammar = None  # still built above: a bad tool_choice or schema is an error anyway
        return dataclasses.replace(base, grammar=grammar, skip_special_tokens=False)

    def grammar_token(self, marker: str) -> str:
        """A marker as a lark term: its token where the vocabulary has it whole, else text."""
        token_id = self.tokenizer.token_to_id(marker)
        if token_id is not None:
            return f"<[{token_id}]>"
        return '"' + marker.replace("\\", "\\\\").replace('"', '\\"') + '"'

    def _end_ids(self) -> set[int]:
        ids = set(self.tokenizer.eos_token_ids)
        eos = self.tokenizer.eos_token
        eos_id = self.tokenizer.token_to_id(eos) if eos else None
        return ids | ({eos_id} if eos_id is not None else set())


def _needs_grammar(tools: list[dict[str, Any]] | None, options: TurnOptions) -> bool:
    """A plain chat (no tools, no response_format, no thinking budget) samples freely: the
    parser reads what comes, and the mask would cost every step for nothing."""
    return (
        bool(tools)
        or response_format_schema(options.response_format) is not None
        or (options.thinking_budget is not None and options.think != "off")
    )


def _harmony(tokenizer: Tokenizer) -> HarmonyEncoding | None:
    try:
        return HarmonyEncoding.from_tokenizer(tokenizer)
    except UnsupportedTokenizer:
        return None
