"""The noesis-tiny tokenizer: byte-level BPE with the Harmony special tokens as single ids, trained
with `tokenizers`, saved in the files that transformers' AutoTokenizer reads."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from noesis.tiny.harmony import ENDOFTEXT, RETURN, SPECIAL_TOKENS, STARTOFTEXT
from noesis.tiny.template import CHAT_TEMPLATE

VOCAB_SIZE = 8192
MODEL_MAX_LENGTH = 2048


def train(texts: Iterable[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Byte-level BPE; digits are split one by one so every number is spelled from ten tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    for index, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == index, token
    return tokenizer


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    return {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}


def tokenizer_config() -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": STARTOFTEXT,
        "eos_token": RETURN,
        "pad_token": ENDOFTEXT,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


def save(tokenizer: Tokenizer, directory: str | Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False)
    (directory / "tokenizer_config.json").write_text(config + "\n")
    (directory / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def load(directory: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
