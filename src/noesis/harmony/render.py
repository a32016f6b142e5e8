"""Rendering: Harmony messages to pieces (special tokens and text), and pieces to token ids.

Text pieces are encoded one by one, as openai_harmony does (role, ` to=...`, channel, content type
and content separately), so the ids match its rendering exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from noesis.errors import InvalidRequest
from noesis.harmony.layout import Layout
from noesis.harmony.messages import ROLES, Message

if TYPE_CHECKING:
    from noesis.harmony.encoding import HarmonyEncoding

CONSTRAIN = "<|constrain|>"


class Special(str):
    """A piece that is one special token (its spelling), not text to encode."""


START, END, MESSAGE = Special("<|start|>"), Special("<|end|>"), Special("<|message|>")
CHANNEL, RETURN, CALL = Special("<|channel|>"), Special("<|return|>"), Special("<|call|>")


def conversation(
    messages: Sequence[Message], layout: Layout, for_completion: bool, next_role: str
) -> list[str]:
    if next_role not in ROLES:
        raise InvalidRequest(f"next_role {next_role!r} is not one of {ROLES}")
    kept = _drop_past_analysis(messages) if layout.drop_past_analysis else list(messages)
    pieces: list[str] = []
    for message in kept:
        pieces += message_pieces(message, layout)
    if for_completion:
        pieces += [START, next_role]
    elif kept and _is_final(kept[-1]):
        pieces[-1] = RETURN  # the training form: the turn's last answer closes the sampling
    return pieces


def message_pieces(message: Message, layout: Layout) -> list[str]:
    """`<|start|>` header `<|message|>` content, closed by <|call|> for an assistant's tool call."""
    if message.role == "tool":
        pieces: list[str] = [START, message.name or ""]
    else:
        pieces = [START, message.role + (f":{message.name}" if message.name else "")]
    recipient = [f" to={message.recipient}"] if message.recipient not in (None, "all") else []
    channel = [CHANNEL, message.channel] if message.channel is not None else []
    if layout.recipient_after_channel and message.role == "assistant":
        pieces += channel + recipient
    else:
        pieces += recipient + channel
    pieces += _content_type(message.content_type)
    pieces += [MESSAGE, message.content]
    calls = message.role == "assistant" and message.recipient is not None
    return [*pieces, CALL if calls else END]


def _content_type(content_type: str | None) -> list[str]:
    if content_type is None:
        return []
    if content_type.startswith(CONSTRAIN):
        rest = content_type[len(CONSTRAIN) :]
        return [" ", Special(CONSTRAIN)] + ([rest] if rest else [])
    return [f" {content_type}"]


def to_ids(pieces: Sequence[str], encoding: HarmonyEncoding) -> list[int]:
    ids: list[int] = []
    for piece in pieces:
        if isinstance(piece, Special):
            ids.append(encoding.token_id(piece))
        elif piece:
            ids += encoding.encode_text(piece)
    return ids


def _is_final(message: Message) -> bool:
    return message.role == "assistant" and message.channel == "final"


def _drop_past_analysis(messages: Sequence[Message]) -> list[Message]:
    """openai_harmony's auto_drop_analysis, rule for rule."""
    last_assistant = next((m for m in reversed(messages) if m.role == "assistant"), None)
    if last_assistant is None or last_assistant.channel != "final":
        return list(messages)
    first_final = next((i for i, m in enumerate(messages) if m.channel == "final"), len(messages))
    return [m for i, m in enumerate(messages) if not (i < first_final and m.channel == "analysis")]
