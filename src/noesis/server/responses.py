"""Engine outputs -> OpenAI response JSON: whole responses, and SSE chunks while streaming.

Chat and text completions differ only in how a choice looks; `ChatFormat` and `CompletionFormat`
hold those differences, and the rest (deltas, logprobs, usage, [DONE]) is shared.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from noesis.engine.outputs import RequestOutput
from noesis.server.errors import from_exception
from noesis.server.generation import Generation
from noesis.tokenizer import Tokenizer


class TokenTexts:
    """Token id -> its text, as logprobs show it (cached: the vocabulary is fixed)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = text
        return text


@dataclass
class Reply:
    """What one API call needs to format its outputs."""

    model: str
    token_text: TokenTexts
    logprobs_k: int | None
    prompt_lens: list[int]  # per choice
    echo: list[str] | None = None  # per choice: the prompt text to put before the completion
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def usage(self, outputs: list[RequestOutput | None], n: int) -> dict:
        prompt = sum(self.prompt_lens[::n])  # each prompt once, however many choices it has
        completion = sum(len(o.token_ids) for o in outputs if o is not None)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }


class ChatFormat:
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    @staticmethod
    def choice(reply: Reply, index: int, out: RequestOutput) -> dict:
        return {
            "index": index,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": _chat_logprobs(reply, out.token_ids, out.logprobs, 0),
            "finish_reason": out.finish_reason,
        }

    @staticmethod
    def first_chunks(reply: Reply, num_choices: int) -> list[dict]:
        return [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(num_choices)
        ]

    @staticmethod
    def delta(reply: Reply, index: int, text: str, out: RequestOutput, start: int, chars: int):
        return {
            "index": index,
            "delta": {"content": text} if text else {},
            "logprobs": _chat_logprobs(reply, out.token_ids, out.logprobs, start),
            "finish_reason": out.finish_reason if out.finished else None,
        }


class CompletionFormat:
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    @staticmethod
    def choice(reply: Reply, index: int, out: RequestOutput) -> dict:
        echo = reply.echo[index] if reply.echo else ""
        return {
            "index": index,
            "text": echo + out.text,
            "logprobs": _completion_logprobs(reply, out.token_ids, out.logprobs, 0, len(echo)),
            "finish_reason": out.finish_reason,
        }

    @staticmethod
    def first_chunks(reply: Reply, num_choices: int) -> list[dict]:
        if not reply.echo:
            return []
        return [
            {"index": i, "text": reply.echo[i], "logprobs": None, "finish_reason": None}
            for i in range(num_choices)
        ]

    @staticmethod
    def delta(reply: Reply, index: int, text: str, out: RequestOutput, start: int, chars: int):
        echo = len(reply.echo[index]) if reply.echo else 0
        return {
            "index": index,
            "text": text,
            "logprobs": _completion_logprobs(
                reply, out.token_ids, out.logprobs, start, echo + chars
            ),
            "finish_reason": out.finish_reason if out.finished else None,
        }


Format = type[ChatFormat] | type[CompletionFormat]


def full_response(fmt: Format, reply: Reply, outputs: list[RequestOutput], n: int) -> dict:
    return {
        "id": fmt.id_prefix + (reply.id or uuid.uuid4().hex),
        "object": fmt.object,
        "created": reply.created,
        "model": reply.model,
        "choices": [fmt.choice(reply, i, out) for i, out in enumerate(outputs)],
        "usage": reply.usage(outputs, n),
        "system_fingerprint": None,
    }


async def sse_stream(
    fmt: Format, reply: Reply, generation: Generation, n: int, include_usage: bool
) -> AsyncIterator[bytes]:
    """Server-sent events: one chunk per advance of a choice, then usage if asked, then [DONE]."""
    base = {
        "id": fmt.id_prefix + (reply.id or uuid.uuid4().hex),
        "object": fmt.chunk_object,
        "created": reply.created,
        "model": reply.model,
    }
    if include_usage:
        base["usage"] = None
    num_choices = len(generation.streams)
    sent_chars, sent_tokens = [0] * num_choices, [0] * num_choices
    try:
        for choice in fmt.first_chunks(reply, num_choices):
            yield _event(base | {"choices": [choice]})
        async for index, out in generation.outputs():
            text = out.text[sent_chars[index] :]
            if not (text or out.finished or _new_logprobs(reply, out, sent_tokens[index])):
                continue
            choice = fmt.delta(reply, index, text, out, sent_tokens[index], sent_chars[index])
            sent_chars[index], sent_tokens[index] = len(out.text), len(out.token_ids)
            yield _event(base | {"choices": [choice]})
        if include_usage:
            yield _event(base | {"choices": [], "usage": reply.usage(generation.last, n)})
    except Exception as exc:  # headers are gone: report in-band, as OpenAI does
        yield _event(from_exception(exc).body())
    yield b"data: [DONE]\n\n"


def _event(payload: dict) -> bytes:
    # ASCII-only JSON: no U+2028, NEL or other code point that a line splitter might break on
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _new_logprobs(reply: Reply, out: RequestOutput, sent: int) -> bool:
    return reply.logprobs_k is not None and len(out.token_ids) > sent


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def _chat_logprobs(reply: Reply, token_ids, logprobs, start: int) -> dict | None:
    if reply.logprobs_k is None or logprobs is None:
        return None
    content = []
    for token_id, entry in zip(token_ids[start:], logprobs[start : len(token_ids)], strict=True):
        top = [_chat_entry(reply, t, lp) for t, lp in _top(entry, reply.logprobs_k)]
        content.append(_chat_entry(reply, token_id, entry[token_id]) | {"top_logprobs": top})
    return {"content": content, "refusal": None}


def _chat_entry(reply: Reply, token_id: int, logprob: float) -> dict:
    text = reply.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _completion_logprobs(reply: Reply, token_ids, logprobs, start: int, offset: int) -> dict | None:
    if reply.logprobs_k is None or logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids[start:], logprobs[start : len(token_ids)], strict=True):
        text = reply.token_text(token_id)
        tokens.append(text)
        token_logprobs.append(entry[token_id])
        top.append({reply.token_text(t): lp for t, lp in _top(entry, reply.logprobs_k)})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
