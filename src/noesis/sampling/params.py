"""SamplingParams: what a request asks of the sampler and the stop conditions, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from noesis.errors import InvalidSamplingParams
from noesis.structured.matcher import GrammarSpec

MAX_LOGPROBS = 20
INT64_MAX = 2**63 - 1  # seeds, budgets and ids travel to the engine in int64 tensors
MAX_TOP_K = 2**31 - 1  # a 32-bit count, whatever the vocabulary
TOP_K_HINT = "a top_k at or above the vocabulary size keeps every token, as 0 (off) does"
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k 0 (or -1) disables top-k. `logprobs=k` returns, per generated
    token, the top-k log-probabilities of the model's distribution plus the sampled token's.
    `prompt_logprobs=k` does the same for each prompt token (after the first) under the model's
    raw distribution at the position before it; such a request bypasses the prefix cache.
    `logit_bias={token_id: bias}` adds each bias (in [-100, 100]) to that token's logit before
    sampling; it is stored as sorted (token_id, bias) pairs, so the object stays hashable.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # A constraint enforced while sampling (noesis.structured.GrammarSpec): JSON schema, regex,
    # Lark. Only tokens the grammar allows can be sampled; the request stops when it completes.
    grammar: GrammarSpec | None = None
    # Per-token entropy, varentropy, top-k mass and top-1/top-2 margin in RequestOutput.metrics
    # (and for the control plane). Off: nothing is computed.
    metrics: bool = False
    logit_bias: tuple[tuple[int, float], ...] | None = None
    # Per-token control (noesis.control.knobs): True lets the engine's control policy
    # (LLM(control=...)) move temperature and top_p token by token, within the request's own;
    # False opts this request out. A conversation's control (noesis.control.turns.TurnControl,
    # which a Session's policy sets) steers with that conversation's belief and Φ instead.
    control: Any = True

    def __post_init__(self) -> None:
        # Accept lists and a lone string; store tuples so the object stays hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        ids = () if self.stop_token_ids is None else tuple(self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", ids)
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self._validate()

    def _validate(self) -> None:
        _check_number("temperature", self.temperature, lo=0.0, hi=100.0)
        _check_int("top_k", self.top_k, lo=0, hi=MAX_TOP_K, hint=TOP_K_HINT)
        _check_number("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_number("min_p", self.min_p, lo=0.0, hi=1.0)
        _check_number("repetition_penalty", self.repetition_penalty, lo=0.0, hi=100.0, lo_open=True)
        _check_number("presence_penalty", self.presence_penalty, lo=-2.0, hi=2.0)
        _check_number("frequency_penalty", self.frequency_penalty, lo=-2.0, hi=2.0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0, hi=INT64_MAX)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, lo=1, hi=INT64_MAX)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidSamplingParams(
                    "stop", f"each stop must be a non-empty string, got {s!r}"
                )
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t, lo=0, hi=INT64_MAX)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, lo=0, hi=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _check_int("prompt_logprobs", self.prompt_logprobs, lo=0, hi=MAX_LOGPROBS)
        if not isinstance(self.metrics, bool):
            raise InvalidSamplingParams("metrics", f"must be a bool, got {_shown(self.metrics)}")
        steers = callable(getattr(self.control, "knobs", None))  # a conversation's control
        if not isinstance(self.control, bool) and not steers:
            raise InvalidSamplingParams(
                "control", f"must be true or false, got {_shown(self.control)}"
            )
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise InvalidSamplingParams(
                "grammar", f"must be a GrammarSpec, got {type(self.grammar).__name__}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @property
    def needs_filtering(self) -> bool:
        return not self.greedy and (self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0)


def _bias_pairs(bias: object) -> tuple[tuple[int, float], ...] | None:
    """logit_bias as a dict (or pairs) -> sorted (token_id, bias) pairs, each checked; None
    when empty. Ids are checked against the vocabulary when the engine takes the request."""
    if bias is None:
        return None
    if isinstance(bias, dict):
        bias = bias.items()
    try:
        pairs = sorted((token, value) for token, value in bias)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise InvalidSamplingParams(
            "logit_bias", f"must map token ids to biases, got {_shown(bias)}"
        ) from None
    for token, value in pairs:
        _check_int("logit_bias", token, lo=0, hi=INT64_MAX)
        _check_number("logit_bias", value, lo=-MAX_LOGIT_BIAS, hi=MAX_LOGIT_BIAS)
    if len({token for token, _ in pairs}) != len(pairs):
        raise InvalidSamplingParams("logit_bias", "names a token id more than once")
    return tuple((token, float(value)) for token, value in pairs) or None


def _check_int(
    name: str, value: object, lo: int | None = None, hi: int | None = None, hint: str = ""
) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSamplingParams(name, f"must be an integer, got {_shown(value)}")
    if lo is not None and value < lo:
        raise InvalidSamplingParams(name, f"must be >= {lo}, got {_shown(value)}")
    if hi is not None and value > hi:
        hint = f" ({hint})" if hint else ""
        raise InvalidSamplingParams(name, f"must be <= {hi}{hint}, got {_shown(value)}")


def _check_number(name: str, value: object, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidSamplingParams(name, f"must be a number, got {_shown(value)}")
    if isinstance(value, float) and not math.isfinite(value):  # math.isfinite(10**400) raises
        raise InvalidSamplingParams(name, f"must be a finite number, got {value!r}")
    if value < lo or (lo_open and value == lo):
        bound = f"{'>' if lo_open else '>='} {lo}"
        raise InvalidSamplingParams(name, f"must be {bound}, got {_shown(value)}")
    if value > hi:
        raise InvalidSamplingParams(name, f"must be <= {hi}, got {_shown(value)}")


def _shown(value: object) -> str:
    """A value for an error message: a 4,000-digit integer is cut, not echoed whole."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"
