"""Engine outputs -> OpenAI response JSON: whole responses, and SSE chunks while streaming.

Chat and text completions differ only in how a choice looks; `ChatFormat` and `CompletionFormat`
hold those differences, and the rest (deltas, logprobs, usage, [DONE]) is shared. Streaming is
the hot path (one event per choice per engine step): the constant head of every chunk is encoded
once per response, and the choices that advanced together go out in one write.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii as json_str

from noesis.dialects import TurnFormat
from noesis.engine.outputs import RequestOutput
from noesis.harmony.encoding import HarmonyEncoding
from noesis.harmony.parser import ContentDelta, HarmonyStreamParser, MessageStart, parse_completion
from noesis.server.errors import from_exception
from noesis.server.generation import Generation
from noesis.tokenizer import Tokenizer
from noesis.turns import new_call_id

DONE = b"data: [DONE]\n\n"
# ASCII-only JSON: no U+2028, NEL or other code point that a line splitter might break on
_encoder = json.JSONEncoder(separators=(",", ":"))


def json_bytes(payload) -> bytes:
    return _encoder.encode(payload).encode()


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
    _echo_chars: dict[int, int] = field(default_factory=dict)

    def echo_offset(self, index: int, out: RequestOutput) -> int:
        """Echo: the text_offset of choice `index`'s first generated token, after its prompt's
        tokens (their texts, as logprobs show them and vLLM counts them); 0 without echo."""
        if not self.echo:
            return 0
        if index not in self._echo_chars:
            texts = map(self.token_text, out.prompt_token_ids)
            self._echo_chars[index] = sum(map(len, texts))
        return self._echo_chars[index]

    def usage(self, completion_tokens: int, n: int, cached_tokens: int = 0) -> dict:
        prompt = sum(self.prompt_lens[::n])  # each prompt once, however many choices it has
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
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
            "logprobs": _chat_logprobs(reply, out.token_ids, out.logprobs),
            "finish_reason": out.finish_reason,
        }

    @staticmethod
    def first_chunks(reply: Reply, num_choices: int) -> list[str]:
        return [
            f'{{"index":{i},"delta":{{"role":"assistant","content":""}},"logprobs":null,'
            '"finish_reason":null}'
            for i in range(num_choices)
        ]

    @staticmethod
    def message_delta(index: int, out: RequestOutput) -> dict:
        """What the delta output `out` adds to choice `index`'s message (/v1/responses reads
        replies through this too)."""
        return {"content": out.text} if out.text else {}

    @staticmethod
    def delta(reply: Reply, index: int, out: RequestOutput, offset: int) -> str:
        """One choice of a chunk, as JSON. `out` is a delta; `offset` is where its first token
        starts in the whole completion, as the logprobs' token texts count it."""
        delta = f'{{"content":{json_str(out.text)}}}' if out.text else "{}"
        logprobs = _chat_logprobs(reply, out.token_ids, out.logprobs)
        return (
            f'{{"index":{index},"delta":{delta},'
            f'"logprobs":{_encoder.encode(logprobs) if logprobs else "null"},'
            f'"finish_reason":{_reason(out)}}}'
        )


class HarmonyChatFormat(ChatFormat):
    """Chat choices of a model with a turn format (Harmony, or a text dialect whose parser emits
    the same events): the final channel is `content`, analysis is `reasoning_content`, calls to
    functions.NAME are `tool_calls` (finish_reason "tool_calls"). Streams are parsed as they
    arrive, one parser per choice; an instance serves one call (of `prompt`, which tells a text
    dialect whether the reply starts inside <think>)."""

    def __init__(
        self, encoding: HarmonyEncoding | TurnFormat, num_choices: int, prompt: list[int] = ()
    ) -> None:
        self.encoding = encoding
        self.prompt = list(prompt)
        self.parsers = [self._parser() for _ in range(num_choices)]
        self.recipients: list[str | None] = [None] * num_choices  # of the open message
        self.num_calls = [0] * num_choices

    def choice(self, reply: Reply, index: int, out: RequestOutput) -> dict:
        turn = self._parse(out.token_ids)
        calls = [_call_json(c.name, c.arguments) for c in turn.tool_calls]
        message: dict = {"role": "assistant", "content": turn.final}
        if turn.analysis:
            message["reasoning_content"] = turn.analysis
        if calls:
            message["tool_calls"] = calls
        return {
            "index": index,
            "message": message,
            "logprobs": _chat_logprobs(reply, out.token_ids, out.logprobs),
            "finish_reason": _harmony_reason(out, bool(calls)),
        }

    def message_delta(self, index: int, out: RequestOutput) -> dict:
        """What the delta output `out` adds to choice `index`'s message: content,
        reasoning_content, tool_calls (a call's first entry has its id and name), as parsed."""
        parser = self.parsers[index]
        events = [e for t in out.token_ids for e in parser.feed(t)]
        if out.finished:
            events += parser.finish()
        delta: dict = {}
        for event in events:
            self._fold(index, event, delta)
        return delta

    def delta(self, reply: Reply, index: int, out: RequestOutput, offset: int) -> str:
        delta = self.message_delta(index, out)
        logprobs = _chat_logprobs(reply, out.token_ids, out.logprobs)
        reason = _harmony_reason(out, self.num_calls[index] > 0) if out.finished else None
        if not delta and not logprobs and reason is None:
            return ""  # nothing to tell yet (say, half of a character)
        return (
            f'{{"index":{index},"delta":{_encoder.encode(delta)},'
            f'"logprobs":{_encoder.encode(logprobs) if logprobs else "null"},'
            f'"finish_reason":{_encoder.encode(reason)}}}'
        )

    def _parser(self):
        if isinstance(self.encoding, TurnFormat):
            return self.encoding.stream_parser(self.prompt)
        return HarmonyStreamParser(self.encoding)

    def _parse(self, token_ids: list[int]):
        if isinstance(self.encoding, TurnFormat):
            return self.encoding.parse(token_ids, self.prompt)
        return parse_completion(self.encoding, token_ids)

    def _fold(self, index: int, event, delta: dict) -> None:
        """One parser event into the chunk's delta."""
        if isinstance(event, MessageStart):
            self.recipients[index] = _function(event.recipient)
            if self.recipients[index] is not None:
                call = _call_json(self.recipients[index], "")
                delta.setdefault("tool_calls", []).append({"index": self.num_calls[index], **call})
                self.num_calls[index] += 1
        elif isinstance(event, ContentDelta):
            if self.recipients[index] is not None:
                calls = delta.setdefault("tool_calls", [])
                position = self.num_calls[index] - 1
                if calls and calls[-1]["index"] == position:
                    calls[-1]["function"]["arguments"] += event.text
                else:
                    calls.append({"index": position, "function": {"arguments": event.text}})
            else:
                key = "reasoning_content" if event.channel == "analysis" else "content"
                delta[key] = delta.get(key, "") + event.text


def _function(recipient: str | None) -> str | None:
    if recipient is None or recipient == "assistant":
        return None
    return recipient.removeprefix("functions.")


def _call_json(name: str, arguments: str) -> dict:
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _harmony_reason(out: RequestOutput, called: bool) -> str | None:
    return "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason


class CompletionFormat:
    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl-"

    @staticmethod
    def choice(reply: Reply, index: int, out: RequestOutput) -> dict:
        echo = reply.echo[index] if reply.echo else ""
        offset = reply.echo_offset(index, out) if reply.logprobs_k is not None else 0
        logprobs = _completion_logprobs(reply, out.token_ids, out.logprobs, offset)
        return {
            "index": index,
            "text": echo + out.text,
            "logprobs": _with_prompt(reply, out, logprobs) if echo else logprobs,
            "finish_reason": out.finish_reason,
        }

    @staticmethod
    def first_chunks(reply: Reply, num_choices: int) -> list[str]:
        """The echoed prompts, up front; with logprobs they go with each choice's first delta,
        whose output carries the prompt's logprobs."""
        if not reply.echo or reply.logprobs_k is not None:
            return []
        return [
            f'{{"index":{i},"text":{json_str(reply.echo[i])},"logprobs":null,"finish_reason":null}}'
            for i in range(num_choices)
        ]

    @staticmethod
    def delta(reply: Reply, index: int, out: RequestOutput, offset: int) -> str:
        if reply.logprobs_k is not None:
            offset += reply.echo_offset(index, out)
        logprobs = _completion_logprobs(reply, out.token_ids, out.logprobs, offset)
        text = out.text
        if reply.echo and out.prompt_logprobs is not None:  # the first delta of echo with logprobs
            text = reply.echo[index] + text
            logprobs = _with_prompt(reply, out, logprobs)
        return (
            f'{{"index":{index},"text":{json_str(text)},'
            f'"logprobs":{_encoder.encode(logprobs) if logprobs else "null"},'
            f'"finish_reason":{_reason(out)}}}'
        )


Format = type[ChatFormat] | type[CompletionFormat] | HarmonyChatFormat


def full_response(
    fmt: Format, reply: Reply, outputs: list[RequestOutput], n: int, generation: Generation
) -> dict:
    """The whole response of the choices in `outputs`; usage counts every token `generation`
    made (with best_of, the choices left out too, as OpenAI bills them)."""
    return {
        "id": fmt.id_prefix + (reply.id or uuid.uuid4().hex),
        "object": fmt.object,
        "created": reply.created,
        "model": reply.model,
        "choices": [fmt.choice(reply, i, out) for i, out in enumerate(outputs)],
        "usage": reply.usage(sum(generation.num_tokens), n, generation.cached_tokens),
        "system_fingerprint": None,
    }


class ChunkEncoder:
    """SSE events of one streamed response. Every chunk shares id, object, created and model
    (and "usage": null when usage comes at the end): those bytes are built once."""

    def __init__(self, fmt: Format, reply: Reply, include_usage: bool) -> None:
        self.head = {
            "id": fmt.id_prefix + (reply.id or uuid.uuid4().hex),
            "object": fmt.chunk_object,
            "created": reply.created,
            "model": reply.model,
        }
        self._open = b"data: " + json_bytes(self.head)[:-1] + b',"choices":['
        self._close = (b'],"usage":null}' if include_usage else b"]}") + b"\n\n"

    def choices(self, choices_json: str) -> bytes:
        return self._open + choices_json.encode() + self._close

    def usage(self, usage: dict) -> bytes:
        return b"data: " + json_bytes(self.head | {"choices": [], "usage": usage}) + b"\n\n"


async def sse_stream(
    fmt: Format, reply: Reply, generation: Generation, n: int, include_usage: bool
) -> AsyncIterator[bytes]:
    """Server-sent events: a chunk per choice that advanced, usage if asked, then [DONE].

    The choices that advanced since the last write (one engine step's worth, or several when
    this client fell behind) leave in one write; the last one carries usage and [DONE] too.
    """
    chunks = ChunkEncoder(fmt, reply, include_usage)
    offsets = [0] * len(generation.streams)  # text_offset of each choice's next token
    try:
        first = fmt.first_chunks(reply, len(generation.streams))
        if first:
            yield b"".join(chunks.choices(choice) for choice in first)
        while not generation.finished:
            events = []
            for index, out in await generation.next():
                # A turn parser reads every token, even one whose text is not complete yet.
                reads = isinstance(fmt, HarmonyChatFormat) and out.token_ids
                if out.text or out.finished or reads or (
                    reply.logprobs_k is not None and out.token_ids
                ):
                    choice = fmt.delta(reply, index, out, offsets[index])
                    if choice:
                        events.append(chunks.choices(choice))
                    if reply.logprobs_k is not None:
                        offsets[index] += sum(len(reply.token_text(t)) for t in out.token_ids)
            if generation.finished:
                if include_usage:
                    usage = reply.usage(sum(generation.num_tokens), n, generation.cached_tokens)
                    events.append(chunks.usage(usage))
                events.append(DONE)
            if events:
                yield b"".join(events)
    except Exception as exc:  # headers are gone: report in-band, as OpenAI does
        yield b"data: " + json_bytes(from_exception(exc).body()) + b"\n\n" + DONE
    finally:
        generation.close()


def _reason(out: RequestOutput) -> str:
    return f'"{out.finish_reason}"' if out.finished and out.finish_reason else "null"


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda item: -item[1])[:k]


def _chat_logprobs(reply: Reply, token_ids, logprobs) -> dict | None:
    if reply.logprobs_k is None or logprobs is None:
        return None
    content = []
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        top = [_chat_entry(reply, t, lp) for t, lp in _top(entry, reply.logprobs_k)]
        content.append(_chat_entry(reply, token_id, entry[token_id]) | {"top_logprobs": top})
    return {"content": content, "refusal": None}


def _chat_entry(reply: Reply, token_id: int, logprob: float) -> dict:
    text = reply.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _with_prompt(reply: Reply, out: RequestOutput, logprobs: dict | None) -> dict | None:
    """Echo: the prompt tokens' logprobs (from offset 0) before the completion's, when `out`
    carries them."""
    if logprobs is None or out.prompt_logprobs is None:
        return logprobs
    prompt = _completion_logprobs(reply, out.prompt_token_ids, out.prompt_logprobs, 0)
    return {key: prompt[key] + logprobs[key] for key in logprobs}


def _completion_logprobs(reply: Reply, token_ids, logprobs, offset: int) -> dict | None:
    """OpenAI's completion logprobs; an entry of None (the prompt's first token) is null."""
    if reply.logprobs_k is None or logprobs is None:
        return None
    tokens, token_logprobs, top, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, logprobs, strict=True):
        text = reply.token_text(token_id)
        tokens.append(text)
        token_logprobs.append(None if entry is None else entry[token_id])
        top.append(None if entry is None else
                   {reply.token_text(t): lp for t, lp in _top(entry, reply.logprobs_k)})
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
