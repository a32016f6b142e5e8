"""Streaming Harmony parser: token ids in, message events out, lenient where real models deviate.

Never raises on model output: what it cannot place becomes a ParseIssue carrying the raw text.
Tolerated: a tool call on any channel; a content type without <|constrain|> (`final json`);
channel and recipient in either order; a stop token right after a message's end; a first header
whose `<|start|>assistant` is in the prompt; a header missing its <|start|>; text outside messages;
end of sequence inside a message. Content is decoded incrementally, so a character split across
byte-level tokens is emitted whole.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from noesis.harmony.encoding import HarmonyEncoding

Stop = Literal["end", "call", "return", "eos", "truncated"]
FUNCTIONS = "functions."
CHANNEL_MARK, CONSTRAIN_MARK = "<|channel|>", "<|constrain|>"


@dataclass(frozen=True, slots=True)
class MessageStart:
    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None  # "json" whether or not the header had <|constrain|>


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str
    channel: str | None
    recipient: str | None


@dataclass(frozen=True, slots=True)
class MessageEnd:
    stop: Stop  # eos: an end-of-text token inside the message; truncated: closed by anything else


@dataclass(frozen=True, slots=True)
class ParseIssue:
    message: str
    raw: str


Event = MessageStart | ContentDelta | MessageEnd | ParseIssue

_OUTSIDE, _HEADER, _CONTENT = "outside", "header", "content"
_STOPS: dict[str, Stop] = {"<|end|>": "end", "<|call|>": "call", "<|return|>": "return"}


class HarmonyStreamParser:
    """Feed token ids one at a time; each call returns the events that token completes.

    `role` is the role whose header the prompt already opened (`<|start|>assistant`): parsing then
    starts inside that header. None starts outside any message.
    """

    def __init__(self, encoding: HarmonyEncoding, role: str | None = "assistant") -> None:
        self.encoding = encoding
        self._kinds = _token_kinds(encoding)
        self._role_hint = role
        self._state = _HEADER if role else _OUTSIDE
        self._header = bytearray()
        self._stray = bytearray()  # text outside any message
        self._start: MessageStart | None = None
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._just_ended = False

    def feed(self, token_id: int) -> list[Event]:
        raw = self.encoding.vocab.token_bytes(token_id) if isinstance(token_id, int) else None
        if raw is None:
            return [ParseIssue(f"token id {token_id!r} is not in the vocabulary", str(token_id))]
        kind = self._kinds.get(token_id, "text")
        if self._state == _CONTENT:
            events = self._in_content(kind, raw)
        elif self._state == _HEADER:
            events = self._in_header(kind, raw)
        else:
            events = self._outside(kind, raw)
        self._just_ended = bool(events) and isinstance(events[-1], MessageEnd)
        return events

    def feed_all(self, token_ids: Iterable[int]) -> list[Event]:
        return [event for token_id in token_ids for event in self.feed(token_id)]

    def finish(self) -> list[Event]:
        """The generation ended: close what is open."""
        if self._state == _CONTENT:
            events = self._close("truncated")
        elif self._state == _HEADER and self._header.strip():
            events = [ParseIssue("generation ended inside a message header", self._header_text())]
        else:
            events = self._flush_stray()
        self._state, self._header, self._role_hint = _OUTSIDE, bytearray(), None
        return events

    # ------------------------------------------------------------ states

    def _outside(self, kind: str, raw: bytes) -> list[Event]:
        if kind == "text":
            self._stray += raw
            return []
        if kind == "start":
            events = self._flush_stray()
            self._open_header(None)
            return events
        if kind in ("channel", "constrain", "message"):
            return self._header_without_start(kind, raw)
        events = self._flush_stray()
        if kind == "stop" and not self._just_ended:
            events.append(ParseIssue("stop token outside any message", _text(raw)))
        elif kind == "special":
            events.append(ParseIssue("unexpected special token outside any message", _text(raw)))
        return events  # an end of text, or a stray stop right after a message's end

    def _header_without_start(self, kind: str, raw: bytes) -> list[Event]:
        """`assistant<|channel|>final<|message|>` with no <|start|>: read the stray text as the
        header of a message."""
        header = bytes(self._stray)
        self._stray = bytearray()
        issue = ParseIssue("message header without <|start|>", _text(header + raw))
        self._open_header(None)
        self._header += header
        return [issue, *self._in_header(kind, raw)]

    def _in_header(self, kind: str, raw: bytes) -> list[Event]:
        if kind in ("text", "channel", "constrain"):
            self._header += raw
            return []
        if kind == "message":
            return self._begin_content()
        header = self._header_text()
        if kind == "start":
            self._open_header(None)
            return (
                [ParseIssue("message header abandoned by a new <|start|>", header)]
                if header.strip()
                else []
            )
        if kind == "special":
            return [ParseIssue("unexpected special token in a message header", _text(raw))]
        self._state, self._header = _OUTSIDE, bytearray()
        return [ParseIssue(f"message header closed by {_text(raw)} before <|message|>", header)]

    def _in_content(self, kind: str, raw: bytes) -> list[Event]:
        if kind == "text":
            return self._delta(self._decoder.decode(raw))
        if kind == "stop":
            return self._close(_STOPS[_text(raw)])
        if kind == "eos":
            return self._close("eos")
        if kind == "start":
            events = [ParseIssue("message not closed before a new <|start|>", _text(raw))]
            events += self._close("truncated")
            self._open_header(None)
            return events
        return [ParseIssue("special token inside message content", _text(raw))]

    # ------------------------------------------------------------ transitions

    def _open_header(self, role_hint: str | None) -> None:
        self._state, self._header, self._role_hint = _HEADER, bytearray(), role_hint

    def _begin_content(self) -> list[Event]:
        start, issues = parse_header(self._header_text(), self._role_hint)
        self._start, self._state, self._header = start, _CONTENT, bytearray()
        self._decoder.reset()
        return [*issues, start]

    def _close(self, stop: Stop) -> list[Event]:
        events = self._delta(self._decoder.decode(b"", final=True))
        self._state, self._start = _OUTSIDE, None
        return [*events, MessageEnd(stop)]

    def _delta(self, text: str) -> list[Event]:
        if not text:
            return []
        assert self._start is not None
        return [ContentDelta(text, self._start.channel, self._start.recipient)]

    def _flush_stray(self) -> list[Event]:
        text = _text(self._stray)
        self._stray = bytearray()
        return [ParseIssue("text outside any message", text)] if text.strip() else []

    def _header_text(self) -> str:
        return _text(self._header)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _token_kinds(encoding: HarmonyEncoding) -> dict[int, str]:
    """Kind of every special token; ids not listed are text."""
    special = encoding.special
    kinds = {
        special.start: "start",
        special.message: "message",
        special.channel: "channel",
        special.constrain: "constrain",
        special.end: "stop",
        special.return_: "stop",
        special.call: "stop",
    }
    if special.endoftext is not None:
        kinds[special.endoftext] = "eos"
    return {**{token_id: "special" for token_id in encoding.vocab.special_ids()}, **kinds}


# ---------------------------------------------------------------- headers


def parse_header(header: str, role_hint: str | None) -> tuple[MessageStart, list[ParseIssue]]:
    """Role, channel, recipient and content type of a header, in whatever order they come."""
    words = (
        header.replace(CHANNEL_MARK, f" {CHANNEL_MARK} ")
        .replace(CONSTRAIN_MARK, f" {CONSTRAIN_MARK} ")
        .split()
    )
    issues: list[ParseIssue] = []
    role = role_hint
    if words and words[0] == role_hint:
        words.pop(0)  # the model repeated the role the prompt already wrote
    elif role is None and words and _is_name(words[0]):
        role = words.pop(0)
    if role is None:
        issues.append(ParseIssue("message header has no role; read as assistant", header))
        role = "assistant"
    fields, leftover = _fields(words)
    if fields.get("content_type") is None and len(leftover) == 1:
        # `final json`: a content type written without <|constrain|>
        fields["content_type"] = leftover.pop()
    if leftover:
        issues.append(ParseIssue("unexpected words in a message header", header))
    for name in [k for k, v in fields.items() if v == ""]:
        issues.append(ParseIssue(f"message header has an empty {name}", header))
        fields[name] = None
    start = MessageStart(
        role, fields.get("channel"), fields.get("recipient"), fields.get("content_type")
    )
    return start, issues


def _fields(words: list[str]) -> tuple[dict[str, str | None], list[str]]:
    fields: dict[str, str | None] = {}
    leftover = []
    index = 0
    while index < len(words):
        word = words[index]
        if word in (CHANNEL_MARK, CONSTRAIN_MARK):
            value = words[index + 1] if index + 1 < len(words) else ""
            value = "" if value in (CHANNEL_MARK, CONSTRAIN_MARK) else value
            fields["channel" if word == CHANNEL_MARK else "content_type"] = value
            index += 2 if value else 1
            continue
        if word.startswith("to="):
            fields["recipient"] = word[3:]
        else:
            leftover.append(word)
        index += 1
    return fields, leftover


def _is_name(word: str) -> bool:
    return word not in (CHANNEL_MARK, CONSTRAIN_MARK) and not word.startswith("to=")


# ---------------------------------------------------------------- whole completions


@dataclass(slots=True)
class ParsedMessage:
    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None
    content: str = ""
    stop: Stop | None = None  # None while the message is still open


@dataclass(frozen=True, slots=True)
class ToolCall:
    recipient: str  # e.g. "functions.lookup"
    name: str  # the recipient without "functions."
    arguments: str  # the JSON text as the model wrote it
    channel: str | None  # commentary, or analysis when the model called from there
    content_type: str | None


@dataclass
class ParsedTurn:
    """Everything one generation wrote: its messages, and what can't be read as Harmony."""

    messages: list[ParsedMessage] = field(default_factory=list)
    issues: list[ParseIssue] = field(default_factory=list)

    def add(self, event: Event) -> None:
        """Fold one parser event in."""
        if isinstance(event, MessageStart):
            self.messages.append(
                ParsedMessage(event.role, event.channel, event.recipient, event.content_type)
            )
        elif isinstance(event, ContentDelta):
            self.messages[-1].content += event.text
        elif isinstance(event, MessageEnd):
            self.messages[-1].stop = event.stop
        else:
            self.issues.append(event)

    @property
    def analysis(self) -> str:
        parts = [m.content for m in self.messages if m.channel == "analysis" and not m.recipient]
        return "\n".join(parts)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [
            ToolCall(
                m.recipient,
                m.recipient.removeprefix(FUNCTIONS),
                m.content,
                m.channel,
                m.content_type,
            )
            for m in self.messages
            if m.recipient and m.role == "assistant" and m.recipient != "assistant"
        ]

    @property
    def final(self) -> str | None:
        finals = [m for m in self.messages if m.channel == "final" and not m.recipient]
        return finals[-1].content if finals else None

    @property
    def content_type(self) -> str | None:
        """The final answer's content type (e.g. "json"), if it declared one."""
        finals = [m for m in self.messages if m.channel == "final" and not m.recipient]
        return finals[-1].content_type if finals else None


def parse_completion(
    encoding: HarmonyEncoding, token_ids: Iterable[int], role: str | None = "assistant"
) -> ParsedTurn:
    """Parse a whole generation (see HarmonyStreamParser for `role`)."""
    parser = HarmonyStreamParser(encoding, role)
    turn = ParsedTurn()
    for token_id in token_ids:
        for event in parser.feed(token_id):
            turn.add(event)
    for event in parser.finish():
        turn.add(event)
    return turn


def parse_text(encoding: HarmonyEncoding, text: str, role: str | None = "assistant") -> ParsedTurn:
    """Parse generated text in which special tokens are spelled out (`<|call|>`), as another
    runtime's decode with special tokens kept writes it: each spelling is read as its token."""
    return parse_completion(encoding, spelled_ids(encoding, text), role)


def spelled_ids(encoding: HarmonyEncoding, text: str) -> list[int]:
    """Token ids of text in which special tokens are spelled out (`<|call|>`)."""
    token_ids: list[int] = []
    for piece in _SPECIAL_SPELLING.split(text):
        special = encoding.vocab.special_id(piece) if _SPECIAL_SPELLING.fullmatch(piece) else None
        token_ids += [special] if special is not None else encoding.encode_text(piece)
    return token_ids


_SPECIAL_SPELLING = re.compile(r"(<\|[a-z_]+\|>)")
