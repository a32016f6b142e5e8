"""Channel trackers: which Harmony channel each generated token falls in, for speculative
decoding's per-channel counters. A small state machine per sequence over its token ids; no torch.

Harmony lays an assistant's output out as messages,
`<|start|>assistant<|channel|>NAME ...<|message|>CONTENT<|end|>` (or `<|call|>`, `<|return|>`):
a position inside CONTENT belongs to channel NAME (analysis, commentary: tool calls, final),
any other position (a header, between messages) to "header", and content whose header named no
channel or an unknown one to "other". A tokenizer without Harmony's special tokens has one
channel, "text".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

TEXT = "text"
HEADER, OTHER = "header", "other"
HARMONY_CHANNELS = ("analysis", "commentary", "final")
MAX_NAME_CHARS = 32  # a header's channel text kept past <|channel|>: names are short words


@dataclass(frozen=True, slots=True)
class HarmonyIds:
    """The special tokens the tracker reads."""

    start: int
    channel: int
    constrain: int
    message: int
    closers: frozenset[int]  # <|end|>, <|call|>, <|return|>: the message is over

    @classmethod
    def of(cls, token_to_id: Callable[[str], int | None]) -> HarmonyIds | None:
        """From a tokenizer's `token_to_id`; None unless it has every Harmony structural token."""
        names = ("start", "channel", "constrain", "message", "end", "call", "return")
        ids = {name: token_to_id(f"<|{name}|>") for name in names}
        if any(token_id is None for token_id in ids.values()):
            return None
        closers = frozenset((ids["end"], ids["call"], ids["return"]))
        return cls(ids["start"], ids["channel"], ids["constrain"], ids["message"], closers)


class ChannelScheme:
    """The channels a model's output has and a tracker factory for one sequence: Harmony's
    when the tokenizer has its special tokens, else the single channel "text"."""

    def __init__(self, ids: HarmonyIds | None = None,
                 decode: Callable[[list[int]], str] | None = None) -> None:
        if (ids is None) != (decode is None):
            raise ValueError("ChannelScheme needs both Harmony's ids and a decode, or neither")
        self.ids, self.decode = ids, decode
        self.names = (TEXT,) if ids is None else (*HARMONY_CHANNELS, HEADER, OTHER)

    @classmethod
    def of(cls, tokenizer) -> ChannelScheme:
        """For a noesis Tokenizer (token_to_id, decode)."""
        ids = HarmonyIds.of(tokenizer.token_to_id)
        if ids is None:
            return cls()
        return cls(ids, lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=False))

    def tracker(self) -> ChannelTracker:
        return ChannelTracker(self.ids, self.decode)


class ChannelTracker:
    """One sequence's position in the Harmony layout. `advance(token_ids)` consumes the ids not
    seen yet (the sequence only grows); `channel` is the channel of the next position."""

    def __init__(self, ids: HarmonyIds | None, decode: Callable[[list[int]], str] | None) -> None:
        self.ids, self.decode = ids, decode
        self.consumed = 0  # token ids seen
        self.channel = TEXT if ids is None else HEADER
        self._name: str | None = None  # header text after <|channel|> ("" once it started)
        self._naming = False  # inside a header, reading the channel's name

    def advance(self, token_ids: Sequence[int]) -> int:
        """Consume `token_ids[consumed:]`; returns how many that was."""
        new = len(token_ids) - self.consumed
        assert new >= 0, "a tracked sequence never shrinks"
        if self.ids is not None:
            for token_id in token_ids[self.consumed:]:
                self._step(token_id)
        self.consumed = len(token_ids)
        return new

    def _step(self, token_id: int) -> None:
        ids = self.ids
        if token_id == ids.message:
            self.channel, self._naming = self._content_channel(), False
        elif token_id == ids.start or token_id in ids.closers:
            self.channel, self._name, self._naming = HEADER, None, False
        elif token_id == ids.channel:  # also a lenient header missing its <|start|>
            self.channel, self._name, self._naming = HEADER, "", True
        elif token_id == ids.constrain:
            self._naming = False
        elif self._naming and len(self._name) < MAX_NAME_CHARS:
            self._name += self.decode([token_id])

    def _content_channel(self) -> str:
        words = (self._name or "").split()
        name = words[0] if words else ""
        return name if name in HARMONY_CHANNELS else OTHER
