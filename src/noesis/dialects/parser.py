"""Streaming parser for text dialects: generated text in, Harmony-shaped events out, so every reader
of turns (ParsedTurn, the server's chat format, the chat display) works for every family.

Reasoning (`<think>...</think>`) is a message on the "analysis" channel, answer text one on
"final", each call a "commentary" message to `functions.NAME` whose content is the arguments'
JSON text, streamed as it arrives. Never raises on model output: what cannot be read as a call
becomes a ParseIssue with the raw text, and the text around it is kept. Markers split across
feeds are held back until they can be told from text.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import regex

from noesis.dialects.spec import THINK_CLOSE, THINK_OPEN, Dialect
from noesis.harmony.parser import (
    ContentDelta,
    Event,
    MessageEnd,
    MessageStart,
    ParsedTurn,
    ParseIssue,
)
from noesis.tokenizer import IncrementalDetokenizer, Tokenizer

_TEXT, _THINK, _CALLS = "text", "think", "calls"
FUNCTIONS = "functions."
# The head of a call as the grammars write it: name first, then the arguments' object.
_HEAD = regex.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*[\{\[]'
)
_ASSISTANT = "assistant"


class TextTurnParser:
    """Feed decoded text; each call returns the events it completes. `in_think`: the prompt
    already opened `<think>`, so the reply starts inside the reasoning."""

    def __init__(self, dialect: Dialect, thinks: bool = False, in_think: bool = False) -> None:
        self.dialect = dialect
        self._markers = dialect.markers(thinks or in_think)
        self._mode = _THINK if in_think else _TEXT
        self._buffer = ""
        self._open: str | None = None  # channel of the open message
        self._pending_ws = ""  # whitespace held back: it ends a message or joins more text
        self._answered = False  # answer text was written (bare calls only open a reply)
        self._call: _CallObject | None = None
        self._expect = "open"  # in calls: "open" ({ or [), "next" (after a call), "item"

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while self._step(events, final=False):
            pass
        return events

    def finish(self) -> list[Event]:
        """The generation ended: flush what was held back and close what is open."""
        events: list[Event] = []
        while self._step(events, final=True):
            pass
        if self._call is not None:
            events += self._call.truncated()
            self._call = None
        elif self._mode == _CALLS and self._buffer.strip():
            events.append(ParseIssue("unfinished tool call", self._buffer))
        self._buffer = ""
        self._close(events, "return" if self._open == "final" else "truncated")
        return events

    # ------------------------------------------------------------ states

    def _step(self, events: list[Event], final: bool) -> bool:
        """Consume what can be placed now; True when more may follow from the same buffer."""
        if self._mode == _THINK:
            return self._think(events, final)
        if self._mode == _CALLS:
            return self._calls(events, final)
        return self._text_mode(events, final)

    def _text_mode(self, events: list[Event], final: bool) -> bool:
        buffer = self._buffer
        if self.dialect.bare_calls and not self._answered and self._open is None:
            stripped = buffer.lstrip()
            if stripped.startswith("{"):
                self._buffer, self._mode, self._expect = stripped, _CALLS, "item"
                return True
        found = _first_marker(buffer, self._markers)
        if found is None:
            keep = 0 if final else _held_back(buffer, self._markers)
            if self.dialect.bare_calls and not self._answered and not buffer.strip():
                keep = len(buffer)  # a reply may still open with a call
            self._text(events, buffer[: len(buffer) - keep], "final")
            self._buffer = buffer[len(buffer) - keep :]
            return False
        index, marker = found
        self._text(events, buffer[:index], "final")
        self._buffer = buffer[index + len(marker) :]
        if marker == THINK_OPEN:
            self._close(events, "end")
            self._mode = _THINK
        elif marker == self.dialect.call_open:
            self._close(events, "end")
            self._mode, self._expect = _CALLS, "open"
        else:
            events.append(ParseIssue(f"{marker} outside the part it closes", marker))
        return True

    def _think(self, events: list[Event], final: bool) -> bool:
        buffer = self._buffer
        index = buffer.find(THINK_CLOSE)
        if index < 0:
            keep = 0 if final else _held_back(buffer, (THINK_CLOSE,))
            self._text(events, buffer[: len(buffer) - keep], "analysis")
            self._buffer = buffer[len(buffer) - keep :]
            return False
        self._text(events, buffer[:index], "analysis")
        self._close(events, "end")
        self._buffer, self._mode = buffer[index + len(THINK_CLOSE) :], _TEXT
        return True

    def _calls(self, events: list[Event], final: bool) -> bool:
        if self._call is not None:
            return self._in_call(events)
        stripped = self._buffer.lstrip()
        if not stripped:
            self._buffer = ""
            return False
        head = stripped[0]
        if head == "{" and self._expect != "next":
            self._buffer, self._call = "", _CallObject(self.dialect)
            return self._in_call(events, stripped)
        if head == "[" and self._expect == "open" and self.dialect.call_list:
            self._buffer, self._expect = stripped[1:], "item"
            return True
        if self._expect == "next" and head in ",;":
            self._buffer, self._expect = stripped[1:], "item"
            return True
        return self._leave_calls(events, stripped, final)

    def _in_call(self, events: list[Event], text: str | None = None) -> bool:
        assert self._call is not None
        new_events, rest = self._call.feed(self._buffer if text is None else text)
        self._buffer = ""
        events += new_events
        if rest is None:
            return False
        if self._call.is_text:  # a bare reply that opened with `{` but is no call
            self._text(events, self._call.raw, "final")
            self._answered = True
        self._call, self._buffer, self._expect = None, rest, "next"
        return True

    def _leave_calls(self, events: list[Event], text: str, final: bool) -> bool:
        """What follows the calls: the closing marker or bracket, then text again."""
        closer = self.dialect.call_close
        if closer and closer.startswith(text) and not final:
            self._buffer = text
            return False  # maybe the start of the closing marker
        if closer and text.startswith(closer):
            text = text[len(closer) :]
        elif self.dialect.call_list and text.startswith("]"):
            text = text[1:]
        elif self._expect != "next":
            events.append(ParseIssue("expected a tool call's JSON object", text[:200]))
        self._buffer, self._mode = text, _TEXT
        return True

    # ------------------------------------------------------------ messages

    def _text(self, events: list[Event], text: str, channel: str) -> None:
        """Text of `channel`: a message opens at its first non-blank character, and trailing
        whitespace waits until more text follows (or the message closes without it)."""
        if not text:
            return
        if self._open is not None and self._open != channel:
            self._close(events, "end")
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body) :]
        if not body:
            return
        if self._open is None:
            body = body.lstrip()
            events.append(MessageStart(_ASSISTANT, channel, None, None))
            self._open = channel
        if channel == "final":
            self._answered = True
        events.append(ContentDelta(body, channel, None))

    def _close(self, events: list[Event], stop) -> None:
        if self._open is not None:
            events.append(MessageEnd(stop))
        self._open, self._pending_ws = None, ""


class _CallObject:
    """One call's JSON object, read as it arrives: its name once the head is complete, then the
    arguments' text as deltas. An object that does not open with the name is read whole at its
    end (any key order, `arguments` as JSON text)."""

    def __init__(self, dialect: Dialect) -> None:
        self.dialect = dialect
        self.raw = ""
        self.is_text = False
        self._depth, self._in_string, self._escape = 0, False, False
        self._scanned = 0
        self._name: str | None = None
        self._args_start: int | None = None
        self._args_end: int | None = None
        self._sent = 0
        self._slow = False

    def feed(self, text: str) -> tuple[list[Event], str | None]:
        """Events, and the text after the object once it closed (None while it is open)."""
        start = len(self.raw)
        self.raw += text
        end = self._scan(start)
        events = self._stream() if not self._slow else []
        if end is None:
            return events, None
        rest = self.raw[end:]
        self.raw = self.raw[:end]
        return events + self._close(), rest

    def truncated(self) -> list[Event]:
        """The generation ended inside this call."""
        if self._name is None:
            return [ParseIssue("unfinished tool call", self.raw)]
        self._args_end = None
        events = self._stream()
        return events + [MessageEnd("truncated"), ParseIssue("unfinished tool call", self.raw)]

    def _scan(self, start: int) -> int | None:
        """Track depth over new characters; the end offset once the object closes."""
        for index in range(start, len(self.raw)):
            char = self.raw[index]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 1 and self._args_end is None:
                    self._args_end = index + 1  # the first value nested in the call closed
                if self._depth == 0:
                    return index + 1
        return None

    def _stream(self) -> list[Event]:
        events: list[Event] = []
        if self._name is None:
            match = _HEAD.match(self.raw, partial=True)
            if match is None:
                self._slow = True
                return events
            if match.partial:
                return events
            self._name = _json_string(match.group(1))
            self._args_start = match.end() - 1
            recipient = FUNCTIONS + self._name
            events.append(MessageStart(_ASSISTANT, "commentary", recipient, "json"))
        upto = self._args_end if self._args_end is not None else len(self.raw)
        start = max(self._sent, self._args_start or 0)
        if upto > start:
            delta = self.raw[start:upto]
            events.append(ContentDelta(delta, "commentary", FUNCTIONS + self._name))
            self._sent = upto
        return events

    def _close(self) -> list[Event]:
        if self._name is not None:
            events = self._stream() + [MessageEnd("call")]
            if not _is_json(self.raw[self._args_start : self._args_end]):
                events.append(ParseIssue("tool call arguments are not valid JSON", self.raw))
            return events
        call = _read_call(self.raw)
        if call is None:
            if self.dialect.bare_calls:
                self.is_text = True
                return []
            return [ParseIssue('a tool call that is not {"name": ..., arguments}', self.raw)]
        name, arguments = call
        recipient = FUNCTIONS + name
        return [
            MessageStart(_ASSISTANT, "commentary", recipient, "json"),
            ContentDelta(arguments, "commentary", recipient),
            MessageEnd("call"),
        ]


class TokenTurnParser:
    """Token ids in (special tokens decoded as their spelling, end tokens dropped), events out:
    the same feed/feed_all/finish as noesis.harmony.parser.HarmonyStreamParser."""

    def __init__(self, tokenizer: Tokenizer, text_parser: TextTurnParser, end_ids) -> None:
        self.text = text_parser
        self._end_ids = frozenset(end_ids)
        self._ids: list[int] = []
        self._detokenizer = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
        self._vocab_size = tokenizer.vocab_size

    def feed(self, token_id: int) -> list[Event]:
        if not isinstance(token_id, int) or not 0 <= token_id < self._vocab_size:
            return [ParseIssue(f"token id {token_id!r} is not in the vocabulary", str(token_id))]
        if token_id in self._end_ids:
            return []
        self._ids.append(token_id)
        return self.text.feed(self._detokenizer.step(self._ids))

    def feed_all(self, token_ids: Iterable[int]) -> list[Event]:
        return [event for token_id in token_ids for event in self.feed(token_id)]

    def finish(self) -> list[Event]:
        return self.text.feed(self._detokenizer.flush(self._ids)) + self.text.finish()


def parse_events(parser, token_ids: Iterable[int]) -> ParsedTurn:
    """A whole generation through a fresh token parser."""
    turn = ParsedTurn()
    for event in parser.feed_all(token_ids) + parser.finish():
        turn.add(event)
    return turn


def parse_text(
    dialect: Dialect, text: str, thinks: bool = True, in_think: bool = False
) -> ParsedTurn:
    """A whole generated text (special tokens spelled out), parsed."""
    parser = TextTurnParser(dialect, thinks, in_think)
    turn = ParsedTurn()
    for event in parser.feed(text) + parser.finish():
        turn.add(event)
    return turn


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    found = [(text.find(m), m) for m in markers]
    found = [(index, m) for index, m in found if index >= 0]
    return min(found, key=lambda item: (item[0], -len(item[1]))) if found else None


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins a marker (it may complete next feed)."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-length:]):
                longest = length
                break
    return longest


def _json_string(body: str) -> str:
    try:
        return json.loads(f'"{body}"')
    except json.JSONDecodeError:
        return body


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return False
    return True


def _read_call(raw: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of a whole call object in any key order; None if it is none."""
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)
