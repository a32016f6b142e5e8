"""OpenAI wire types for requests, checked strictly, and their translation to SamplingParams.

Foreign JSON stops here: a body is parsed (UTF-8, a JSON object), validated against these models
(strict types; unknown fields are ignored, like OpenAI's own API does for fields it retired),
then turned into token ids and one SamplingParams per choice. Fields of features that have not
landed yet (tools, response_format, ...) are declared so that they can be refused clearly.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from noesis.sampling.params import MAX_LOGPROBS, SamplingParams
from noesis.server.errors import APIError

MAX_STOP = 16
INT64_MAX = 2**63 - 1


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Model):
    include_usage: bool = False


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # an assistant turn's analysis, as responses carry it


class _SamplingFields(_Model):
    model: str
    n: int = Field(1, ge=1)
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
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    ignore_eos: bool = False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if len(stops) > MAX_STOP:
            raise APIError(400, f"stop: at most {MAX_STOP} stop strings", "stop", "invalid_value")
        if any(not s for s in stops):
            raise APIError(400, "stop: stop strings must not be empty", "stop", "invalid_value")
        return stops

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
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
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

    def template_messages(self, tool_calls: bool = False) -> list[dict[str, Any]]:
        """Messages for the chat template; assistant tool calls and tool results only when the
        model's format can carry them (`tool_calls`)."""
        messages = [_template_message(i, m, tool_calls) for i, m in enumerate(self.messages)]
        names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ())}
        for message in messages:  # a tool result names its tool through the call's id
            if message["role"] == "tool" and "name" not in message:
                name = names.get(message.get("tool_call_id"))
                if name is not None:
                    message["name"] = name
        return messages


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: str | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise _not_yet("suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of other than n is not supported", "best_of")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs (prompt logprobs) is not supported", "echo")

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


def parse_body(body: bytes, model: type[_Model]):
    """Bytes -> validated request, or a 400 naming what is wrong."""
    try:
        data = json.loads(body.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the body is not valid UTF-8: {exc}", code="invalid_json") from exc
    except json.JSONDecodeError as exc:
        raise APIError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(data, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc) from exc


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
                        "has tool-call syntax (Harmony); this model's has none")
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
