"""OpenAI wire types for requests, checked at the edge, and their translation to SamplingParams.

Foreign JSON stops here: a body is parsed (UTF-8, a JSON object nested no deeper than the limit,
no lone surrogates), validated against these models (strict types, every number in range and
finite; unknown fields are ignored, like OpenAI's own API does for fields it retired), held to
the server's RequestLimits (messages, prompt characters, stops, tools, schemas), and only then
turned into token ids and one SamplingParams per choice. Fields of features that have not
landed yet are declared so that they can be refused clearly.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from noesis.models.capabilities import RUNNABLE, refusal
from noesis.sampling.params import (
    INT64_MAX,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_TOP_K,
    SamplingParams,
)
from noesis.server.config import COUNT_MAX, RequestLimits
from noesis.server.errors import APIError


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant turn's analysis, as responses carry it

    def text_chars(self) -> int:
        """Characters of text this message puts in the prompt (a few more for part types)."""
        fields = (self.content, self.name, self.tool_calls, self.tool_call_id,
                  self.reasoning_content)
        return sum(map(_text_chars, fields))


class _SamplingFields(_Model):
    model: str
    n: int = Field(1, ge=1, le=COUNT_MAX)
    # Unset: the checkpoint's generation_config.json, else SamplingParams' default (as for
    # top_k and repetition_penalty).
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # No-ops, as in OpenAI, where they never change the output: an end user's id for abuse
    # monitoring, its successor, and a hint for routing to a prefix cache (noesis's is automatic).
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    logit_bias: dict[str, Any] | None = None  # token id (as a string) -> bias in [-100, 100]
    service_tier: str | None = None  # one tier here: "auto" and "default" name it
    # Extensions (as in vLLM): sent through the openai client's `extra_body`.
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    ignore_eos: bool = False
    control: bool = True  # false: the server's control plane (serve --control) leaves it alone
    # true: the request must be replayable from the server's trace (serve --trace PATH; a 400
    # without one); the response names its engine request ids for `noesis replay --request`.
    deterministic: bool = False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stops):
            raise APIError(400, "stop: stop strings must not be empty", "stop", "invalid_value")
        return stops

    def check_limits(self, limits: RequestLimits) -> None:
        """Refuse what is over the server's limits, before any tokenizing or queueing."""
        stops = self.stops()
        if len(stops) > limits.max_stop:
            raise _over_limit("stop", f"{len(stops)} stop strings", limits.max_stop, "max-stop",
                              "array_above_max_length")
        for index, stop in enumerate(stops):
            if len(stop) > limits.max_stop_chars:
                param = "stop" if isinstance(self.stop, str) else f"stop[{index}]"
                raise _over_limit(param, f"{len(stop)} characters", limits.max_stop_chars,
                                  "max-stop-chars", "string_above_max_length")

    @property
    def choices(self) -> int:
        """Generations per prompt."""
        return self.n

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, defaults: SamplingParams | None = None
    ) -> list[SamplingParams]:
        """One SamplingParams per generation (`choices`); with a seed, generation i gets
        seed + i (so they differ). What the request leaves unset comes from `defaults` (the
        server's, from the checkpoint)."""
        defaults = defaults or SamplingParams()
        choices = self.choices
        base = dict(
            temperature=_given(self.temperature, defaults.temperature),
            top_p=_given(self.top_p, defaults.top_p),
            top_k=_given(self.top_k, defaults.top_k),
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=_given(self.repetition_penalty, defaults.repetition_penalty),
            max_tokens=max_tokens,
            stop=self.stops(),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            logit_bias=self.bias(),
            control=self.control,
        )
        seeds = [None] * choices
        if self.seed is not None:
            seeds = [(self.seed + i) & INT64_MAX for i in range(choices)]
        return [SamplingParams(seed=seed, **base) for seed in seeds]

    def bias(self) -> dict[int, float] | None:
        """logit_bias with integer ids; a 400 naming the entry that is no id or no bias in
        range (ids past the vocabulary are the engine's to refuse)."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            param = f"logit_bias.{_short(key)}"
            if not (key.isascii() and key.isdigit() and len(key) <= 18):
                raise APIError(400, f"{param}: keys must be token ids (integers as strings)",
                               param, "invalid_value")
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise APIError(400, f"{param}: the bias must be a number, got {_shown(value)}",
                               param, "invalid_value")
            if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                raise APIError(400, f"{param}: the bias must be in [-100, 100], got {value}",
                               param, "invalid_value")
            bias[int(key)] = float(value)
        return bias

    def refuse_unsupported(self) -> None:
        """Every field OpenAI defines is honoured, a documented no-op, or refused here."""
        self.bias()  # a bad entry is refused before any tokenizing
        if self.service_tier not in (None, "auto", "default"):
            raise APIError(400, f"service_tier {_shown(self.service_tier)}: this server has one "
                           "tier ('auto' or 'default')", "service_tier", "unsupported_value")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    modalities: list[str] | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: str | None = None  # passed to a chat template that reads it
    store: bool | None = None  # nothing is stored here: only false (OpenAI's default) is taken
    metadata: dict[str, str] | None = None  # a no-op: OpenAI keeps it with stored completions
    verbosity: str | None = None
    # Extensions (as in vLLM), through the openai client's `extra_body`:
    chat_template_kwargs: dict[str, Any] | None = None  # enable_thinking, ... for the template
    documents: list[Any] | None = None  # retrieval documents, for templates that show them
    thinking_budget: int | None = Field(None, ge=0, le=COUNT_MAX)  # tokens of <think> at most

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        for name in ("functions", "function_call"):
            if getattr(self, name):
                raise APIError(400, f"{name} is the deprecated form: use tools and tool_choice",
                               name, "unsupported_parameter")
        if self.audio:
            raise _not_supported("audio", "noesis serves text models (modalities ['text'])")
        if self.prediction:
            raise _not_supported("prediction", "predicted outputs are not implemented "
                                 "(noesis serve --speculative-method needs no prediction)")
        if self.web_search_options is not None:
            raise _not_supported("web_search_options", "noesis has no web search")
        if self.modalities not in (None, ["text"]):
            raise APIError(400, "modalities: only ['text'] is supported", "modalities")
        if self.store:
            raise APIError(400, "store: this server keeps no completions; send false or leave "
                           "it out", "store", "unsupported_value")
        if self.verbosity is not None:
            raise APIError(400, "verbosity is not supported: no model served here reads it",
                           "verbosity", "unsupported_parameter")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")

    def check_limits(self, limits: RequestLimits) -> None:
        super().check_limits(limits)
        if len(self.messages) > limits.max_messages:
            raise _over_limit("messages", f"{len(self.messages)} messages", limits.max_messages,
                              "max-messages", "array_above_max_length")
        extra = _text_chars(self.chat_template_kwargs) + _text_chars(self.documents)
        _check_prompt_chars("messages", sum(m.text_chars() for m in self.messages) + extra, limits)
        if self.tools is not None:
            if len(self.tools) > limits.max_tools:
                raise _over_limit("tools", f"{len(self.tools)} tools", limits.max_tools,
                                  "max-tools", "array_above_max_length")
            for index, tool in enumerate(self.tools):
                function = tool.get("function") if isinstance(tool, dict) else None
                if isinstance(function, dict) and "parameters" in function:
                    param = f"tools[{index}].function.parameters"
                    check_schema(param, function["parameters"], limits)
        wrapper = (self.response_format or {}).get("json_schema")
        if isinstance(wrapper, dict) and "schema" in wrapper:
            check_schema("response_format.json_schema.schema", wrapper["schema"], limits)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def effective_tool_choice(self) -> Any:
        """OpenAI's default: "auto" when tools are given, "none" otherwise."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def template_kwargs(self, reads: Callable[[str], bool] = lambda name: True) -> dict[str, Any]:
        """What the chat template reads besides messages and tools. `reads(name)` tells whether
        the model's template reads a variable: one it would ignore is a 400 naming it."""
        kwargs = dict(self.chat_template_kwargs or {})
        taken = sorted(_TEMPLATE_ARGUMENTS.intersection(kwargs))
        if taken:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)}",
                           "chat_template_kwargs", "invalid_value")
        for name in kwargs:
            _check_read(reads, name, f"chat_template_kwargs.{_short(name)}")
        if self.documents is not None:
            _check_read(reads, "documents", "documents")
            kwargs["documents"] = self.documents
        if self.reasoning_effort is not None:
            _check_read(reads, "reasoning_effort", "reasoning_effort")
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs

    def template_messages(self, tool_calls: bool = False) -> list[dict[str, Any]]:
        """Messages for the chat template; assistant tool calls and tool results only when the
        model's format can carry them (`tool_calls`)."""
        return template_messages(self.messages, tool_calls)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=COUNT_MAX)
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise _not_supported("suffix", "it needs fill-in-the-middle, which noesis lacks")
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"best_of ({self.best_of}) must be at least n ({self.n})",
                           "best_of", "invalid_value")
        if self.choices > self.n and self.stream:
            raise APIError(400, "best_of > n cannot be streamed (as in OpenAI's API)",
                           "best_of", "invalid_value")

    @property
    def choices(self) -> int:
        """Generations per prompt: best_of, of which the n most likely are returned."""
        return max(self.n, self.best_of or 0)

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, defaults: SamplingParams | None = None
    ) -> list[SamplingParams]:
        """As for any request; echo with logprobs scores the prompt too (the same k)."""
        params = super().sampling_params(max_tokens, logprobs, defaults)
        if not self.echo or self.logprobs is None:
            return params
        return [dataclasses.replace(p, prompt_logprobs=self.logprobs) for p in params]

    def check_limits(self, limits: RequestLimits) -> None:
        super().check_limits(limits)
        several = not isinstance(self.prompt, str)
        for index, prompt in enumerate(self.prompts()):
            if isinstance(prompt, str):
                param = f"prompt[{index}]" if several else "prompt"
                _check_prompt_chars(param, len(prompt), limits)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def logprobs_k(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (text or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise APIError(400, "prompt: must not be empty", "prompt", "invalid_value")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)


class TokenizeRequest(_Model):
    """vLLM's /tokenize: a text prompt, or chat messages rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # with `prompt`: the tokenizer's BOS and the like
    add_generation_prompt: bool = True  # with `messages`
    return_token_strs: bool = False

    def check_limits(self, limits: RequestLimits) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError(400, "give either prompt or messages", "prompt", "invalid_value")
        if self.prompt is not None:
            _check_prompt_chars("prompt", len(self.prompt), limits)
            return
        if len(self.messages) > limits.max_messages:
            raise _over_limit("messages", f"{len(self.messages)} messages", limits.max_messages,
                              "max-messages", "array_above_max_length")
        _check_prompt_chars("messages", sum(m.text_chars() for m in self.messages), limits)


class DetokenizeRequest(_Model):
    """vLLM's /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]

    def check_limits(self, limits: RequestLimits) -> None:
        if limits.max_prompt_chars is not None and len(self.tokens) > limits.max_prompt_chars:
            raise _over_limit("tokens", f"{len(self.tokens)} tokens", limits.max_prompt_chars,
                              "max-prompt-chars", "array_above_max_length")


class EmbeddingRequest(_Model):
    """/v1/embeddings: one input or a batch, as text or token ids. `pooling` (extra_body) picks
    the decoder's pooling: "last" (default) or "mean"."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=COUNT_MAX)
    user: str | None = None
    pooling: Literal["last", "mean"] | None = None

    def check_limits(self, limits: RequestLimits) -> None:
        inputs = self.inputs()
        if len(inputs) > MAX_EMBEDDING_INPUTS:
            raise APIError(400, f"input: {len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS} "
                           "per request", "input", "array_above_max_length")
        several = not isinstance(self.input, str)
        for index, one in enumerate(inputs):
            param = f"input[{index}]" if several else "input"
            if not one:
                raise APIError(400, f"{param}: must not be empty", param, "invalid_value")
            if isinstance(one, str):
                _check_prompt_chars(param, len(one), limits)

    def inputs(self) -> list[str | list[int]]:
        """The input field as a list of inputs (text or token ids)."""
        value = self.input
        if isinstance(value, str) or (value and isinstance(value[0], int)):
            return [value]
        if not value:
            raise APIError(400, "input: must not be empty", "input", "invalid_value")
        return list(value)


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's own limit per request

# Set by noesis itself when it renders a template.
_TEMPLATE_ARGUMENTS = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"}
)


def template_messages(messages: list[ChatMessage], tool_calls: bool) -> list[dict[str, Any]]:
    """Wire messages -> the chat template's; a tool result names its tool through its call's
    id."""
    rendered = [_template_message(i, m, tool_calls) for i, m in enumerate(messages)]
    names = {c["id"]: c["function"]["name"] for m in rendered for c in m.get("tool_calls", ())}
    for message in rendered:
        if message["role"] == "tool" and "name" not in message:
            name = names.get(message.get("tool_call_id"))
            if name is not None:
                message["name"] = name
    return rendered


def parse_body(
    body: bytes | bytearray, model: type[_Model], limits: RequestLimits | None = None
):
    """Bytes -> validated request within `limits`, or a 400 naming what is wrong."""
    limits = limits or RequestLimits()
    data = load_json(body, limits.max_json_depth)
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(body):  # only a \uD800-\uDFFF escape can make one
        refuse_lone_surrogates(data)
    try:
        request = model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from exc
    request.check_limits(limits)
    return request


def load_json(text: bytes, max_depth: int, what: str = "the body", param: str | None = None):
    """Parse JSON nested at most `max_depth` deep. Deeper is a 400 `invalid_json` naming the
    limit and the top-level field it hides in; so are NaN, Infinity and bad UTF-8."""
    deep = _too_deep_at(text, max_depth)
    if deep is not None:
        field = deep[1]
        where = f" (in {field})" if field else ""
        raise APIError(
            400,
            f"{what} nests JSON deeper than {max_depth} levels{where}; this server allows "
            f"{max_depth} (noesis serve --max-json-depth)",
            param or field,
            "invalid_json",
        )
    try:
        return json.loads(text.decode("utf-8"), parse_constant=_refuse_constant)
    except UnicodeDecodeError as exc:
        raise APIError(400, f"{what} is not valid UTF-8: {exc}", param, "invalid_json") from exc
    except json.JSONDecodeError as exc:
        raise APIError(400, f"{what} is not valid JSON: {exc}", param, "invalid_json") from exc
    except ValueError as exc:  # an integer past int's digit limit
        digits = sys.get_int_max_str_digits()
        message = f"{what} holds an integer with more than {digits} digits"
        raise APIError(400, message, param, "invalid_json") from exc


def _refuse_constant(name: str):
    raise APIError(400, f"{name} is not a JSON number: send a finite number", code="invalid_json")


# ---- nesting depth, before parsing --------------------------------------------------------------
# json.loads recurses once per level, and ~1000 levels raise RecursionError. The depth is
# counted in C and numpy instead: escapes are blanked (same length), so every quote left opens
# or closes a string, and brackets outside strings step the depth up or down.

_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_STEPS = np.zeros(256, np.int8)
_STEPS[list(b"[{")] = 1
_STEPS[list(b"]}")] = -1
_CHUNK = 1 << 20  # bytes per numpy pass: a few MB of temporaries, whatever the body's size


def _too_deep_at(text: bytes, limit: int) -> tuple[int, str | None] | None:
    """Where `text` first nests deeper than `limit`: the bracket's offset, and the top-level
    field it is in (None where the top level is no object); None if it never does."""
    if text.count(b"[") + text.count(b"{") <= limit:
        return None  # it cannot nest deeper than it opens
    plain = _ESCAPE.sub(b"__", text)
    data = np.frombuffer(plain, np.uint8)
    depth, quotes, colon = 0, 0, -1  # colon: the last ':' of the top-level object so far
    for start in range(0, len(data), _CHUNK):
        chunk = data[start : start + _CHUNK]
        is_quote = chunk == ord('"')
        outside = (np.cumsum(is_quote, dtype=np.int32) + quotes) % 2 == 0
        levels = np.cumsum(_STEPS[chunk] * outside, dtype=np.int32) + depth
        over = np.flatnonzero(levels > limit)
        end = int(over[0]) if over.size else len(chunk)
        colons = np.flatnonzero((chunk[:end] == ord(":")) & outside[:end] & (levels[:end] == 1))
        colon = start + int(colons[-1]) if colons.size else colon
        if over.size:
            return start + end, _key_before(text, plain, colon)
        depth, quotes = int(levels[-1]), quotes + int(is_quote.sum())
    return None


def _key_before(text: bytes, plain: bytes, colon: int) -> str | None:
    """The object key that ends just before the ':' at `colon` (found in `plain`, the text with
    escapes blanked, where every quote is a string's own; decoded from `text`)."""
    close = plain.rfind(b'"', 0, colon) if colon >= 0 else -1
    start = plain.rfind(b'"', 0, close) if close > 0 else -1
    if start < 0:
        return None
    try:
        key = json.loads(text[start : close + 1])
    except ValueError:
        return None
    return _short(key) if isinstance(key, str) else None


# ---- lone surrogates ----------------------------------------------------------------------------
# json.loads turns "\ud800" into a str that no UTF-8 encoder (the tokenizer, our own responses)
# accepts. A valid pair becomes one character, so any surrogate left in a str is a lone one.

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_LONE_SURROGATE = re.compile(r"[\ud800-\udfff]")


def refuse_lone_surrogates(data: Any, path: str = "") -> None:
    """A 400 naming the first string (or key) in `data` that holds a lone surrogate."""
    stack = [(data, path)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            _check_text(path, value)
        elif isinstance(value, dict):
            for key in value:
                _check_text(path, key)
            named = [(v, f"{path}.{_short(k)}" if path else _short(k)) for k, v in value.items()]
            stack += reversed(named)
        elif isinstance(value, list):
            stack += reversed([(v, f"{path}[{i}]") for i, v in enumerate(value)])


def _short(key: str) -> str:
    """A key as part of a `param`: a client's key can be megabytes long."""
    return key if len(key) <= 64 else f"{key[:64]}..."


def _check_text(path: str, text: str) -> None:
    found = _LONE_SURROGATE.search(text)
    if found is not None:
        raise APIError(
            400,
            f"{path or 'the body'}: U+{ord(found.group()):04X} at character {found.start()} is "
            "a lone surrogate (half of a UTF-16 pair), which is not Unicode text",
            path or None,
            "invalid_value",
        )


# ---- limits on what a request brings ------------------------------------------------------------


def check_schema(param: str, schema: Any, limits: RequestLimits) -> None:
    """A tool's parameters or a response_format schema: bounded in size and depth before any
    grammar is built from it. A schema sent as JSON text is held to the same limits."""
    if isinstance(schema, str):
        text = schema.encode()
        if len(text) > limits.max_schema_bytes:
            raise _schema_too_large(param, len(text), limits)
        if _too_deep_at(text, limits.max_schema_depth) is not None:
            raise _schema_too_deep(param, f"more than {limits.max_schema_depth}", limits)
        schema = load_json(text, limits.max_schema_depth, param, param)
        refuse_lone_surrogates(schema, param)
    try:
        size = len(json.dumps(schema, separators=(",", ":"), allow_nan=False).encode())
    except ValueError as exc:  # a float that overflowed to inf while parsing (1e999)
        raise APIError(400, f"{param}: {exc}", param, "invalid_value") from exc
    if size > limits.max_schema_bytes:
        raise _schema_too_large(param, size, limits)
    depth = _nesting(schema)
    if depth > limits.max_schema_depth:
        raise _schema_too_deep(param, str(depth), limits)


def _schema_too_large(param: str, size: int, limits: RequestLimits) -> APIError:
    return APIError(
        400,
        f"{param}: the schema is {size} bytes of JSON; this server allows "
        f"{limits.max_schema_bytes} (noesis serve --max-schema-bytes)",
        param,
        "schema_too_large",
    )


def _schema_too_deep(param: str, depth: str, limits: RequestLimits) -> APIError:
    return APIError(
        400,
        f"{param}: the schema nests {depth} levels deep; this server allows "
        f"{limits.max_schema_depth} (noesis serve --max-schema-depth)",
        param,
        "schema_too_deep",
    )


def _nesting(value: Any) -> int:
    """Levels of objects and arrays in a parsed JSON value (a scalar is 0)."""
    if not isinstance(value, (dict, list)):
        return 0
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        deepest = max(deepest, depth)
        items = value.values() if isinstance(value, dict) else value
        stack += [(item, depth + 1) for item in items if isinstance(item, (dict, list))]
    return deepest


def _check_prompt_chars(param: str, chars: int, limits: RequestLimits) -> None:
    limit = limits.max_prompt_chars
    if limit is not None and chars > limit:
        raise APIError(
            400,
            f"{param}: the prompt has {chars} characters; this server takes at most {limit} (the "
            "context length times the tokenizer's longest token, unless noesis serve "
            "--max-prompt-chars sets it): shorten the prompt",
            param,
            "context_length_exceeded",
        )


def _over_limit(param: str, what: str, limit: int, flag: str, code: str) -> APIError:
    message = f"{param}: {what}; this server allows {limit} (noesis serve --{flag})"
    return APIError(400, message, param, code)


def _text_chars(value: Any) -> int:
    """Characters in the strings of a parsed JSON value (depth bounded by the body's limit)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(map(_text_chars, value.values()))
    if isinstance(value, list):
        return sum(map(_text_chars, value))
    return 0


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    param = _param_name(first["loc"])
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
    return APIError(400, f"{param}: {first['msg']}{more}", param, code)


def _param_name(loc: tuple) -> str:
    name = ""
    for part in loc:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in ("str", "int", "float", "bool", "list[str]", "list[int]", "list[list[int]]"):
            continue  # pydantic names union members in the location; clients need the field
        else:
            name += f".{part}" if name else str(part)
    return name


def _template_message(index: int, message: ChatMessage, tool_calls: bool) -> dict[str, Any]:
    param = f"messages[{index}]"
    if not tool_calls and (message.role == "tool" or message.tool_calls):
        message_text = (f"{param}: tool calls and tool results need a model whose chat format "
                        "has tool-call syntax (Harmony or a dialect: noesis serve "
                        "--tool-dialect); this model's has none")
        raise APIError(400, message_text, param, "unsupported_parameter")
    role = "system" if message.role == "developer" else message.role
    content = message.content
    if content is None:
        content = ""
    elif isinstance(content, list):
        content = "".join(_text_part(f"{param}.content[{i}]", p) for i, p in enumerate(content))
    out: dict[str, Any] = {"role": role, "content": content}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [_tool_call(f"{param}.tool_calls[{i}]", c)
                             for i, c in enumerate(message.tool_calls)]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.reasoning_content:
        out["thinking"] = message.reasoning_content
    return out


def _tool_call(param: str, call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"{param}: needs function.name", param, "invalid_value")
    arguments = function.get("arguments", "{}")
    if not isinstance(arguments, str):
        raise APIError(400, f"{param}: function.arguments must be a JSON string", param,
                       "invalid_value")
    return {"id": call.get("id"), "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def _text_part(param: str, part: dict[str, Any]) -> str:
    if part.get("type") != "text" or not isinstance(part.get("text"), str):
        kind = part.get("type")
        refused_input(param, kind)
        raise APIError(400, f"{param}: only text parts are supported, got {kind!r}", param)
    return part["text"]


def refused_input(param: str, part_type: Any) -> None:
    """A 400 saying why an image or audio part cannot be read: every model noesis serves is
    loaded text-only (noesis.models.capabilities.RUNNABLE). Other part types pass."""
    reason = refusal(part_type, RUNNABLE)
    if reason is not None:
        raise APIError(400, f"{param}: {reason}", param, "unsupported_value")


def _not_supported(name: str, why: str) -> APIError:
    return APIError(400, f"{name} is not supported: {why}", name, "unsupported_parameter")


def _check_read(reads: Callable[[str], bool], name: str, param: str) -> None:
    if not reads(name):
        message = (f"{param}: this model's chat template does not read {_short(name)!r}, so it "
                   "would change nothing")
        raise APIError(400, message, param, "unsupported_parameter")


def _given(value: Any, default: Any) -> Any:
    return default if value is None else value


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"
