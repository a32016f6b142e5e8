"""Router: hashed word and character n-grams summed into an MLP that labels a transcript's task.

The weights (`model.safetensors`) and the feature settings and labels (`config.json`) live in one
directory, written by scripts/train_router.py. Features are hashed with crc32, so they are the same
in every process and on every machine.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from noesis.errors import CheckpointError

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
_KEEP = re.compile(r"[^a-z0-9%+*/'-]+")


@dataclass(frozen=True)
class RouterConfig:
    labels: tuple[str, ...]
    num_buckets: int = 8192
    hidden: int = 64
    char_ngrams: tuple[int, ...] = (3, 4)
    word_ngrams: tuple[int, ...] = (1, 2)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RouterConfig:
        raw = json.loads(text)
        for key in ("labels", "char_ngrams", "word_ngrams"):
            raw[key] = tuple(raw[key])
        return cls(**raw)


def normalize(text: str) -> str:
    """Lowercase, every digit to 0, punctuation other than math signs to spaces: ASR output and
    typed text look alike, and unseen numbers look like seen ones."""
    text = re.sub(r"[0-9]", "0", text.lower())
    return " ".join(_KEEP.sub(" ", text).split())


def features(text: str, config: RouterConfig) -> list[int]:
    """Hashed bucket ids of the word and character n-grams of the normalized text."""
    text = normalize(text)
    words = text.split()
    grams = [
        f"w{n}:" + " ".join(words[i : i + n])
        for n in config.word_ngrams
        for i in range(len(words) - n + 1)
    ]
    padded = f" {text} "
    grams += [
        f"c{n}:" + padded[i : i + n] for n in config.char_ngrams for i in range(len(padded) - n + 1)
    ]
    return [zlib.crc32(gram.encode()) % config.num_buckets for gram in grams] or [0]


class RouterModel(nn.Module):
    """EmbeddingBag (a sum of bucket vectors: one linear layer over the sparse counts), ReLU,
    then a linear layer to the task logits."""

    def __init__(self, config: RouterConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.EmbeddingBag(config.num_buckets, config.hidden, mode="sum")
        self.bias = nn.Parameter(torch.zeros(config.hidden))
        self.out = nn.Linear(config.hidden, len(config.labels))

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.embedding(ids, offsets) + self.bias)  # [B, H]
        return self.out(hidden)  # [B, C]


def batch(texts: list[str], config: RouterConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened bucket ids and the offset of each text in them, as EmbeddingBag takes them."""
    lists = [features(text, config) for text in texts]
    offsets = torch.tensor([0] + [len(ids) for ids in lists[:-1]]).cumsum(0)
    return torch.tensor([i for ids in lists for i in ids]), offsets


class Router:
    """A trained RouterModel: `predict(text)` gives (task label, probability)."""

    def __init__(self, model: RouterModel) -> None:
        self.model = model.eval()
        self.config = model.config

    @classmethod
    def load(cls, path: str | Path) -> Router:
        from safetensors.torch import load_file

        path = Path(path)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (path / name).is_file():
                raise CheckpointError(f"router directory {path} has no {name}")
        model = RouterModel(RouterConfig.from_json((path / CONFIG_NAME).read_text()))
        state = load_file(path / WEIGHTS_NAME)
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:  # missing, unexpected or mis-shaped tensors
            raise CheckpointError(f"router weights in {path} do not fit its config: {exc}") from exc
        return cls(model)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_NAME).write_text(self.config.to_json())
        state = {k: v.detach().contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, path / WEIGHTS_NAME)

    @property
    def labels(self) -> tuple[str, ...]:
        return self.config.labels

    @torch.inference_mode()
    def probabilities(self, texts: list[str]) -> torch.Tensor:
        """Each text's label probabilities [B, labels]."""
        return torch.softmax(self.model(*batch(texts, self.config)), dim=-1)

    def predict_batch(self, texts: list[str]) -> list[tuple[str, float]]:
        best, index = self.probabilities(texts).max(dim=-1)
        pairs = zip(index.tolist(), best.tolist(), strict=True)
        return [(self.config.labels[i], p) for i, p in pairs]

    def predict(self, text: str) -> tuple[str, float]:
        return self.predict_batch([text])[0]

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())
