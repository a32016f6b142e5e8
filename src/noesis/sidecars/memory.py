"""Memory: the first sidecar. Each finished request's text is embedded off the hot path (the
embedder on a sidecar worker) and kept; `recall` ranks what was kept by cosine similarity."""

from __future__ import annotations

import threading

import torch

from noesis.sidecars.embedder import SentenceEmbedder
from noesis.sidecars.runtime import Cadence, Placement, Window


class Memory:
    """Texts and their embeddings, appended from a sidecar worker and read from any thread."""

    def __init__(self, embedder: SentenceEmbedder) -> None:
        self.embedder = embedder
        self._texts: list[str] = []
        self._vectors: list[torch.Tensor] = []  # [D] each, unit length
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._texts)

    def add(self, text: str) -> None:
        """Embed `text` (truncated to the embedder's length) and keep it."""
        self.add_many([text])

    def add_many(self, texts: list[str]) -> None:
        """`add` of each text, embedded in one batch."""
        if not texts:
            return
        vectors = self._embed_many(texts)
        with self._lock:
            self._texts.extend(texts)
            self._vectors.extend(vectors)

    def recall(self, query: str, k: int = 3) -> list[tuple[str, float]]:
        """The `k` kept texts most like `query`: (text, cosine similarity), best first."""
        with self._lock:
            texts, vectors = list(self._texts), list(self._vectors)
        if not texts or k < 1:
            return []
        scores = torch.stack(vectors) @ self._embed(query)  # [N]
        top = scores.topk(min(k, len(texts)))
        return [(texts[i], float(s)) for s, i in zip(top.values, top.indices.tolist(), strict=True)]

    def _embed(self, text: str) -> torch.Tensor:
        return self._embed_many([text])[0]

    def _embed_many(self, texts: list[str]) -> torch.Tensor:
        ids = [self.embedder.tokenize(text, truncate=True) for text in texts]
        return torch.nn.functional.normalize(self.embedder.embed(ids), dim=-1)  # [N, D]


class MemorySidecar:
    """Keeps the whole text of every finished request in a Memory (fail open: a turn that could
    not be embedded is only missing from recall)."""

    name = "memory"
    cadence = Cadence("request")
    policy = "open"

    def __init__(self, memory: Memory, placement: Placement | None = None) -> None:
        self.memory = memory
        self.placement = placement or Placement()

    def run(self, window: Window) -> bool:
        """Whether the window's text was kept (an empty one is not)."""
        return self.run_batch([window])[0]

    def run_batch(self, windows: list[Window]) -> list[bool]:
        """`run` of each window, the kept texts embedded in one batch."""
        kept = [bool(window.context.strip()) for window in windows]
        self.memory.add_many([w.context for w, keep in zip(windows, kept, strict=True) if keep])
        return kept

    def decide(self, stored: bool) -> str | None:
        return "stored" if stored else None
