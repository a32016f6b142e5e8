"""Tokenizer: tokenizer.json via `tokenizers`, EOS ids, the checkpoint's chat template, and an
incremental UTF-8-safe detokenizer for streaming."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from noesis.errors import ChatTemplateError, CheckpointError


class Tokenizer:
    def __init__(
        self,
        backend: HFTokenizer,
        config: dict[str, Any],
        chat_template: str | None,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        self.backend = backend
        self.config = config
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._template = None  # compiled on first use

    @classmethod
    def from_dir(cls, model_dir: Path, model_eos: tuple[int, ...] = ()) -> Tokenizer:
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{model_dir} has no tokenizer.json (needed to tokenize text)")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
        config = _read_json(model_dir / "tokenizer_config.json")
        template = _chat_template(model_dir, config)
        eos = _eos_ids(model_dir, config, backend, model_eos)
        return cls(backend, config, template, eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        if self.chat_template is None:
            raise ChatTemplateError(
                "this checkpoint has no chat template (no chat_template in tokenizer_config.json "
                "or chat_template.jinja); use generate() with a plain prompt instead"
            )
        try:
            template = self._compiled_template()
            return template.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **kwargs,
            )
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed to render: {exc}") from exc


    def _compiled_template(self):
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        return self._template


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas without splitting multi-byte characters.

    Decodes a short window (a few tokens of context + the unread tokens) so that tokenizers which
    drop a leading space at the start of a decode still render the boundary right.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens=True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = max(len(prompt_ids) - 5, 0)
        self.read_offset = len(prompt_ids)

    def step(self, all_ids: list[int]) -> str:
        """Text added by the tokens past `read_offset`; empty while a character is incomplete."""
        prefix = self._decode(all_ids[self.prefix_offset : self.read_offset])
        full = self._decode(all_ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(all_ids)
        return full[len(prefix) :]

    def flush(self, all_ids: list[int]) -> str:
        """At the end of a request: whatever is left, replacement characters included."""
        prefix = self._decode(all_ids[self.prefix_offset : self.read_offset])
        full = self._decode(all_ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(all_ids)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template}
        return named.get("default") or next(iter(named.values()), None)
    json_file = model_dir / "chat_template.json"
    if template is None and json_file.exists():
        template = _read_json(json_file).get("chat_template")
    return template


def _eos_ids(model_dir: Path, config: dict, backend: HFTokenizer, model_eos: tuple[int, ...]):
    generation = _read_json(model_dir / "generation_config.json").get("eos_token_id")
    if generation is not None:
        return (generation,) if isinstance(generation, int) else tuple(generation)
    if model_eos:
        return model_eos
    eos = _token_text(config.get("eos_token"))
    token_id = backend.token_to_id(eos) if eos else None
    return () if token_id is None else (token_id,)


def _raise(message: str):
    raise TemplateError(message)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators=None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )
