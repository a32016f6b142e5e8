"""llguidance behind the GrammarMatcher protocol: one compiler per tokenizer that turns specs into
validated grammars (cached), and the per-request matcher that walks them."""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from copy import copy
from dataclasses import dataclass
from typing import Any

import llguidance
import torch

from noesis.structured.matcher import (
    GrammarError,
    GrammarSpec,
    UnsatisfiableSchema,
    UnsupportedSchema,
)

# Harmony grammars name these tokens, and llguidance never lets a grammar name one of its EOS
# tokens, so they are left out of the default end-of-output set.
HARMONY_DELIMITERS = frozenset({"<|return|>", "<|call|>", "<|end|>"})
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")
# Other llguidance messages that mean "valid schema, but not enforceable here" -> the keyword.
_UNSUPPORTED_MESSAGES = (
    (re.compile(r"Unknown format: "), "format"),
    (re.compile(r"oneOf constraints are not supported"), "oneOf"),
    (re.compile(r"patternProperty regexes .* are not disjoint"), "patternProperties"),
    (re.compile(r"is not present in a registry"), "$ref"),  # remote references
)
_INTEGER_KEYWORDS = frozenset(
    {"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"}
)
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_CACHE_SIZE = 256


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar; `new_matcher` hands out fresh matchers cheaply (deep copies)."""

    spec: GrammarSpec
    template: llguidance.LLMatcher
    vocab_size: int
    end_ids: frozenset[int]

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.template.deep_copy(), self.vocab_size, self.end_ids)


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer and one model vocabulary, caching the results.

    `vocab_size` is the model's logits width; ids from the tokenizer's size up to it are padding
    and are always masked. End tokens (`end_token_ids` of the constructors; by default the
    tokenizer's EOS ids less Harmony's delimiters) may close an output once its grammar is
    complete, and are allowed only then.
    """

    def __init__(self, ll_tokenizer: llguidance.LLTokenizer, vocab_size: int) -> None:
        self.ll_tokenizer = ll_tokenizer
        self.vocab_size = vocab_size
        self._cache: OrderedDict[GrammarSpec, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def from_tokenizer(
        cls, tokenizer: Any, vocab_size: int, end_token_ids: list[int] | None = None
    ) -> GrammarCompiler:
        """From a noesis Tokenizer, a transformers fast tokenizer or a `tokenizers.Tokenizer`."""
        backend, eos_ids = _tokenizer_parts(tokenizer)
        tokenizer_size = backend.get_vocab_size(with_added_tokens=True)
        if vocab_size < tokenizer_size:
            raise GrammarError(
                f"model vocab_size {vocab_size} is smaller than the tokenizer's {tokenizer_size}"
            )
        if end_token_ids is None:
            end_token_ids = _default_end_ids(backend, eos_ids)
        ll_tokenizer = llguidance.LLTokenizer(
            backend.to_str(), n_vocab=vocab_size, eos_token=end_token_ids or None
        )
        return cls(ll_tokenizer, vocab_size)

    @classmethod
    def from_tiktoken(
        cls, encoding: Any, vocab_size: int | None = None, end_token_ids: list[int] | None = None
    ) -> GrammarCompiler:
        """From a tiktoken Encoding (such as noesis.harmony.vocab.o200k_harmony())."""
        from llguidance.tiktoken import lltokenizer_from_encoding

        vocab_size = encoding.n_vocab if vocab_size is None else vocab_size
        if vocab_size < encoding.n_vocab:
            raise GrammarError(
                f"model vocab_size {vocab_size} is smaller than the encoding's {encoding.n_vocab}"
            )
        if end_token_ids is None:
            end_token_ids = [encoding.eot_token]
        ll_tokenizer = lltokenizer_from_encoding(
            encoding, n_vocab=vocab_size, eos_token=end_token_ids
        )
        return cls(ll_tokenizer, vocab_size)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        with self._lock:
            compiled = self._cache.get(spec)
            if compiled is not None:
                self._cache.move_to_end(spec)
                return compiled
        end_ids = frozenset(self.ll_tokenizer.eos_tokens)
        compiled = CompiledGrammar(spec, self._build(spec), self.vocab_size, end_ids)
        with self._lock:
            self._cache[spec] = compiled
            if len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> LLGuidanceMatcher:
        return self.compile(spec).new_matcher()

    def _build(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        grammar = _grammar_text(spec)
        template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if template.is_error():
            raise _compile_error(spec, template.get_error())
        return template


class LLGuidanceMatcher:
    """GrammarMatcher over one llguidance LLMatcher."""

    __slots__ = ("end_ids", "ll_matcher", "vocab_size", "width")

    def __init__(
        self, ll_matcher: llguidance.LLMatcher, vocab_size: int, end_ids: frozenset[int]
    ) -> None:
        self.ll_matcher = ll_matcher
        self.vocab_size = vocab_size
        self.end_ids = end_ids
        self.width = (vocab_size + 31) // 32

    def accept_token(self, token_id: int) -> bool:
        if not 0 <= token_id < self.vocab_size:
            return False
        if self.ll_matcher.is_stopped():
            # A complete match takes only an end token (which validate_tokens refuses here).
            return token_id in self.end_ids and self.ll_matcher.consume_token(token_id)
        # Validate first: consume_token puts the matcher in a permanent error state on a
        # forbidden token.
        if self.ll_matcher.validate_tokens([token_id]) != 1:
            return False
        return self.ll_matcher.consume_token(token_id)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        check_bitmask(bitmask, self.width)
        target = bitmask[row]
        self.ll_matcher.unsafe_compute_mask_ptr(target.data_ptr(), self.width * 4)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0 or not self.ll_matcher.rollback(num_tokens):
            raise ValueError(f"cannot roll back {num_tokens} tokens: {self.ll_matcher.get_error()}")

    def is_terminated(self) -> bool:
        return self.ll_matcher.is_stopped()

    def is_accepting(self) -> bool:
        return self.ll_matcher.is_accepting()

    def reset(self) -> None:
        self.ll_matcher.reset()


def check_bitmask(bitmask: torch.Tensor, width: int) -> None:
    """A bitmask the llguidance fillers can write into: int32 [B, width] contiguous on the CPU."""
    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2:
        raise ValueError(
            f"bitmask must be an int32 CPU tensor [B, {width}], got {bitmask.dtype} "
            f"{tuple(bitmask.shape)} on {bitmask.device}"
        )
    if bitmask.shape[1] != width or not bitmask.is_contiguous():
        raise ValueError(
            f"bitmask must be contiguous with {width} words a row, got {bitmask.shape}"
        )


def _tokenizer_parts(tokenizer: Any) -> tuple[Any, list[int]]:
    """(a copy of the `tokenizers.Tokenizer` without padding or truncation, EOS ids)."""
    from tokenizers import Tokenizer as RustTokenizer

    from noesis.tokenizer import Tokenizer as NoesisTokenizer

    if isinstance(tokenizer, NoesisTokenizer):
        backend, eos = tokenizer.backend, list(tokenizer.eos_token_ids)
    elif isinstance(tokenizer, RustTokenizer):
        backend, eos = tokenizer, []
    elif hasattr(tokenizer, "backend_tokenizer"):  # a transformers fast tokenizer
        backend = tokenizer.backend_tokenizer
        eos_id = tokenizer.eos_token_id
        eos = [] if eos_id is None else [eos_id]
    else:
        raise GrammarError(
            f"cannot build a grammar compiler from {type(tokenizer).__name__}: need a noesis "
            "Tokenizer, a transformers fast tokenizer or a tokenizers.Tokenizer"
        )
    backend = copy(backend)  # padding and truncation are switched off on a copy, not the original
    backend.no_padding()
    backend.no_truncation()
    return backend, eos


def _default_end_ids(backend: Any, eos_ids: list[int]) -> list[int]:
    """EOS ids less Harmony's delimiters; all of them when nothing else is left (a tokenizer
    whose only EOS is <|return|> then cannot serve Harmony turn grammars)."""
    kept = [i for i in eos_ids if backend.id_to_token(i) not in HARMONY_DELIMITERS]
    return kept or eos_ids


def _grammar_text(spec: GrammarSpec) -> str:
    if spec.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    overrides = {"whitespace_flexible": False} if spec.compact_json else None
    try:
        schema = _integral_counts(json.loads(spec.source))
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=overrides)
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from exc


def _integral_counts(schema: Any) -> Any:
    """Counts written as floats (`"maxItems": 2.0`) are integers in JSON Schema; llguidance wants
    ints."""
    if isinstance(schema, list):
        return [_integral_counts(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    fixed = {}
    for key, value in schema.items():
        if key in _INTEGER_KEYWORDS and isinstance(value, float) and value.is_integer():
            value = int(value)
        elif key not in _DATA_KEYWORDS:  # data (const values...) is never rewritten
            value = _integral_counts(value)
        fixed[key] = value
    return fixed


def _compile_error(spec: GrammarSpec, message: str) -> GrammarError:
    first_line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    # Lark grammars can embed schemas (%json), so every kind is checked for schema keywords.
    unimplemented = _UNIMPLEMENTED.search(message)
    if unimplemented:
        keys = tuple(k.strip().strip('"') for k in unimplemented.group(1).split(","))
        return UnsupportedSchema(keys, first_line)
    for pattern, keyword in _UNSUPPORTED_MESSAGES:
        if pattern.search(message):
            return UnsupportedSchema((keyword,), first_line)
    if "Unsatisfiable schema" in message:
        return UnsatisfiableSchema(f"no output can satisfy the schema: {first_line}")
    return GrammarError(f"cannot compile the {spec.kind} grammar: {first_line}")
