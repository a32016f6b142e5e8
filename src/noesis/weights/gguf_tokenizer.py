"""A `tokenizers` tokenizer built from a GGUF file's vocabulary metadata (it has no tokenizer.json).

Two vocabulary kinds, named by `tokenizer.ggml.model`:
- "gpt2": byte-level BPE with the file's merges; text is split by the regex its pre-tokenizer
  name (`tokenizer.ggml.pre`) stands for.
- "llama": SentencePiece BPE with byte fallback ("<0x41>" tokens); the file has scores, not
  merges, so merges are derived from them: every split of a token into two tokens, best-scored
  token first.
Tokens typed control become special added tokens, user-defined ones plain added tokens; BOS/EOS
are added as `tokenizer.ggml.add_bos_token` / `add_eos_token` say. The result encodes as
transformers' GGUF tokenizer does (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from noesis.errors import CheckpointError, UnsupportedModel
from noesis.models.config import ModelConfig
from noesis.tokenizer import Tokenizer
from noesis.weights.gguf import GGUFFile

logger = logging.getLogger(__name__)

TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
SPIECE_SPACE = "\u2581"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split regex its merges were learned with; others split as GPT-2
SPLITS = {
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
    "llama-bpe": _LLAMA3,
    "smaug-bpe": _LLAMA3,
    "dbrx": _LLAMA3,
    "qwen2": _QWEN2,
    "deepseek-r1-qwen": _QWEN2,
    "tekken": _TEKKEN,
}
GPT2_PRE = ("default", "gpt2", "gpt-2")
# pre-tokenizers that split every digit off first, then split as GPT-2 (llama.cpp's table)
DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                    "minerva")
KINDS = ("gpt2", "llama")


def gguf_tokenizer(gguf: GGUFFile, config: ModelConfig) -> Tokenizer:
    """noesis's tokenizer over the file's vocabulary, with its chat template and EOS ids."""
    backend, tokenizer_config = build_tokenizer(gguf.metadata)
    template = gguf.metadata.get("tokenizer.chat_template")
    return Tokenizer(backend, tokenizer_config, template, config.eos_token_ids)


def build_tokenizer(metadata: dict[str, Any]) -> tuple[HFTokenizer, dict[str, Any]]:
    """(backend, tokenizer config with bos/eos/unk/pad token texts) from GGUF metadata."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in KINDS:
        raise UnsupportedModel(
            f"GGUF vocabulary kind tokenizer.ggml.model={kind!r} is not supported "
            f"(supported: {', '.join(KINDS)})"
        )
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise CheckpointError("the GGUF file has no vocabulary (tokenizer.ggml.tokens)")
    types = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        backend = _byte_level(metadata, tokens)
    else:
        backend = _sentencepiece(metadata, tokens)
    config = _special_tokens(metadata, tokens)
    _add_tokens(backend, tokens, types, config, byte_level=kind == "gpt2")
    backend.post_processor = _post_processor(metadata, tokens, kind)
    return backend, config


def _byte_level(metadata: dict[str, Any], tokens: list[str]) -> HFTokenizer:
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {
        token if set(token) <= spelled else "".join(alphabet[b] for b in token.encode()): index
        for index, token in enumerate(tokens)
    }
    merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges") or []]
    backend = HFTokenizer(
        models.BPE(vocab, merges, dropout=None, continuing_subword_prefix="",
                   end_of_word_suffix="", fuse_unk=False)
    )
    backend.normalizer = None
    backend.pre_tokenizer = _byte_level_split(metadata.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    return backend


def _byte_level_split(pre: Any) -> pre_tokenizers.PreTokenizer:
    if pre in SPLITS:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if pre not in (None, *GPT2_PRE):
        logger.warning("GGUF pre-tokenizer %r is not known to noesis: text is split as GPT-2 "
                       "does (known: %s)", pre,
                       ", ".join(sorted([*SPLITS, *DIGITS_THEN_GPT2, *GPT2_PRE])))
    return gpt2


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes that print stand for themselves)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _sentencepiece(metadata: dict[str, Any], tokens: list[str]) -> HFTokenizer:
    vocab = {token: index for index, token in enumerate(tokens)}
    scores = metadata.get("tokenizer.ggml.scores")
    if metadata.get("tokenizer.ggml.merges"):
        merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    elif isinstance(scores, list) and len(scores) == len(tokens):
        merges = _merges_from_scores(vocab, dict(zip(tokens, scores, strict=True)))
    else:
        raise CheckpointError("a SentencePiece GGUF vocabulary needs tokenizer.ggml.scores")
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    backend = HFTokenizer(
        models.BPE(vocab, merges, dropout=None, fuse_unk=True, byte_fallback=True,
                   unk_token=tokens[unk] if _valid_id(unk, tokens) else None)
    )
    if metadata.get("general.architecture") == "phi3":  # the space prefix comes from a normalizer
        backend.normalizer = normalizers.Sequence([
            normalizers.Prepend(SPIECE_SPACE), normalizers.Replace(" ", SPIECE_SPACE)
        ])
        backend.pre_tokenizer = None
    else:
        backend.normalizer = None
        backend.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement=SPIECE_SPACE, prepend_scheme="first", split=False
        )
    backend.decoder = decoders.Sequence([
        decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(" ", 1, 0),
    ])
    return backend


def _merges_from_scores(vocab: dict[str, int], scores: dict[str, float]):
    """SentencePiece BPE merges: each token's splits into two tokens, the best-scored token
    first; ties go to the longer left, then the longer right piece, then vocabulary order."""
    candidates = []
    for token, score in scores.items():
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        splits = [(left, right) for left, right in splits if left in vocab and right in vocab]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        candidates += [(left, right, score) for left, right in splits]
    candidates.sort(key=lambda c: (-c[2], -len(c[0]), -len(c[1])))  # stable: keeps ties' order
    return [(left, right) for left, right, _ in candidates]


def _special_tokens(metadata: dict[str, Any], tokens: list[str]) -> dict[str, Any]:
    config = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        config[f"{name}_token"] = tokens[token_id] if _valid_id(token_id, tokens) else None
    return config


def _add_tokens(backend: HFTokenizer, tokens: list[str], types: list[int],
                config: dict[str, Any], byte_level: bool) -> None:
    """Control tokens (and bos/eos/unk/pad) match whole as special tokens, user-defined ones as
    plain added tokens. In a byte-level vocabulary a "control" token spelled outside the byte
    alphabet is a mislabel, and is left out."""
    spelled = set(_byte_alphabet().values())
    special = [
        token for token, kind in zip(tokens, types, strict=False)
        if kind == TOKEN_CONTROL and (not byte_level or set(token) <= spelled)
    ]
    special += [token for token in config.values() if token is not None]
    backend.add_special_tokens([
        AddedToken(token, special=True, normalized=False) for token in dict.fromkeys(special)
    ])
    vocab = backend.get_vocab()
    user = [
        token for token, kind in zip(tokens, types, strict=False)
        if kind == TOKEN_USER_DEFINED and token in vocab
    ]
    backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in user])


def _post_processor(metadata: dict[str, Any], tokens: list[str], kind: str):
    """BOS (and EOS) around every encoded text when the file asks for it; llama.cpp adds BOS to
    a SentencePiece vocabulary that does not say."""
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
    ends = []
    for wanted, key in ((add_bos, "bos"), (add_eos, "eos")):
        token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
        valid = wanted and _valid_id(token_id, tokens)
        ends.append((tokens[token_id], token_id) if valid else None)
    bos, eos = ends
    single = ([f"{bos[0]}:0"] if bos else []) + ["$A:0"] + ([f"{eos[0]}:0"] if eos else [])
    pair = single + ([f"{bos[0]}:1"] if bos else []) + ["$B:1"] + ([f"{eos[0]}:1"] if eos else [])
    specials = list(dict.fromkeys(end for end in ends if end is not None))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _valid_id(token_id: Any, tokens: list[str]) -> bool:
    return isinstance(token_id, int) and 0 <= token_id < len(tokens)
