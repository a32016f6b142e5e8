"""Tokenizer: tokenizer.json via `tokenizers`, EOS ids, the checkpoint's chat template (rendered
and encoded so that only the template writes control tokens), and an incremental UTF-8-safe
detokenizer for streaming."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from noesis.errors import ChatTemplateError, CheckpointError, InvalidRequest
from noesis.weights.files import (
    CONFIG_MAX_BYTES,
    TOKENIZER_MAX_BYTES,
    read_json_file,
    read_text_file,
    regular_file_size,
)


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
        self._control_tokens: ControlTokens | None = None  # built on first use
        # gpt-oss: conversations rendered by noesis.harmony (the ids openai-harmony renders)
        # instead of a Jinja template; see render_with_harmony.
        self.harmony: Any = None

    @classmethod
    def from_dir(cls, model_dir: Path, model_eos: tuple[int, ...] = ()) -> Tokenizer:
        path = model_dir / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"{model_dir} has no tokenizer.json (needed to tokenize text)")
        text = read_text_file(path, TOKENIZER_MAX_BYTES)
        try:
            backend = HFTokenizer.from_str(text)
        except Exception as exc:  # the Rust side raises a bare Exception
            raise CheckpointError(f"cannot read {path}: {exc}") from exc
        # A tokenizer.json may carry its trainer's batch settings (all-MiniLM-L6-v2's pads every
        # text to 128 ids and cuts it there): ids here are one text's own, whole.
        backend.no_padding()
        backend.no_truncation()
        config = _read_json(model_dir / "tokenizer_config.json", TOKENIZER_MAX_BYTES)
        template_file = model_dir / "chat_template.jinja"
        if template_file.exists():  # _chat_template reads it whole: no pipe, no huge file
            regular_file_size(template_file, CONFIG_MAX_BYTES)
        template = _chat_template(model_dir, config)
        eos = _eos_ids(model_dir, config, backend, model_eos)
        return cls(backend, config, template, eos)

    def set_chat_template(self, template: str) -> None:
        """Use `template` (Jinja text, as `--chat-template FILE` gives it) instead of the
        checkpoint's own."""
        if not isinstance(template, str) or not template.strip():
            raise ChatTemplateError("the chat template override is empty")
        try:
            _jinja_env().from_string(template)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from exc
        self.chat_template = template
        self._template = None
        self._control_tokens = None  # which added tokens are control tokens depends on it
        self.harmony = None  # the override wins over the Harmony renderer too

    def render_with_harmony(self, encoding: Any) -> None:
        """Render conversations with `encoding` (a noesis.harmony.HarmonyEncoding over this
        vocabulary, gpt-oss's layout) rather than the checkpoint's template, as vLLM does for
        gpt-oss: the prompt ids are then openai-harmony's. The template kwarg
        `reasoning_effort` sets the system message's; other kwargs are ignored."""
        self.harmony = encoding

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        _refuse_lone_surrogate(text, "the prompt")
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
        """The rendered text. Encoding it with `encode` would turn a control-token spelling in a
        message into the control token itself: use `encode_chat` for the token ids."""
        if self.harmony is not None:
            encoding = _harmony_for(self.harmony, kwargs)
            return encoding.render_chat_text(messages, tools, add_generation_prompt)
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

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        tools: list | None = None,
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """Token ids of a conversation rendered by the chat template (with the BOS it writes).

        Only the template writes control tokens. Every string the caller passes (message content,
        names, reasoning, tool calls and results, tool declarations, template kwargs) is encoded
        as text even where it spells one (`<|im_start|>`, `</s>`, ...): the model reads the
        literal characters. A conversation without such spellings encodes exactly as
        `encode(apply_chat_template(...), add_special_tokens=False)` does.
        """
        if self.harmony is not None:  # strings are encoded as text piece by piece already
            encoding = _harmony_for(self.harmony, kwargs)
            return encoding.render_chat(messages, tools, add_generation_prompt)
        controls = self.control_tokens()
        try:
            mask = ControlMask(controls, (messages, tools, kwargs, self.chat_template or ""))
            messages, tools, kwargs = mask.hide((messages, tools, kwargs))
        except RecursionError as exc:
            raise InvalidRequest("the messages or tools are nested too deeply") from exc
        try:
            text = self.apply_chat_template(messages, tools, add_generation_prompt, **kwargs)
        except ChatTemplateError as exc:  # its message may quote hidden text: give it back
            raise ChatTemplateError(mask.restore(str(exc))) from exc
        _refuse_lone_surrogate(text, "the conversation")
        return controls.encode(text, mask.restore)

    def control_tokens(self) -> ControlTokens:
        if self._control_tokens is None:
            self._control_tokens = ControlTokens(self.backend, self.config, self.chat_template)
        return self._control_tokens

    def _compiled_template(self):
        if self._template is None:
            self._template = _jinja_env().from_string(self.chat_template)
        return self._template


def _harmony_for(encoding: Any, kwargs: dict[str, Any]) -> Any:
    """`encoding`, with the system message's reasoning effort from the template kwargs."""
    effort = kwargs.get("reasoning_effort")
    if effort is None:
        return encoding
    from noesis.harmony import HarmonyEncoding

    layout = encoding.layout
    system = dataclasses.replace(layout.system, reasoning_effort=effort)
    return HarmonyEncoding(encoding.vocab, dataclasses.replace(layout, system=system))


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")  # a str holds a valid pair as one character


def _refuse_lone_surrogate(text: str, what: str) -> None:
    """Half of a UTF-16 pair is not text (the tokenizer would fail on it with a TypeError)."""
    found = _LONE_SURROGATE.search(text)
    if found is not None:
        raise InvalidRequest(
            f"{what} holds a lone surrogate ({ascii(found.group())} at character "
            f"{found.start()}), which is not Unicode text"
        )


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


def _read_json(path: Path, max_bytes: int = CONFIG_MAX_BYTES) -> dict[str, Any]:
    """An optional JSON object file of the checkpoint; {} when absent."""
    if not path.exists():
        return {}
    return read_json_file(path, max_bytes)


def _token_text(token: Any) -> str | None:
    if isinstance(token, dict):
        return token.get("content")
    return token


def _chat_template(model_dir: Path, config: dict[str, Any]) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.exists():
        return read_text_file(jinja_file, CONFIG_MAX_BYTES)
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


# ---------------------------------------------------------------- control tokens in chat prompts

# A character that is not a letter, digit, '_' or whitespace: control spellings are markup
# (`<|im_start|>`, `[INST]`, `</s>`), and only fragments holding such a character are hidden.
_MARKUP_CHAR = re.compile(r"[^\w\s]")
# Placeholders for hidden text come from the supplementary private-use planes, which no vocabulary
# or template gives a meaning to; each one is checked absent from the input first.
_PRIVATE_USE = re.compile("[\U000f0000-\U0010ffff]")
_PRIVATE_CODES = range(0xF0000, 0x110000)
_CONFIG_SPECIAL_KEYS = (
    "bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token"
)


class ControlTokens:
    """The added tokens that only a chat template may write (see `_is_control`), found in rendered
    text the way `tokenizers` finds them, and private tokenizer copies that encode text without
    them."""

    def __init__(
        self, backend: HFTokenizer, config: dict[str, Any], chat_template: str | None
    ) -> None:
        spec = json.loads(backend.to_str())
        declared = _declared_special_tokens(config)
        control = [
            token
            for token in spec.get("added_tokens", ())
            if token.get("content") and _is_control(token, declared, chat_template or "")
        ]
        self.ids: dict[str, int] = {token["content"]: token["id"] for token in control}
        self.id_set = frozenset(self.ids.values())
        self._lstrip = frozenset(token["content"] for token in control if token.get("lstrip"))
        self._rstrip = frozenset(token["content"] for token in control if token.get("rstrip"))
        self._in_template = _alternation(control, word_bounds=True)
        self._in_text = _alternation(control, word_bounds=False)
        self._heads, self._tails = _fragments(self.ids)
        self._longest_fragment = max(map(len, self.ids), default=1) - 1
        self._first, self._later = _text_encoders(spec, set(self.ids))

    def encode(self, text: str, restore: Callable[[str], str] = str) -> list[int]:
        """Ids of rendered template text: each control spelling in it becomes its token; the text
        between them, with `restore` giving back what the caller wrote, is encoded as text only."""
        ids: list[int] = []
        position = 0
        for start, end, spelling in self._template_matches(text):
            ids += self._encode_text(restore(text[position:start]), position == 0)
            ids.append(self.ids[spelling])
            position = end
        return ids + self._encode_text(restore(text[position:]), position == 0)

    def hidden_spans(self, text: str) -> list[tuple[int, int]]:
        """Where a string of the caller's must not meet template text: every control spelling in
        it, and a fragment at either end that could join the text beside it into one (`<|im_`
        at the end, `end|>` at the start). Touching spans are merged."""
        if self._in_text is None:
            return []
        spans = [match.span() for match in self._in_text.finditer(text)]
        head = _edge_length(text, self._heads, self._longest_fragment, at_end=False)
        tail = _edge_length(text, self._tails, self._longest_fragment, at_end=True)
        spans += [(0, head)] if head else []
        spans += [(len(text) - tail, len(text))] if tail else []
        merged: list[tuple[int, int]] = []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
            else:
                merged.append((start, end))
        return merged

    def _template_matches(self, text: str) -> Iterator[tuple[int, int, str]]:
        """(start, end, spelling) of each control token, leftmost-longest first; a token flagged
        lstrip/rstrip takes the whitespace beside it, as the tokenizer's own matcher does."""
        if self._in_template is None:
            return
        end = 0
        while (match := self._in_template.search(text, end)) is not None:
            spelling, start = match.group(), match.start()
            if spelling in self._lstrip:
                while start > end and text[start - 1].isspace():
                    start -= 1
            end = match.end()
            if spelling in self._rstrip:
                while end < len(text) and text[end].isspace():
                    end += 1
            yield start, end, spelling

    def _encode_text(self, text: str, at_start: bool) -> list[int]:
        if not text:
            return []
        encoder = self._first if at_start else self._later
        ids = encoder.encode(text, add_special_tokens=False).ids
        if not self.id_set.isdisjoint(ids):  # a vocabulary whose plain merges spell a control token
            raise ChatTemplateError(
                f"this tokenizer encodes the text {text[:80]!r} to a control token even as plain "
                "text, so it cannot be sent as a message"
            )
        return ids


class ControlMask:
    """Hides what `ControlTokens.hidden_spans` marks in the caller's strings behind private-use
    characters while the template renders, so no control token can be read from them; `restore`
    gives the text back. Equal strings hide alike, so the template's comparisons between the
    caller's strings (a property name `in required`) come out as before."""

    def __init__(self, controls: ControlTokens, inputs: Any) -> None:
        self.controls = controls
        taken: set[str] = set()
        _collect_private_use(inputs, taken)
        self._free = (
            chr(code)
            for code in _PRIVATE_CODES
            if code & 0xFFFF < 0xFFFE and chr(code) not in taken  # U+xFFFE/F: noncharacters
        )
        self._placeholders: dict[str, str] = {}  # hidden text -> its character
        self._table: dict[int, str] = {}  # the character's code point -> hidden text

    def hide(self, value: Any) -> Any:
        """`value` with every string in it hidden, dict keys included; other values unchanged."""
        if isinstance(value, str):
            return self._hide_text(value)
        if isinstance(value, dict):
            return {self.hide(key): self.hide(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.hide(item) for item in value]
        if isinstance(value, tuple):
            return tuple(self.hide(item) for item in value)
        return value

    def restore(self, text: str) -> str:
        return text.translate(self._table) if self._table else text

    def _hide_text(self, text: str) -> str:
        spans = self.controls.hidden_spans(text)
        if not spans:
            return text
        pieces, position = [], 0
        for start, end in spans:
            pieces += [text[position:start], self._placeholder(text[start:end])]
            position = end
        pieces.append(text[position:])
        return "".join(pieces)

    def _placeholder(self, hidden: str) -> str:
        if hidden not in self._placeholders:
            char = next(self._free, None)
            if char is None:
                raise InvalidRequest(
                    "the conversation spells too many distinct control tokens to encode as text"
                )
            self._placeholders[hidden] = char
            self._table[ord(char)] = hidden
        return self._placeholders[hidden]


def _is_control(token: dict[str, Any], declared: set[str], chat_template: str) -> bool:
    """Whether an added token is a control token, which no caller's text may produce.

    Tokens flagged special are, and so are those the tokenizer config declares (bos_token, ...,
    additional_special_tokens). Some tokenizers leave real control tokens unflagged (Qwen's
    `<tool_call>` and `<think>`), so an unflagged token also is when the chat template spells it
    and it holds a markup character. The other unflagged added tokens (runs of spaces, HTML tags,
    added words) are text the model reads as text: they keep encoding as they always did, which
    keeps ordinary messages at the same ids.
    """
    content = token["content"]
    if token.get("special") or content in declared:
        return True
    return content in chat_template and _MARKUP_CHAR.search(content) is not None


def _declared_special_tokens(config: dict[str, Any]) -> set[str]:
    named = [config.get(key) for key in _CONFIG_SPECIAL_KEYS]
    extra = config.get("additional_special_tokens")
    named += extra if isinstance(extra, list) else []
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        named += [t for t in decoder.values() if isinstance(t, dict) and t.get("special")]
    return {text for text in map(_token_text, named) if isinstance(text, str) and text}


def _alternation(tokens: list[dict[str, Any]], word_bounds: bool) -> re.Pattern[str] | None:
    """One regex of the spellings, longest first, so that a search finds the leftmost-longest like
    the tokenizer's matcher; with word_bounds, a single_word token only as a whole word."""
    if not tokens:
        return None
    parts = []
    for token in sorted(tokens, key=lambda t: len(t["content"]), reverse=True):
        part = re.escape(token["content"])
        parts.append(rf"(?<!\w){part}(?!\w)" if word_bounds and token.get("single_word") else part)
    return re.compile("|".join(parts))


def _fragments(spellings: Iterable[str]) -> tuple[frozenset[str], frozenset[str]]:
    """(proper suffixes, proper prefixes) of the spellings that hold a markup character: what may
    not open, resp. close, a caller's string. Fragments of letters alone (a role name inside
    `'<|' + role + '|>'`) are left alone: templates compare those strings."""
    heads, tails = set(), set()
    for spelling in spellings:
        for cut in range(1, len(spelling)):
            heads.add(spelling[cut:])
            tails.add(spelling[:cut])
    return _with_markup(heads), _with_markup(tails)


def _with_markup(fragments: set[str]) -> frozenset[str]:
    return frozenset(fragment for fragment in fragments if _MARKUP_CHAR.search(fragment))


def _edge_length(text: str, fragments: frozenset[str], longest: int, at_end: bool) -> int:
    """Length of the longest fragment that `text` starts (or ends) with; 0 if none."""
    for length in range(min(longest, len(text)), 0, -1):
        if (text[-length:] if at_end else text[:length]) in fragments:
            return length
    return 0


def _text_encoders(spec: dict[str, Any], control: set[str]) -> tuple[HFTokenizer, HFTokenizer]:
    """Two private copies that read control spellings as text: control tokens marked special and
    `encode_special_tokens` set (which skips special added tokens only). The second encodes text
    that does not open the rendered string: a Metaspace pre-tokenizer with prepend_scheme "first"
    puts its "▁" before the start of the whole input only, never after a token."""
    for token in spec.get("added_tokens", ()):
        if token.get("content") in control:
            token["special"] = True
    first = _special_as_text(spec)
    pre_tokenizer = spec.get("pre_tokenizer")
    later = _never_prepend(pre_tokenizer)
    if later == pre_tokenizer:
        return first, first
    return first, _special_as_text({**spec, "pre_tokenizer": later})


def _special_as_text(spec: dict[str, Any]) -> HFTokenizer:
    tokenizer = HFTokenizer.from_str(json.dumps(spec))
    tokenizer.encode_special_tokens = True
    return tokenizer


def _never_prepend(node: Any) -> Any:
    """A copy of a pre-tokenizer spec in which Metaspace's prepend_scheme "first" is "never"."""
    if isinstance(node, list):
        return [_never_prepend(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first":
        return {**node, "prepend_scheme": "never"}
    return {key: _never_prepend(value) for key, value in node.items()}


def _collect_private_use(value: Any, out: set[str]) -> None:
    if isinstance(value, str):
        out.update(_PRIVATE_USE.findall(value))
    elif isinstance(value, dict):
        for key, item in value.items():
            _collect_private_use(key, out)
            _collect_private_use(item, out)
    elif isinstance(value, list | tuple):
        for item in value:
            _collect_private_use(item, out)
