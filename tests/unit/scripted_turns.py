"""Helpers of the turn-generator tests (test_control_skip, test_control_exit): Harmony text as
token ids of the bundled tokenizer, a user question or a tool result to answer, token metrics
with a given margin."""

from __future__ import annotations

import re
from pathlib import Path

from noesis.sampling.metrics import TokenMetrics
from noesis.session import TurnRequest
from noesis.tiny import tools

TINY_DIR = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
SPECIAL = re.compile(r"(<\|[a-z_0-9]+\|>)")


def m(margin: float) -> TokenMetrics:
    return TokenMetrics(entropy=0.1, varentropy=0.0, top_k_mass=1.0, margin=margin)


def ids(encoding, text: str) -> list[int]:
    """Harmony text as token ids: special tokens by name, the rest as plain text."""
    out = []
    for part in SPECIAL.split(text):
        special = encoding.vocab.special_id(part) if part else None
        out += [special] if special is not None else encoding.encode_text(part)
    return out


def ask(role: str = "user") -> TurnRequest:
    """A question with the calculator declared; role "tool": a turn after its result."""
    messages = [{"role": "user", "content": "Yara is 4. How old is Yara?"}]
    if role == "tool":
        messages.append({"role": "tool", "name": "calculator", "content": "4"})
    return TurnRequest(messages, tools.schemas(["calculator"]), "auto", False, {})
