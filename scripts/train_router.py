"""Train the voice router on the noesis-tiny corpus's user questions and their task labels.

    .venv/bin/python scripts/train_router.py --out models/noesis-router

Questions come from `noesis.tiny.corpus` (train split for training, the held-out split, whose
names, words, countries and numbers never occur in training, for the reported accuracy). A share
of questions is rewritten as speech recognizers may write them (numbers as words, no punctuation).
Writes model.safetensors, config.json, training_summary.json and README.md.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections import Counter
from pathlib import Path

import torch

from noesis.tiny import corpus
from noesis.voice.router import Router, RouterConfig, RouterModel, batch

ONES = "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen \
fifteen sixteen seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def main() -> None:
    args = _parser().parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    labels = tuple(corpus.GENERATORS)
    train = questions(args.corpus_seed, "train", args.train, rng, args.spoken)
    heldout = questions(args.corpus_seed, "heldout", args.heldout, None, 0.0)
    spoken_rng = random.Random(args.seed + 1)
    heldout_spoken = [(spoken(text, spoken_rng), label) for text, label in heldout]
    config = RouterConfig(labels, num_buckets=args.buckets, hidden=args.hidden)
    model = RouterModel(config)
    start = time.perf_counter()
    losses = fit(model, train, args)
    router = Router(model)
    summary = {
        "command": "python scripts/train_router.py " + " ".join(_argv()),
        "parameters": router.num_parameters,
        "train_examples": len(train),
        "heldout_examples": len(heldout),
        "train_seconds": round(time.perf_counter() - start, 1),
        "final_loss": round(losses[-1], 4),
        "train_accuracy": accuracy(router, train[:5000]),
        "heldout_accuracy": accuracy(router, heldout),
        "heldout_spoken_accuracy": accuracy(router, heldout_spoken),
        "heldout_per_task": per_task(router, heldout),
        "heldout_labels": dict(Counter(label for _, label in heldout)),
        "config": json.loads(config.to_json()),
    }
    out = Path(args.out)
    router.save(out)
    (out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "README.md").write_text(readme(summary))
    print(json.dumps({k: v for k, v in summary.items() if k != "config"}, indent=2))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="models/noesis-router")
    parser.add_argument("--seed", type=int, default=0, help="initialization, shuffling, rewrites")
    parser.add_argument("--corpus-seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=30000, help="training questions")
    parser.add_argument("--heldout", type=int, default=3000, help="held-out questions")
    parser.add_argument("--spoken", type=float, default=0.3, help="share rewritten as speech")
    parser.add_argument("--buckets", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    return parser


def _argv() -> list[str]:
    import sys

    return sys.argv[1:]


def questions(seed: int, split, count: int, rng: random.Random | None, share: float):
    """(last user message, task label) of `count` corpus examples; `share` of them spoken."""
    pairs = []
    for i in range(count):
        example = corpus.example(seed, split, i)
        text = example.prompt_messages[-1]["content"]
        if rng is not None and rng.random() < share:
            text = spoken(text, rng)
        pairs.append((text, example.task))
    return pairs


def spoken(text: str, rng: random.Random) -> str:
    """The question as a recognizer might write it: ISO dates spelled out ("March 5, 2024"),
    then either numbers below 10000 as words or days as ordinals ("March 5th"), lowercase,
    without punctuation."""
    text = re.sub(r"(\d{4})-(\d\d)-(\d\d)", _spelled_date, text)
    if rng.random() < 0.5:
        text = re.sub(r"\d+", lambda m: number_words(int(m.group())), text)
    else:
        text = re.sub(_MONTH_DAY, lambda m: f"{m.group(1)} {ordinal(int(m.group(2)))}", text)
    return re.sub(r"[?.!,']", "", text).lower()


_MONTH_DAY = r"\b(" + "|".join(corpus.MONTHS) + r") (\d{1,2})\b"


def _spelled_date(match: re.Match) -> str:
    year, month, day = (int(g) for g in match.groups())
    return f"{corpus.MONTHS[month - 1]} {day}, {year}"


def ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def number_words(n: int) -> str:
    if n >= 10000:
        return str(n)
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else " " + ONES[n % 10])
    if n < 1000:
        rest = "" if n % 100 == 0 else " " + number_words(n % 100)
        return ONES[n // 100] + " hundred" + rest
    rest = "" if n % 1000 == 0 else " " + number_words(n % 1000)
    return number_words(n // 1000) + " thousand" + rest


def fit(model: RouterModel, train: list[tuple[str, str]], args) -> list[float]:
    label_index = {label: i for i, label in enumerate(model.config.labels)}
    targets = torch.tensor([label_index[label] for _, label in train])
    return fit_batches(
        model, targets, lambda rows: model(*batch([train[i][0] for i in rows], model.config)), args
    )


def fit_batches(model: torch.nn.Module, targets: torch.Tensor, logits_of, args) -> list[float]:
    """AdamW over seeded shuffled mini-batches for args.epochs: logits_of(row indices) -> the
    model's logits [B, C] for those training rows, against targets [N]. The per-batch losses.
    (scripts/train_contradiction.py trains its pair model with this loop too.)"""
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    generator = torch.Generator().manual_seed(args.seed)
    losses = []
    model.train()
    for _ in range(args.epochs):
        order = torch.randperm(len(targets), generator=generator)
        for begin in range(0, len(targets), args.batch_size):
            rows = order[begin : begin + args.batch_size]
            loss = torch.nn.functional.cross_entropy(logits_of(rows.tolist()), targets[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    model.eval()
    return losses


def accuracy(router: Router, pairs: list[tuple[str, str]]) -> float:
    predicted = router.predict_batch([text for text, _ in pairs])
    correct = sum(p == label for (p, _), (_, label) in zip(predicted, pairs, strict=True))
    return round(correct / len(pairs), 4)


def per_task(router: Router, pairs: list[tuple[str, str]]) -> dict[str, float]:
    return {
        label: accuracy(router, [pair for pair in pairs if pair[1] == label])
        for label in sorted({label for _, label in pairs})
    }


def readme(s: dict) -> str:
    rows = "\n".join(f"| {task} | {acc:.4f} |" for task, acc in s["heldout_per_task"].items())
    c = s["config"]
    return f"""# noesis-router

Maps a voice transcript to the task of the noesis-tiny corpus it asks for, so the voice pipeline
can pick an expert (and the tool to declare) before generation starts. Loaded by
`noesis.voice.router.Router.load`.

## Model

Word 1-2-grams and character 3-4-grams of the normalized text (lowercase, digits as 0, punctuation
other than math signs dropped), hashed with crc32 into {c["num_buckets"]} buckets, summed
(EmbeddingBag, {c["hidden"]} wide), ReLU, linear to {len(c["labels"])} labels:
{", ".join(c["labels"])}. {s["parameters"]:,} parameters, float32 `model.safetensors`.

## Data and training

Last user message and task label of `noesis.tiny.corpus.example(corpus_seed=0, split, i)`:
{s["train_examples"]:,} training questions (the train split's tool questions are partly written in
natural voices by `noesis.tiny.paraphrase`: number words, polite and indirect forms, other
verbs and operators; then 30% rewritten as a recognizer may write them: ISO
dates spelled out with ordinal days, numbers as words or days as ordinals, lowercase, no
punctuation) and {s["heldout_examples"]:,} held-out
questions (the corpus's held-out split: its names, words, countries and numbers never occur in
training). AdamW, seeded; {s["train_seconds"]} s on CPU; final loss {s["final_loss"]}.

Command: `{s["command"]}`

## Accuracy

| set | accuracy |
|---|---|
| train (first 5000) | {s["train_accuracy"]:.4f} |
| held-out, as written | {s["heldout_accuracy"]:.4f} |
| held-out, rewritten as speech | {s["heldout_spoken_accuracy"]:.4f} |

Held-out, per task:

| task | accuracy |
|---|---|
{rows}

The date rewrites (spelled-out ISO dates, ordinal days) were added after Whisper's transcript
"What day of a week is March 5th, 2024?" was misrouted in benchmarks/voice_latency.py; the
benchmark's questions themselves are not in the training data.

The corpus questions come from a few templates per task, so this measures generalization to
unseen entities and spoken rewrites, not to free-form questions outside the corpus.
"""


if __name__ == "__main__":
    main()
