"""OpenAI wire types for requests, checked at the edge, and their translation to SamplingParams.

Foreign JSON stops here: a body is parsed (UTF-8, a JSON object nested no deeper than the limit,
no lone surrogates), validated against these models (strict types, every number in range and
finite; unknown fields are ignored, like OpenAI's own API does for fields it retired), held to
the server's RequestLimits (messages, prompt characters, stops, tools, schemas), and only then
turned into token ids and one SamplingParams per choice. Fields of features that have not
landed yet are declared so that they can be refused clearly.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from noesis.sampling.params import INT64_MAX, MAX_LOGPROBS, MAX_TOP_K, SamplingParams
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
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-(2**63), le=INT64_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, Any] | None = None
    # Extensions (as in vLLM): sent through the openai client's `extra_body`.
    top_k: int = Field(0, ge=-1, le=MAX_TOP_K)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False

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

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> list[SamplingParams]:
        """One SamplingParams per choice; with a seed, choice i gets seed + i (so they differ)."""
        base = dict(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            max_tokens=max_tokens,
            stop=self.stops(),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )
        seeds = [None] * self.n
        if self.seed is not None:
            seeds = [(self.seed + i) & INT64_MAX for i in range(self.n)]
        return [SamplingParams(seed=seed, **base) for seed in seeds]

    def refuse_unsupported(self) -> None:
        if self.logit_bias:
            raise _not_yet("logit_bias")


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
    reasoning_effort: str | None = None  # passed to the chat template
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
        for name in ("audio", "prediction"):
            if getattr(self, name):
                raise _not_yet(name)
        if self.web_search_options is not None:
            raise _not_yet("web_search_options")
        if self.modalities not in (None, ["text"]):
            raise APIError(400, "modalities: only ['text'] is supported", "modalities")
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

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template reads besides messages and tools."""
        kwargs = dict(self.chat_template_kwargs or {})
        taken = sorted(_TEMPLATE_ARGUMENTS.intersection(kwargs))
        if taken:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(taken)}",
                           "chat_template_kwargs", "invalid_value")
        if self.documents is not None:
            kwargs["documents"] = self.documents
        if self.reasoning_effort is not None:
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
            raise _not_yet("suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported", "echo")

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
        raise APIError(400, f"{param}: only text parts are supported, got {kind!r}", param)
    return part["text"]


def _not_yet(name: str) -> APIError:
    return APIError(
        400,
        f"{name} is not supported yet: structured output and tool calls arrive with a later "
        "release of noesis",
        name,
        "unsupported_parameter",
    )
