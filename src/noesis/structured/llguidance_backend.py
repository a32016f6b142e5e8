"""llguidance behind the GrammarMatcher protocol: one compiler per tokenizer that turns specs into
validated grammars (on worker threads, within limits, cached), and the per-request matcher that
walks them."""

from __future__ import annotations

import functools
import json
import re
from concurrent.futures import Future
from copy import copy
from dataclasses import dataclass, fields
from typing import Any

import llguidance
import torch

from noesis.structured.grammar_pool import CompilePool, GrammarCache
from noesis.structured.matcher import (
    GrammarError,
    GrammarSpec,
    GrammarTooComplex,
    UnsatisfiableSchema,
    UnsupportedSchema,
)

# Harmony grammars name these tokens, and llguidance never lets a grammar name one of its EOS
# tokens, so they are left out of the default end-of-output set.
HARMONY_DELIMITERS = frozenset({"<|return|>", "<|call|>", "<|end|>"})
_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")
# Other llguidance messages that mean "valid schema, but not enforceable here" -> the keyword.
_UNSUPPORTED_MESSAGES = (
    (re.compile(r"Unknown format: "), "format"),  # in a schema a Lark grammar embeds (%json)
    (re.compile(r"oneOf constraints are not supported"), "oneOf"),
    (re.compile(r"patternProperty regexes .* are not disjoint"), "patternProperties"),
    (re.compile(r"is not present in a registry"), "$ref"),  # remote references
)
# llguidance's messages when a resource limit is hit -> the GrammarLimits field. Fuel messages
# name the initial fuel while the grammar is built and the step fuel while a mask is computed.
_LIMIT_MESSAGES = (
    ("grammar size (number of symbols) too big", "max_grammar_size"),
    ("initial lexer configuration (grammar) too big", "initial_lexer_fuel"),
    ("lexer precomputation failed", "initial_lexer_fuel"),
    ("too many states", "max_lexer_states"),
    ("Too many items (limit", "step_max_items"),
    ("items; max is", "max_items_in_row"),
    ("too many expressions constructed", "step_lexer_fuel"),
    ("fuel exhausted", "step_lexer_fuel"),
)
_LIMIT_MEANINGS = {
    "max_grammar_size": "symbols",
    "initial_lexer_fuel": "units of work (fuel) to build its lexer",
    "max_lexer_states": "lexer states (about 1-2 kB of memory each)",
    "step_lexer_fuel": "units of lexer work (fuel) for one token's mask",
    "step_max_items": "parser items for one token's mask",
    "max_items_in_row": "alternatives open at one point (about 4 per optional property of an "
    "object)",
}
_INTEGER_KEYWORDS = frozenset(
    {"minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties"}
)
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# A count that may be written as a float: only then is the schema parsed and rewritten, since
# parsing holds the GIL (~40 ms for 9,000 properties) while the engine loop waits for it.
_FLOAT_COUNT = re.compile(rf'"(?:{"|".join(sorted(_INTEGER_KEYWORDS))})"\s*:\s*-?[0-9]+[.eE]')
# A `format` keyword with a string value (a property named "format" has an object value).
_FORMAT_VALUE = re.compile(r'"format"\s*:\s*"')
# How many tokens the first mask allows that the compile probe steps through (see _probe).
_PROBE_TOKENS = 3
# The estimated memory of a compiled grammar (llguidance does not report it): a fixed part plus
# a part per byte of llguidance grammar text. Calibrated on heap growth (glibc mallinfo2, one
# thread) over building the matcher and its first mask, llguidance 1.9.1, on both the 8k
# noesis-tiny and the 201k o200k vocabularies (nearly equal): 40-175 KiB for the smallest
# grammars; per text byte ~27 (enums), 35-55 (patterns), 58-70 (required properties), 75-150
# (optional properties; 9,000 of them: 278 kB of text, 33 MB at the peak, 21 MB kept).
# test_grammar_pool checks the estimate against heap growth measured in the test.
# Not counted: lexer states a grammar adds while requests decode (shared by its matchers; a
# random walk over the Harmony turn grammar added 0.5 MB on 8k and 1.8 MB on 201k tokens),
# bounded per grammar by max_lexer_states.
_FIXED_BYTES = 256 << 10
_BYTES_PER_GRAMMAR_BYTE = 160


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on compiling one grammar and on each of its mask steps, and the compiler's pool
    and cache. A grammar over a bound is refused with GrammarTooComplex naming the field.

    Per compile:
    - `compile_timeout_s` (10 s): wall clock from the moment a worker starts the compile.
    - `max_grammar_size` (25,000 symbols; llguidance's default is 500,000): an object of ~6,000
      required string properties (OpenAI allows 5,000 in a schema). It also bounds the time
      freeing a grammar takes, with the GIL held: ~35 ms at this size, ~100 ms at 50,000.
    - `max_lexer_states` (50,000; llguidance: 250,000): about 1-2 kB each, so ~50-100 MB per
      grammar at most, over its whole life (the matchers of one grammar share its lexer).
    - `initial_lexer_fuel` (1,000,000, llguidance's; ~20 ms of regex building).
    Per mask step, llguidance's defaults: `step_lexer_fuel` (200,000, ~15 ms),
    `step_max_items` (50,000 parser items, ~2.5 ms) and `max_items_in_row` (2,000
    alternatives open at one point: an object of more than ~500 optional properties hits it on
    its first token, which the compile's probe catches).
    Compiler-wide: `compile_workers` (2 threads) and `cache_bytes` (256 MiB of compiled
    grammars, by estimated size).
    """

    compile_timeout_s: float = 10.0
    max_grammar_size: int = 25_000
    max_lexer_states: int = 50_000
    initial_lexer_fuel: int = 1_000_000
    step_lexer_fuel: int = 200_000
    step_max_items: int = 50_000
    max_items_in_row: int = 2_000
    compile_workers: int = 2
    cache_bytes: int = 256 << 20

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            kind = int | float if field.type == "float" else int
            if isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
                raise ValueError(
                    f"GrammarLimits.{field.name} must be a positive {field.type}, got {value!r}"
                )

    def parser_limits(self) -> llguidance.LLParserLimits:
        return llguidance.LLParserLimits(
            max_items_in_row=self.max_items_in_row,
            initial_lexer_fuel=self.initial_lexer_fuel,
            step_lexer_fuel=self.step_lexer_fuel,
            step_max_items=self.step_max_items,
            max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size,
        )


@dataclass(frozen=True)
class CompiledGrammar:
    """A validated grammar; `new_matcher` hands out fresh matchers cheaply (deep copies).
    `nbytes` is its estimated memory (see _estimated_bytes)."""

    spec: GrammarSpec
    template: llguidance.LLMatcher
    vocab_size: int
    end_ids: frozenset[int]
    nbytes: int = 0

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self.template.deep_copy(), self.vocab_size, self.end_ids)


class GrammarCompiler:
    """Compiles GrammarSpecs for one tokenizer and one model vocabulary, on worker threads
    within `limits`, caching the results by content under a byte budget.

    `vocab_size` is the model's logits width; ids from the tokenizer's size up to it are padding
    and are always masked. End tokens (`end_token_ids` of the constructors; by default the
    tokenizer's EOS ids less Harmony's delimiters) may close an output once its grammar is
    complete, and are allowed only then.

    `submit` never blocks (an engine loop calls it); `compile` and `matcher` wait for the
    compile. llguidance releases the GIL while it builds a grammar, so a compile does not stall
    the threads that keep decoding.
    """

    def __init__(
        self,
        ll_tokenizer: llguidance.LLTokenizer,
        vocab_size: int,
        limits: GrammarLimits | None = None,
    ) -> None:
        self.ll_tokenizer = ll_tokenizer
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self._parser_limits = self.limits.parser_limits()
        self._end_ids = frozenset(ll_tokenizer.eos_tokens)
        self._probe_executor = llguidance.LLExecutor(1)  # see _probe; shared by the workers
        self._pool: CompilePool[CompiledGrammar] = CompilePool(
            self._build,
            GrammarCache(self.limits.cache_bytes),
            self.limits.compile_workers,
            self.limits.compile_timeout_s,
        )

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        vocab_size: int,
        end_token_ids: list[int] | None = None,
        limits: GrammarLimits | None = None,
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
        return cls(ll_tokenizer, vocab_size, limits)

    @classmethod
    def from_tiktoken(
        cls,
        encoding: Any,
        vocab_size: int | None = None,
        end_token_ids: list[int] | None = None,
        limits: GrammarLimits | None = None,
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
        return cls(ll_tokenizer, vocab_size, limits)

    def cached(self, spec: GrammarSpec) -> CompiledGrammar | None:
        """The compiled grammar when it is cached (refreshing it in the LRU), else None. Never
        compiles, never blocks."""
        return self._pool.cached(spec)

    def submit(self, spec: GrammarSpec) -> Future[CompiledGrammar]:
        """Compile on a worker. The future raises GrammarError (UnsupportedSchema,
        UnsatisfiableSchema, GrammarTooComplex naming the limit) for a spec that cannot be
        compiled; it is done already when the outcome is cached; concurrent submits of one spec
        share one compile. Never cancel the future: other requests may be waiting on it."""
        return self._pool.submit(spec)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """Compile (on a worker) and wait for it; GrammarError as for `submit`."""
        return self._pool.submit(spec).result()

    def matcher(self, spec: GrammarSpec) -> LLGuidanceMatcher:
        return self.compile(spec).new_matcher()

    def stats(self) -> dict[str, int]:
        """entries, bytes and budget of the cache; hits and misses (submits answered from the
        cache or not), compiles started, failures, timeouts; compiling (in flight now)."""
        return self._pool.stats()

    def close(self) -> None:
        """Stop the compile workers; compiles not finished fail their futures."""
        self._pool.close()

    def _build(self, spec: GrammarSpec) -> CompiledGrammar:
        """On a worker thread: grammar text, the llguidance matcher (GIL released), then the
        probe of its first steps."""
        grammar = _grammar_text(spec)
        template = llguidance.LLMatcher(
            self.ll_tokenizer, grammar, log_level=0, limits=self._parser_limits
        )
        if template.is_error():
            raise _compile_error(spec, template.get_error(), self.limits, building=True)
        problem = _probe(template, self.vocab_size, self._probe_executor)
        if problem:
            raise _compile_error(spec, problem, self.limits, building=False)
        nbytes = _estimated_bytes(grammar)
        return CompiledGrammar(spec, template, self.vocab_size, self._end_ids, nbytes)


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

    def error(self) -> str | None:
        """llguidance's message (first line) once the matcher entered its error state: a limit
        hit while stepping (say, too many parser items on consuming a token), or a token forced
        past the checks of `accept_token`."""
        if not self.ll_matcher.is_error():
            return None
        return _first_line(self.ll_matcher.get_error())


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
        schema: Any = spec.source  # as text: a dict costs llguidance ~30 ms at 9,000 properties
        if _FLOAT_COUNT.search(spec.source) or _FORMAT_VALUE.search(spec.source):
            schema = _normalized(json.loads(spec.source))
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=overrides)
    except ValueError as exc:
        raise GrammarError(f"invalid JSON schema: {exc}") from exc


def _normalized(schema: Any) -> Any:
    """The schema as llguidance can take it, meaning the same: counts written as floats
    (`"maxItems": 2.0`) are integers in JSON Schema, and llguidance wants ints; a `format` it
    does not know is dropped, since in draft 2020-12 a format is an annotation that never changes
    validity (the string stays a string, unconstrained)."""
    if isinstance(schema, list):
        return [_normalized(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    fixed = {}
    for key, value in schema.items():
        if key in _INTEGER_KEYWORDS and isinstance(value, float) and value.is_integer():
            value = int(value)
        elif key == "format" and isinstance(value, str) and not _known_format(value):
            continue
        elif key not in _DATA_KEYWORDS:  # data (const values...) is never rewritten
            value = _normalized(value)
        fixed[key] = value
    return fixed


@functools.lru_cache(maxsize=256)
def _known_format(name: str) -> bool:
    """Whether llguidance enforces this `format` (asked of the installed version itself)."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "string", "format": name})
    return not llguidance.LLMatcher.validate_grammar(grammar)


def _compile_error(
    spec: GrammarSpec, message: str, limits: GrammarLimits, building: bool
) -> GrammarError:
    first_line = _first_line(message)
    limit = _limit_hit(message, building)
    if limit is not None:
        needs = f"more than {getattr(limits, limit):,} {_LIMIT_MEANINGS[limit]}"
        return GrammarTooComplex(limit, f"the {spec.kind} grammar needs {needs}: {first_line}")
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
    if not building:
        return GrammarError(f"the {spec.kind} grammar fails on its first token: {first_line}")
    return GrammarError(f"cannot compile the {spec.kind} grammar: {first_line}")


def _limit_hit(message: str, building: bool) -> str | None:
    """The GrammarLimits field an llguidance error message reports hitting, if any."""
    for text, limit in _LIMIT_MESSAGES:
        if text in message:
            if limit == "step_lexer_fuel" and building:
                return "initial_lexer_fuel"
            return limit
    return None


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


def _probe(template: llguidance.LLMatcher, vocab_size: int, executor: llguidance.LLExecutor) -> str:
    """Step copies of a fresh matcher through its first mask and, from a few of the tokens that
    mask allows, one token further and the next mask; llguidance's error message when one of
    them breaks down (a per-step limit: an object of ~9,000 optional properties compiles but
    cannot take its first token), else "". A probe, not a proof; cheap next to the compile.

    Through the executor's draft-token call, which (unlike consume_token) releases the GIL:
    consuming one token of such a grammar takes ~50 ms."""
    first = template.deep_copy()
    mask = first.compute_bitmask()
    if first.is_error():
        return first.get_error()
    tokens = _probe_tokens(mask, _PROBE_TOKENS)
    if not tokens:
        return ""
    width = (vocab_size + 31) // 32
    # Matcher i writes its mask before the token into row 2i, the one after it into row 2i + 1.
    rows = torch.zeros((2 * len(tokens), width), dtype=torch.int32)  # [2T, W]
    copies = [template.deep_copy() for _ in tokens]
    drafts = [(copies[i], 2 * i, [token]) for i, token in enumerate(tokens)]
    executor.unsafe_compute_mask_ptr_with_draft_token(
        drafts, rows.data_ptr(), width * 4, len(rows)
    )
    problem = next((copy.get_error() for copy in copies if copy.is_error()), "")
    if _NO_ROLLBACK in problem:  # a token-budgeted rule (max_tokens): step without drafts
        return _probe_consuming(template, tokens)
    return problem


_NO_ROLLBACK = "rollback not supported"


def _probe_consuming(template: llguidance.LLMatcher, tokens: list[int]) -> str:
    """_probe's second step for grammars that cannot roll back: consume on copies (holds the
    GIL; such grammars are small turn grammars, not huge schemas)."""
    for token in tokens:
        copy = template.deep_copy()
        copy.consume_token(token)
        if not copy.is_error():
            copy.compute_bitmask()
        if copy.is_error():
            return copy.get_error()
    return ""


def _probe_tokens(mask: bytes, count: int) -> list[int]:
    """Up to `count` token ids allowed by an llguidance bitmask (bit t % 8 of byte t // 8),
    spread evenly over the allowed ids, the first and the last included."""
    data = torch.frombuffer(bytearray(mask), dtype=torch.uint8)
    bits = (data[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1  # [bytes, 8]
    allowed = bits.flatten().nonzero().flatten()  # [n]
    if len(allowed) > count:
        allowed = allowed[torch.linspace(0, len(allowed) - 1, count).round().long()]
    return allowed.tolist()


def _estimated_bytes(grammar: str) -> int:
    """Estimated memory of a compiled grammar, from its llguidance grammar text (see
    _FIXED_BYTES for the calibration)."""
    return _FIXED_BYTES + _BYTES_PER_GRAMMAR_BYTE * len(grammar.encode())
