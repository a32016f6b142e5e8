"""o200k_harmony as a Hugging Face tokenizer.json, built offline from the same o200k_base ranks
(`harmony.vocab`): byte-level BPE with o200k's pre-tokenizer and gpt-oss's special tokens, so a
gpt-oss checkpoint without one (a test's random checkpoint) tokenizes as the released ones do.

tiktoken stores ranks, not merges. A token's merges are its splits into two tokens, in the order
of its rank and then of the parts' ranks, as transformers converts tiktoken files; a piece that is
a whole token is taken whole (`ignore_merges`), as tiktoken does. Building takes seconds, so the
file is cached beside the tiktoken copy (`$NOESIS_CACHE_DIR/tiktoken`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from noesis.harmony import vocab

TOKENIZER_FILE = "o200k_harmony.tokenizer.json"
# gpt-oss's vocab_size: its tokenizer stops at <|reserved_201087|>, one short of openai_harmony's
# last reserved id, which no gpt-oss model can sample.
VOCAB_SIZE = 201_088
# What tokenizer_config.json says about the special tokens, as gpt-oss releases write it.
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<|startoftext|>",
    "eos_token": "<|return|>",
    "pad_token": "<|endoftext|>",
    "add_bos_token": False,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
}


def write_tokenizer(model_dir: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Write tokenizer.json (o200k_harmony) and tokenizer_config.json into `model_dir`."""
    directory = Path(cache_dir) if cache_dir is not None else vocab._default_cache_dir()
    cached = directory / TOKENIZER_FILE
    if not cached.is_file():
        directory.mkdir(parents=True, exist_ok=True)
        vocab._write_atomically(cached, build().to_str().encode())
    model_dir = Path(model_dir)
    shutil.copyfile(cached, model_dir / "tokenizer.json")
    (model_dir / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2))
    return model_dir / "tokenizer.json"


def build():
    """The o200k_harmony `tokenizers.Tokenizer`."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    ranks = vocab.load_ranks()
    text = _byte_level_text()
    spelled = {token: token.decode("latin-1").translate(text) for token in ranks}
    by_rank = {rank: spelled[token] for token, rank in ranks.items()}
    merges = [(by_rank[left], by_rank[right]) for left, right in _merges(ranks)]
    bpe = models.BPE({spelled[t]: rank for t, rank in ranks.items()}, merges, ignore_merges=True)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(vocab.O200K_PATTERN), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    specials = sorted(_specials().items(), key=lambda item: item[1])
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, _ in specials]
    )
    return tokenizer


def is_o200k_harmony(tokenizer, samples: int = 4096) -> bool:
    """Whether a `tokenizers.Tokenizer` holds o200k_harmony: its special tokens at their ids and
    the bytes of `samples` tokens spread over the ranks (False when bpe-openai is missing)."""
    if tokenizer.get_vocab_size(with_added_tokens=True) != VOCAB_SIZE:
        return False
    if any(tokenizer.token_to_id(token) != token_id for token, token_id in _specials().items()):
        return False
    try:
        encoding = vocab.o200k_harmony()
    except vocab.VocabularyMissing:
        return False
    text = _byte_level_text()
    step = max(1, vocab.NUM_RANKS // samples)
    return all(
        tokenizer.id_to_token(rank)
        == encoding.decode_single_token_bytes(rank).decode("latin-1").translate(text)
        for rank in range(0, vocab.NUM_RANKS, step)
    )


def _specials() -> dict[str, int]:
    return {token: i for token, i in vocab.special_tokens().items() if i < VOCAB_SIZE}


def _merges(ranks: dict[bytes, int]) -> list[tuple[int, int]]:
    """(left rank, right rank) of every split of every token into two tokens, in merge order."""
    found = []
    get = ranks.get
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left = get(token[:cut])
            if left is None:
                continue
            right = get(token[cut:])
            if right is not None:
                found.append((rank, left, right))
    found.sort()
    return [(left, right) for _, left, right in found]


def _byte_level_text() -> dict[int, str]:
    """str.translate table from latin-1 code points (one per byte) to GPT-2's byte alphabet."""
    from noesis.harmony.encoding import _byte_alphabet

    return {byte: char for char, byte in _byte_alphabet().items()}
