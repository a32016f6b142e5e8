"""Dataset build for noesis-tiny: corpus texts -> trained tokenizer -> token streams on disk, and
the batch sampler that training reads them with.

Run as `python -m noesis.tiny.data --out DIR`. Texts are made and encoded in parallel chunks; the
result depends only on the configuration, never on the number of workers. `--mixture control`
draws the training split from corpus.CONTROL_MIXTURE (the control-plane tasks mixed in); the
held-out stream stays the default mixture's, so validation losses compare across builds.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from noesis.tiny import corpus, tokenizer
from noesis.tiny.harmony import ENDOFTEXT
from noesis.tiny.lexicon import Split

TOKENIZER_DIR = "tokenizer"


@dataclass(frozen=True)
class DataConfig:
    seed: int = 0
    train_items: int = 600_000  # conversations and documents
    heldout_items: int = 4_000
    tokenizer_items: int = 40_000  # the first train items, used to fit the BPE merges
    doc_every: int = 6  # every 6th item is a plain English document
    vocab_size: int = tokenizer.VOCAB_SIZE
    chunk_items: int = 5_000
    tokenizer_from: str | None = None  # a directory with tokenizer.json to reuse instead of fitting
    mixture: str = "default"  # the training split's corpus.MIXTURES entry
    long_analysis: float | None = None  # that mixture's long_analysis share, replaced (None: kept)

    def __post_init__(self) -> None:
        corpus.mixture_named(self.mixture, self.long_analysis)  # a bad name or share fails here


def build(out: Path, config: DataConfig, workers: int = 0) -> dict[str, object]:
    """Write tokenizer/, {split}.tokens.npy, .loss_mask.npy, .starts.npy and meta.json."""
    out.mkdir(parents=True, exist_ok=True)
    began = time.time()
    if config.tokenizer_from:
        tok = tokenizer.load(config.tokenizer_from)
    else:
        items = config.tokenizer_items
        texts = corpus.texts(
            config.seed,
            "train",
            items,
            doc_every=config.doc_every,
            mixture=corpus.mixture_named(config.mixture, config.long_analysis),
        )
        tok = tokenizer.train(texts, config.vocab_size)
    tokenizer.save(tok, out / TOKENIZER_DIR)
    meta: dict[str, object] = {"config": asdict(config), "tokenizer_seconds": time.time() - began}
    for split, count in (("train", config.train_items), ("heldout", config.heldout_items)):
        tokens, loss_mask, starts = encode_split(tok, config, split, count, workers)
        np.save(out / f"{split}.tokens.npy", tokens)
        np.save(out / f"{split}.loss_mask.npy", loss_mask)
        np.save(out / f"{split}.starts.npy", starts)
        meta[f"{split}_tokens"] = int(tokens.size)
        meta[f"{split}_items"] = count
    meta["seconds"] = time.time() - began
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def encode_split(
    tok: Tokenizer, config: DataConfig, split: Split, count: int, workers: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A split's items as one uint16 stream, each followed by <|endoftext|>; a parallel loss mask
    (0 on earlier assistant turns, see Example.history_spans); and the item starts."""
    tokenizer_json = tok.to_str()
    chunks = [
        (start, min(config.chunk_items, count - start))
        for start in range(0, count, config.chunk_items)
    ]
    mixture = (config.mixture, config.long_analysis) if split == "train" else ("default", None)
    jobs = [(tokenizer_json, config.seed, split, start, n, config.doc_every, mixture)
            for start, n in chunks]  # fmt: skip
    workers = workers or os.cpu_count() or 1
    if workers == 1 or len(jobs) == 1:
        parts = [_encode_chunk(job) for job in jobs]
    else:
        with ProcessPoolExecutor(workers) as pool:
            parts = list(pool.map(_encode_chunk, jobs))
    lengths = np.concatenate([p[0] for p in parts])
    tokens = np.concatenate([p[1] for p in parts])
    loss_mask = np.concatenate([p[2] for p in parts])
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    return tokens, loss_mask, starts


def _encode_chunk(
    job: tuple[str, int, Split, int, int, int, tuple[str, float | None]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    tokenizer_json, seed, split, start, count, doc_every, (name, long_analysis) = job
    tok = Tokenizer.from_str(tokenizer_json)
    separator = tok.token_to_id(ENDOFTEXT)
    mixture = corpus.mixture_named(name, long_analysis)
    items = list(corpus.training_items(seed, split, count, start, doc_every, mixture))
    encodings = tok.encode_batch([text for text, _ in items], add_special_tokens=False)
    tokens, masks = [], []
    for encoding, (_, spans) in zip(encodings, items, strict=True):
        tokens.append(np.array(encoding.ids + [separator], dtype=np.uint16))
        masks.append(_loss_mask(encoding.offsets, spans))
    lengths = np.array([t.size for t in tokens], dtype=np.int64)
    return lengths, np.concatenate(tokens), np.concatenate(masks)


def _loss_mask(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for each token (and the trailing separator) to train on, 0 inside the spans."""
    begins = np.array([begin for begin, _ in offsets] + [-1])
    mask = np.ones(begins.size, dtype=np.uint8)
    for begin, end in spans:
        mask[(begins >= begin) & (begins < end)] = 0
    return mask


Batch = tuple[np.ndarray, np.ndarray]  # token ids [B, T+1] int64, loss mask [B, T+1] bool


class TokenStream:
    """Windows of `seq_len + 1` tokens that each begin at the start of an item, with their mask
    (all ones for data built before masks existed)."""

    def __init__(self, directory: Path, split: Split, seq_len: int):
        self.tokens = np.load(directory / f"{split}.tokens.npy", mmap_mode="r")
        mask_path = directory / f"{split}.loss_mask.npy"
        self.loss_mask = np.load(mask_path, mmap_mode="r") if mask_path.exists() else None
        starts = np.load(directory / f"{split}.starts.npy")
        self.starts = starts[starts + seq_len + 1 <= self.tokens.size]
        if self.starts.size == 0:
            raise ValueError(f"{split} split has fewer than {seq_len + 1} tokens")
        self.seq_len = seq_len

    def batch(self, rng: np.random.Generator, batch_size: int) -> Batch:
        return self.windows(rng.choice(self.starts, size=batch_size))

    def windows(self, starts: np.ndarray) -> Batch:
        index = starts[:, None] + np.arange(self.seq_len + 1)[None, :]  # [B, T+1]
        tokens = np.asarray(self.tokens[index], dtype=np.int64)
        if self.loss_mask is None:
            return tokens, np.ones(tokens.shape, dtype=bool)
        return tokens, np.asarray(self.loss_mask[index], dtype=bool)

    def fixed_batches(self, batch_size: int, num_batches: int) -> list[Batch]:
        """The same evaluation batches every time: evenly spaced item starts."""
        count = min(self.starts.size, batch_size * num_batches)
        picked = self.starts[np.linspace(0, self.starts.size - 1, count).astype(np.int64)]
        return [self.windows(picked[i : i + batch_size]) for i in range(0, count, batch_size)]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=DataConfig.seed)
    parser.add_argument("--train-items", type=int, default=DataConfig.train_items)
    parser.add_argument("--heldout-items", type=int, default=DataConfig.heldout_items)
    parser.add_argument("--tokenizer-items", type=int, default=DataConfig.tokenizer_items)
    parser.add_argument("--workers", type=int, default=0, help="0: one per CPU")
    parser.add_argument(
        "--mixture",
        default=DataConfig.mixture,
        choices=tuple(corpus.MIXTURES),
        help="training-split task mixture: default, or control (the control-plane tasks mixed in)",
    )
    parser.add_argument(
        "--long-analysis",
        type=float,
        default=None,
        metavar="SHARE",
        help="replace the mixture's share of conversations with lengthened analysis (0..1)",
    )
    parser.add_argument(
        "--tokenizer", default=None, help="reuse the tokenizer.json in this directory (no fitting)"
    )
    args = parser.parse_args(argv)
    if args.long_analysis is not None and not 0.0 <= args.long_analysis <= 1.0:
        parser.error(f"--long-analysis must be between 0 and 1, got {args.long_analysis}")
    config = DataConfig(
        seed=args.seed,
        train_items=args.train_items,
        heldout_items=args.heldout_items,
        tokenizer_items=min(args.tokenizer_items, args.train_items),
        tokenizer_from=args.tokenizer,
        mixture=args.mixture,
        long_analysis=args.long_analysis,
    )
    meta = build(args.out, config, args.workers)
    print(json.dumps(meta, indent=2), flush=True)


if __name__ == "__main__":
    main()
