"""The OpenAI Responses API (/v1/responses): a Responses body becomes the chat route's request.

Input items become chat messages, function tools and tool_choice the chat shapes, text.format a
response_format; the chat route's machinery (template, turn format and grammar, Generation) runs
it, and its reply, read by the chat format's parser, becomes output items: reasoning, message
(output_text), function_call. Streamed, the same items grow through Responses' SSE events. No
response is stored, so previous_response_id is refused: send the conversation as input items.
This module imports no torch: a large body is validated in a worker process (server/bodies.py).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pydantic import Field, ValidationError

from noesis.sampling.params import INT64_MAX
from noesis.server.errors import APIError, from_exception
from noesis.server.protocol import ChatCompletionRequest, _Model, check_schema, refused_input

_encoder = json.JSONEncoder(separators=(",", ":"))  # ASCII-only, as the chat streams
_PART_TEXT = ("input_text", "output_text", "text")  # text parts of a message item
# Declared so that a request setting them is refused by name, not silently ignored.
_REFUSED = {
    "previous_response_id": "this server stores no responses: send the whole conversation as "
                            "input items",
    "conversation": "this server stores no conversations: send them as input items",
    "background": "responses run in the foreground here",
    "include": "no extra output data (encrypted reasoning, logprobs, sources) is available",
    "prompt": "this server has no stored prompt templates",
    "top_logprobs": "logprobs are offered on /v1/chat/completions and /v1/completions",
    "max_tool_calls": "tool calls are not counted across a response here",
}


class ResponsesRequest(_Model):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    truncation: str | None = None
    # No-ops, as on the chat route: they never change the output.
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    include: list[str] | None = None
    prompt: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None

    def check_limits(self, limits) -> None:
        """The chat request it becomes is held to the chat route's limits."""
        self.chat_request().check_limits(limits)
        for index, tool in enumerate(self.tools or ()):
            if "parameters" in tool:
                check_schema(f"tools[{index}].parameters", tool["parameters"], limits)

    def chat_request(self) -> ChatCompletionRequest:
        """The chat route's request for this one; a 400 naming any field it cannot honour."""
        self._refuse_unsupported()
        fields = {
            "model": self.model, "messages": self._messages(),
            "max_completion_tokens": self.max_output_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "tools": self._tools(), "tool_choice": self._tool_choice(),
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": self._response_format(), "stream": self.stream,
            "user": self.user, "safety_identifier": self.safety_identifier,
            "prompt_cache_key": self.prompt_cache_key, "service_tier": self.service_tier,
            "reasoning_effort": (self.reasoning or {}).get("effort"),
        }  # fmt: skip
        try:
            chat = ChatCompletionRequest.model_validate(fields)
        except ValidationError as exc:  # an input item's shape, as the chat messages see it
            raise APIError(400, f"input: {exc.errors(include_url=False)[0]['msg']}", "input",
                           "invalid_value") from exc
        chat.refuse_unsupported()
        return chat

    def _refuse_unsupported(self) -> None:
        for name, why in _REFUSED.items():
            if getattr(self, name) not in (None, False, []):
                raise APIError(400, f"{name} is not supported: {why}", name,
                               "unsupported_parameter")
        if self.store:
            raise APIError(400, "store: this server keeps no responses; send false or leave it "
                           "out", "store", "unsupported_value")
        if self.truncation not in (None, "disabled"):
            raise APIError(400, "truncation: only 'disabled' is supported (a prompt over the "
                           "context is a 400)", "truncation", "unsupported_value")
        extra = sorted(set(self.reasoning or {}) - {"effort"})
        if extra:
            raise APIError(400, f"reasoning.{extra[0]} is not supported (only reasoning.effort, "
                           "for a chat template that reads it)", f"reasoning.{extra[0]}",
                           "unsupported_parameter")
        extra = sorted(set(self.text or {}) - {"format"})
        if extra:
            raise APIError(400, f"text.{extra[0]} is not supported", f"text.{extra[0]}",
                           "unsupported_parameter")

    def _messages(self) -> list[dict[str, Any]]:
        """instructions, then the input items, as chat messages (consecutive function calls
        become one assistant message, as parallel calls are)."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) \
            else self.input
        if not items:
            raise APIError(400, "input: must not be empty", "input", "invalid_value")
        for index, item in enumerate(items):
            param, kind = f"input[{index}]", item.get("type", "message")
            if kind == "message":
                role, content = item.get("role"), _item_text(param, item.get("content"))
                messages.append({"role": role, "content": content})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"),
                                     "arguments": item.get("arguments", "{}")}}  # fmt: skip
                last = messages[-1] if messages else {}
                if last.get("role") == "assistant" and last.get("tool_calls"):
                    last["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": _item_text(f"{param}.output", item.get("output"))})
            else:
                refused_input(f"{param}.type", kind)  # an image or audio part as an item
                raise APIError(400, f"{param}.type: {_shown(kind)} items are not supported "
                               "(message, function_call, function_call_output)",
                               f"{param}.type", "unsupported_value")
        return messages

    def _tools(self) -> list[dict[str, Any]] | None:
        if self.tools is None:
            return None
        tools = []
        for index, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                raise APIError(400, f"tools[{index}].type: only function tools are supported, "
                               f"got {_shown(tool.get('type'))}", f"tools[{index}].type",
                               "unsupported_value")
            function = {k: tool[k] for k in ("name", "description", "parameters", "strict")
                        if tool.get(k) is not None}  # fmt: skip
            tools.append({"type": "function", "function": function})
        return tools

    def _tool_choice(self) -> str | dict[str, Any] | None:
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return choice
        if choice.get("type") != "function":
            raise APIError(400, f"tool_choice: {_shown(choice.get('type'))} is not supported "
                           "(auto, none, required, or a function by name)", "tool_choice",
                           "unsupported_value")
        return {"type": "function", "function": {"name": choice.get("name")}}

    def _response_format(self) -> dict[str, Any] | None:
        """text.format -> the chat route's response_format."""
        fmt = (self.text or {}).get("format")
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_schema":
            inner = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            return {"type": "json_schema", "json_schema": inner}
        return fmt  # json_object, or a type the chat route refuses by name


def _item_text(param: str, content: Any) -> str:
    """A message item's content (a string, or text parts) as one string."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{param}: must be a string or a list of text parts", param,
                       "invalid_value")
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _PART_TEXT \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else part
            refused_input(f"{param}[{index}]", kind)
            raise APIError(400, f"{param}[{index}]: only text parts are supported, got "
                           f"{_shown(kind)}", f"{param}[{index}]", "unsupported_value")
        texts.append(part["text"])
    return "".join(texts)


class OutputItems:
    """The output items of one response, grown from the chat format's message deltas; each
    growth step returns the Responses SSE events that tell it."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item receiving deltas
        self.sequence = 0

    def event(self, kind: str, **fields) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {_encoder.encode(payload)}\n\n".encode()

    def add(self, delta: dict[str, Any]) -> list[bytes]:
        """A chat message delta (reasoning_content, content, tool_calls), in that order."""
        events = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            if "id" in call:  # a call's first delta names it
                events += self._close() + self._open(_call_item(call))
            events += self._arguments(call["function"].get("arguments") or "")
        return events

    def close(self) -> list[bytes]:
        """Finish the open item (the reply ended)."""
        return self._close()

    def _text(self, kind: str, text: str) -> list[bytes]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events += self._close() + self._open(_text_item(kind))
        item = self.open
        item["content"][0]["text"] += text
        where = self._where(item)
        if kind == "message":
            return events + [self.event("response.output_text.delta", **where, delta=text,
                                        logprobs=[])]  # fmt: skip
        return events + [self.event("response.reasoning_text.delta", **where, delta=text)]

    def _arguments(self, text: str) -> list[bytes]:
        if not text:
            return []
        self.open["arguments"] += text
        return [self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                           output_index=len(self.items) - 1, delta=text)]  # fmt: skip

    def _open(self, item: dict[str, Any]) -> list[bytes]:
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        events = [self.event("response.output_item.added", output_index=index, item=_copy(item))]
        if "content" in item:
            events.append(self.event("response.content_part.added", **self._where(item),
                                     part=_copy(item["content"][0])))  # fmt: skip
        return events

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = "completed"
        index = len(self.items) - 1
        events = []
        if item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                     output_index=index, name=item["name"],
                                     arguments=item["arguments"]))  # fmt: skip
        else:
            part, where = item["content"][0], self._where(item)
            if item["type"] == "message":
                events.append(self.event("response.output_text.done", **where, text=part["text"],
                                         logprobs=[]))  # fmt: skip
            else:
                events.append(self.event("response.reasoning_text.done", **where,
                                         text=part["text"]))  # fmt: skip
            events.append(self.event("response.content_part.done", **where, part=_copy(part)))
        return events + [self.event("response.output_item.done", output_index=index,
                                    item=_copy(item))]  # fmt: skip

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}


def _text_item(kind: str) -> dict[str, Any]:
    if kind == "message":
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                "role": "assistant", "content": [part]}
    return {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "status": "in_progress",
            "summary": [], "content": [{"type": "reasoning_text", "text": ""}]}


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": "", "status": "in_progress"}


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    return json.loads(_encoder.encode(value))


class ResponseReply:
    """One /v1/responses call being answered: the response object, whole or as SSE events.

    `fmt` is the chat route's format for the turn (its `message_delta` reads the reply);
    `reply` the chat Reply it formats with; `generation` the one engine request."""

    def __init__(self, body: ResponsesRequest, fmt, reply, generation, temperature: float,
                 top_p: float) -> None:
        self.body = body
        self.fmt = fmt
        self.reply = reply
        self.generation = generation
        self.sampling = {"temperature": temperature, "top_p": top_p}
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.output = OutputItems()

    def whole(self, out) -> dict[str, Any]:
        """The response to a finished output."""
        self.output.add(self.fmt.choice(self.reply, 0, out)["message"])
        self.output.close()
        return self.response(out.finish_reason)

    async def events(self) -> AsyncIterator[bytes]:
        """Responses' SSE events: created, in_progress, the items' events as the reply grows,
        then completed (or incomplete at max_output_tokens); an error event if it fails."""
        output, generation = self.output, self.generation
        try:
            yield output.event("response.created", response=self.response(None)) + \
                output.event("response.in_progress", response=self.response(None))
            while not generation.finished:
                events = []
                for _, out in await generation.next():
                    events += output.add(self.fmt.message_delta(0, out))
                    if out.finished:
                        events += output.close()
                        kind = "response.incomplete" if out.finish_reason == "length" \
                            else "response.completed"
                        events.append(output.event(kind, response=self.response(out.finish_reason)))
                if events:
                    yield b"".join(events)
        except Exception as exc:  # headers are gone: report in-band, as OpenAI does
            error = from_exception(exc)
            yield output.event("error", code=error.code, message=error.message, param=error.param)
        finally:
            generation.close()

    def response(self, finish_reason: str | None) -> dict[str, Any]:
        """The response object: in progress (None), completed, or incomplete at the length."""
        body = self.body
        status = {None: "in_progress", "length": "incomplete", "stop": "completed"}.get(
            finish_reason, "failed")
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete"
            else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": self.reply.model, "output": _copy({"o": self.output.items})["o"],
            "parallel_tool_calls": body.parallel_tool_calls,
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
            "text": body.text or {"format": {"type": "text"}}, "metadata": body.metadata or {},
            "store": False, "truncation": "disabled", "previous_response_id": None,
            "reasoning": {"effort": (body.reasoning or {}).get("effort"), "summary": None},
            "user": body.user, "usage": self._usage() if finish_reason else None,
            **self.sampling,
        }  # fmt: skip

    def _usage(self) -> dict[str, Any]:
        generation = self.generation
        prompt, generated = generation.prompt_lens[0], sum(generation.num_tokens)
        return {"input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": generation.cached_tokens},
                "output_tokens": generated, "total_tokens": prompt + generated}


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"
