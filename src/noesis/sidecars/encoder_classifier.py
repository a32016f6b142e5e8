"""EncoderClassifier: a BERT-family encoder whose pooled token states a linear head labels, for
the sidecars that classify text (safety). The bundled safety classifier (models/noesis-safety) is
one: all-MiniLM-L6-v2 fine-tuned by scripts/train_safety_encoder.py.

A classifier directory is a sentence-transformers checkpoint (config.json, tokenizer, optional
modules.json and pooling config) whose config.json also holds

    "classifier": {"labels": ["safe", "unsafe"], "max_tokens": 64, "threshold": 0.995}

(`threshold`, optional: the p of the last label at which its trainer recommends acting, chosen
on its validation split) and whose weights hold the head, `classifier.weight` [labels, hidden]
and `classifier.bias` [labels], beside the encoder's. The head reads the pooled states as
trained, without the checkpoint's Normalize module (an embedding's unit length is for
similarity, not for a head).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from noesis.errors import CheckpointError
from noesis.sidecars.embedder import SentenceEmbedder, padded, pool
from noesis.weights.files import CONFIG_MAX_BYTES, read_json_file
from noesis.weights.safetensors_io import checkpoint_files, iter_tensors, tensor_index

HEAD = ("classifier.weight", "classifier.bias")


def is_encoder_classifier(path: str | Path) -> bool:
    """Whether `path` holds an encoder classifier (its config.json has a "classifier" table)."""
    config = Path(path) / "config.json"
    return config.is_file() and "classifier" in read_json_file(config, CONFIG_MAX_BYTES)


class EncoderClassifier:
    """Texts -> probabilities [N, labels] from an encoder checkpoint with a linear head."""

    def __init__(self, path: str | Path, device: str = "cpu") -> None:
        path = Path(path)
        settings = read_json_file(path / "config.json", CONFIG_MAX_BYTES).get("classifier")
        if not isinstance(settings, dict) or not isinstance(settings.get("labels"), list):
            raise CheckpointError(f"{path}/config.json: 'classifier' must be a table with a "
                                  "'labels' list")
        self.labels: tuple[str, ...] = tuple(str(label) for label in settings["labels"])
        threshold = settings.get("threshold")
        if threshold is not None and (isinstance(threshold, bool)
                                      or not isinstance(threshold, (int, float))
                                      or not 0 < threshold <= 1):
            raise CheckpointError(f"{path}/config.json: classifier.threshold must be in (0, 1], "
                                  f"got {threshold!r}")
        self.threshold: float | None = None if threshold is None else float(threshold)
        self.encoder = SentenceEmbedder(path, device=device)
        self.max_tokens = min(int(settings.get("max_tokens", self.encoder.pooling.max_tokens)),
                              self.encoder.pooling.max_tokens)
        weight, bias = _head(path, len(self.labels), self.encoder.dimensions)
        self.weight, self.bias = weight.to(self.encoder.device), bias.to(self.encoder.device)
        self._lock = threading.Lock()  # one forward at a time: torch's threads are shared

    @property
    def num_parameters(self) -> int:
        encoder = sum(p.numel() for p in self.encoder.model.parameters())
        return encoder + self.weight.numel() + self.bias.numel()

    def probabilities(self, texts: list[str]) -> torch.Tensor:
        """softmax(head(pool(encoder(text)))) [N, labels], float32 on the host; each text cut to
        max_tokens as in training (its [SEP] kept)."""
        ids = [self._ids(text) for text in texts]
        batch, mask = padded(ids)
        device = self.encoder.device
        with self._lock, torch.inference_mode():
            hidden = self.encoder.model(batch.to(device), mask.to(device)).float()
            pooled = pool(hidden, mask.to(device), self.encoder.pooling.mode)
            logits = pooled @ self.weight.T + self.bias
        return torch.softmax(logits, dim=-1).cpu()

    def _ids(self, text: str) -> list[int]:
        ids = self.encoder.tokenizer.encode(text) or [0]
        return ids if len(ids) <= self.max_tokens else ids[: self.max_tokens - 1] + ids[-1:]


def _head(path: Path, labels: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    index = tensor_index(checkpoint_files(path))
    missing = [name for name in HEAD if name not in index]
    if missing:
        raise CheckpointError(f"{path}: the classifier head {missing} is missing")
    tensors = {}
    for name in HEAD:
        for key, tensor in iter_tensors(index[name][0], [name]):
            tensors[key] = tensor.float()
    weight, bias = tensors[HEAD[0]], tensors[HEAD[1]]
    if tuple(weight.shape) != (labels, hidden) or tuple(bias.shape) != (labels,):
        raise CheckpointError(f"{path}: classifier head {list(weight.shape)} / "
                              f"{list(bias.shape)} does not fit {labels} labels over {hidden}")
    return weight, bias
