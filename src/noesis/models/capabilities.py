"""Capabilities: what a model takes in (text, images, audio), the message content parts each one
reads, and the checks of a load and of a conversation against what was loaded. No torch here.

A checkpoint declares its capabilities (ModelConfig.capabilities, from models/config.py's
CAPABILITIES); a load asks for some of them (EngineConfig.capabilities). noesis runs text models
only: a vision-language checkpoint loads its text model, its vision weights never read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from noesis.errors import ConfigError, InvalidRequest

CAPABILITY_NAMES = ("text", "vision", "audio")
RUNNABLE = ("text",)  # what noesis can load today: it has no vision or audio encoder
# Chat content part types (OpenAI chat and Responses, Hugging Face processors) that carry
# something other than text -> the capability that reads them.
PART_CAPABILITY = {
    "image_url": "vision",
    "image": "vision",
    "input_image": "vision",
    "input_audio": "audio",
    "audio": "audio",
}
_WHAT = {"vision": "an image", "audio": "audio"}
_INSTEAD = {"vision": "describe the image in words", "audio": "transcribe it to text first"}


def check_load(requested: Sequence[str], available: Sequence[str], architecture: str) -> None:
    """ConfigError unless every capability asked for is one the checkpoint has and noesis runs;
    called once config.json is read, before any weight."""
    for name in requested:
        if name not in available:
            raise ConfigError(
                f"capabilities: this {architecture} checkpoint has no {name} capability; it has "
                f"{', '.join(available)}"
            )
    for name in requested:
        if name not in RUNNABLE:
            raise ConfigError(
                f"capabilities: {name} is not supported yet: noesis has no {name} encoder and "
                f"loads this checkpoint's text model alone; ask for capabilities=('text',) "
                f"(--capabilities text)"
            )


def refusal(part_type: Any, loaded: Sequence[str]) -> str | None:
    """Why a content part of `part_type` cannot be read by a model loaded with `loaded`
    capabilities (None: it can, or it is no input of a capability: text and unknown types)."""
    capability = PART_CAPABILITY.get(part_type) if isinstance(part_type, str) else None
    if capability is None or capability in loaded:
        return None
    loaded_as = "text-only" if tuple(loaded) == ("text",) else f"with {', '.join(loaded)}"
    return (
        f"{_WHAT[capability]} input ({part_type!r}) needs the {capability} capability, and this "
        f"model was loaded {loaded_as} (noesis has no {capability} encoder yet): "
        f"{_INSTEAD[capability]} and send text parts only"
    )


def check_messages(messages: Any, loaded: Sequence[str]) -> None:
    """InvalidRequest naming the first content part of `messages` (chat messages, as the chat
    template takes them) that a model loaded with `loaded` capabilities cannot read."""
    if not isinstance(messages, list):
        return  # the template's own checks name a malformed conversation
    for index, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for part_index, part in enumerate(content):
            reason = refusal(part.get("type"), loaded) if isinstance(part, dict) else None
            if reason is not None:
                raise InvalidRequest(f"messages[{index}].content[{part_index}]: {reason}")
