"""The contradiction sidecar: how strongly a branch's answer contradicts the request's context (its
last user message) and the other branches of the same request. The binding gate reads the score
(Branch.contradiction) in place of comparing exact answer strings.

The scorer is a small pair model (ContradictionModel) trained by scripts/train_contradiction.py on
pairs drawn from the bundled corpus; models/noesis-contradiction is bundled. A caller that runs
n > 1 branches tells the sidecar which requests are siblings and what they answer (`show`); a
"turn" cadence takes the context from the turn window the engine offers as a request is admitted.
"""

from __future__ import annotations

import json
import math
import re
import threading
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from noesis.errors import CheckpointError, ConfigError
from noesis.sidecars.runtime import Cadence, Placement, Result, Window
from noesis.sidecars.safety import final_channel

WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
DECISION = "contradiction"  # a window whose score reaches the threshold
# Numbers, words (letters and apostrophes), single punctuation marks.
TOKEN = re.compile(r"\d+(?:[.,]\d+)*|[^\W\d_]+(?:'[^\W\d_]+)?|[^\w\s]")
NUMBER, CAPITALIZED, WORD, MARK = range(4)  # token shapes
NEGATIONS = frozenset("""not no never none nothing neither nor cannot isn't aren't wasn't weren't
    can't won't don't doesn't didn't couldn't shouldn't wouldn't hasn't haven't hadn't""".split())
MAX_GROUP = 1024  # branch groups remembered; older ones (finished, aborted) are forgotten


@dataclass(frozen=True)
class ContradictionConfig:
    num_buckets: int = 4096  # hashed word ids
    embed: int = 32
    hidden: int = 64
    max_tokens: int = 64  # per text; a longer one keeps its last tokens (where answers are)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"


@dataclass(frozen=True, slots=True)
class Tokens:
    """One text's tokens as the model reads them."""

    ids: list[int]
    shapes: list[int]
    negations: list[int]  # 1 where the word denies ("not", "isn't")
    words: list[str]  # lowercased, for the exact-match feature


def tokenize(text: str, config: ContradictionConfig) -> Tokens:
    words = TOKEN.findall(text.replace("\u2019", "'"))[-config.max_tokens :] or ["."]
    shapes = [_shape(w) for w in words]
    keys = ["<num>" if s == NUMBER else w.lower() for w, s in zip(words, shapes, strict=True)]
    negations = [int(key in NEGATIONS) for key in keys]
    # Every number, and every negation, shares one id: unseen ones read like seen ones.
    keys = ["<not>" if n else key for key, n in zip(keys, negations, strict=True)]
    ids = [zlib.crc32(key.encode()) % config.num_buckets for key in keys]
    return Tokens(ids, shapes, negations, [_canonical(w) for w in words])


def _shape(word: str) -> int:
    if word[0].isdigit():
        return NUMBER
    if not word[0].isalpha():
        return MARK
    return CAPITALIZED if word[0].isupper() else WORD


def _canonical(word: str) -> str:
    """Lowercase; a number without thousands commas or a trailing .0 ("1,000.0" is "1000")."""
    word = word.lower()
    if word[0].isdigit():
        word = word.replace(",", "")
        if "." in word:
            word = word.rstrip("0").rstrip(".")
    return word


def encode_pairs(pairs: list[tuple[str, str]],
                 config: ContradictionConfig) -> dict[str, torch.Tensor]:
    """Padded model inputs for (premise, hypothesis) pairs: ids, shapes, flags (exact match,
    negation) and masks of each side ([B, L] each; flags [B, L, 2])."""
    sides: dict[str, list[list]] = {k: [] for k in ("ids_a", "shape_a", "flags_a", "ids_b",
                                                    "shape_b", "flags_b")}
    for premise, hypothesis in pairs:
        a, b = tokenize(premise, config), tokenize(hypothesis, config)
        in_a, in_b = set(a.words), set(b.words)
        for side, toks, other in (("a", a, in_b), ("b", b, in_a)):
            sides[f"ids_{side}"].append(toks.ids)
            sides[f"shape_{side}"].append(toks.shapes)
            sides[f"flags_{side}"].append([(int(w in other), n) for w, n in
                                           zip(toks.words, toks.negations, strict=True)])
    out = {}
    for key, rows in sides.items():
        width = max(len(r) for r in rows)
        pad = (0, 0) if key.startswith("flags") else 0
        out[key] = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    for side in ("a", "b"):
        lengths = torch.tensor([len(r) for r in sides[f"ids_{side}"]])
        out[f"mask_{side}"] = torch.arange(out[f"ids_{side}"].shape[1])[None] < lengths[:, None]
    return out


class ContradictionModel(nn.Module):
    """Decomposable attention (Parikh et al., 2016) over hashed words: each token is its word
    vector, its shape, whether it occurs in the other text and whether it denies; a width-3
    convolution adds its neighbours; each side soft-aligns to the other, compares, pools, and a
    small MLP gives the logits of (not contradiction, contradiction)."""

    def __init__(self, config: ContradictionConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden
        self.embedding = nn.Embedding(config.num_buckets, config.embed)
        self.project = nn.Linear(config.embed + 4 + 2, h)  # + shape one-hot + the two flags
        self.context = nn.Conv1d(h, h, kernel_size=3, padding=1)
        self.compare = nn.Linear(4 * h, h)
        self.hidden = nn.Linear(4 * h, h)
        self.out = nn.Linear(h, 2)

    def forward(self, ids_a, shape_a, flags_a, mask_a, ids_b, shape_b, flags_b, mask_b):
        a = self._encode(ids_a, shape_a, flags_a, mask_a)  # [B, La, H]
        b = self._encode(ids_b, shape_b, flags_b, mask_b)  # [B, Lb, H]
        affinity = a @ b.transpose(1, 2) / math.sqrt(self.config.hidden)  # [B, La, Lb]
        a_aligned = _masked_softmax(affinity, mask_b[:, None, :]) @ b  # [B, La, H]
        b_aligned = _masked_softmax(affinity.transpose(1, 2), mask_a[:, None, :]) @ a  # [B, Lb, H]
        pooled = torch.cat([self._pool(a, a_aligned, mask_a), self._pool(b, b_aligned, mask_b)], -1)
        return self.out(torch.relu(self.hidden(pooled)))  # [B, 2]

    def _encode(self, ids, shape, flags, mask) -> torch.Tensor:
        features = [self.embedding(ids), nn.functional.one_hot(shape, 4).float(), flags.float()]
        x = torch.relu(self.project(torch.cat(features, -1))) * mask[..., None]  # [B, L, H]
        local = torch.relu(self.context(x.transpose(1, 2))).transpose(1, 2)
        return (x + local) * mask[..., None]

    def _pool(self, x, aligned, mask) -> torch.Tensor:
        compared = torch.relu(self.compare(torch.cat([x, aligned, x - aligned, x * aligned], -1)))
        keep = mask[..., None]
        top = compared.masked_fill(~keep, -1e4).amax(1)  # [B, H]
        mean = (compared * keep).sum(1) / keep.sum(1).clamp(min=1)  # [B, H]
        return torch.cat([top, mean], -1)  # [B, 2H]


def _masked_softmax(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.softmax(scores.masked_fill(~mask, -1e4), dim=-1)


class ContradictionScorer:
    """A trained ContradictionModel: `score(pairs)` gives p(contradiction) per (premise,
    hypothesis) pair."""

    def __init__(self, model: ContradictionModel) -> None:
        self.model = model.eval()
        self.config = model.config

    @classmethod
    def load(cls, path: str | Path) -> ContradictionScorer:
        from safetensors.torch import load_file

        path = Path(path)
        for name in (CONFIG_NAME, WEIGHTS_NAME):
            if not (path / name).is_file():
                raise CheckpointError(f"contradiction model directory {path} has no {name}")
        try:
            config = ContradictionConfig(**json.loads((path / CONFIG_NAME).read_text()))
        except TypeError as exc:
            raise CheckpointError(f"{path / CONFIG_NAME}: {exc}") from exc
        model = ContradictionModel(config)
        state = {k: v.float() for k, v in load_file(path / WEIGHTS_NAME).items()}
        try:
            model.load_state_dict(state, strict=True)
        except RuntimeError as exc:  # missing, unexpected or mis-shaped tensors
            raise CheckpointError(f"contradiction weights in {path} do not fit its config: "
                                  f"{exc}") from exc
        return cls(model)

    def save(self, path: str | Path) -> None:
        """float16 weights (half the bytes; scores move by less than 1e-3)."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_NAME).write_text(self.config.to_json())
        state = {k: v.detach().half().contiguous() for k, v in self.model.state_dict().items()}
        save_file(state, path / WEIGHTS_NAME)

    @torch.inference_mode()
    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        if not pairs:
            return []
        logits = self.model(**encode_pairs(pairs, self.config))  # [B, 2]
        return torch.softmax(logits, dim=-1)[:, 1].tolist()

    @property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


@dataclass(frozen=True, slots=True)
class Contradiction:
    """One branch's scores: p(contradiction) against the context and the mean against the other
    branches that have answered (None: nothing to compare with); `score` is the larger."""

    context: float | None
    branches: float | None

    @property
    def score(self) -> float:
        return max((s for s in (self.context, self.branches) if s is not None), default=0.0)

    def __str__(self) -> str:
        parts = [f"{name} {value:.2f}" for name, value in
                 (("context", self.context), ("branches", self.branches)) if value is not None]
        return f"contradiction {self.score:.2f} ({', '.join(parts) or 'nothing to compare'})"


class ContradictionSidecar:
    """Branch text in (a window of a request's output), a Contradiction out; the decision
    "contradiction" at score >= threshold (counted in the metrics; the engine does not act on it:
    the gate reads the scores)."""

    name = "contradiction"

    def __init__(self, scorer: ContradictionScorer, threshold: float = 0.5, policy: str = "open",
                 cadence: Cadence | None = None, placement: Placement | None = None) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ConfigError(f"contradiction threshold must be in (0, 1], got {threshold!r}")
        self.scorer = scorer
        self.threshold = threshold
        self.policy = policy
        self.cadence = cadence or Cadence("clause")
        self.placement = placement or Placement()
        self._lock = threading.Lock()  # workers > 1 and the caller's `show` share what follows
        self._contexts: dict[str, str] = {}  # request id -> its last user message
        self._groups: dict[str, tuple[str, ...]] = {}  # request id -> its branch group's ids
        self._answers: dict[str, str] = {}  # request id -> its latest final-channel text

    @classmethod
    def load(cls, path: str | Path, **options) -> ContradictionSidecar:
        return cls(ContradictionScorer.load(path), **options)

    def show(self, request_ids: Iterable[str], context: str | None = None) -> None:
        """Declare the branches of one request (its n > 1 engine requests) and the context they
        answer; never waits on the scorer."""
        group = tuple(request_ids)
        with self._lock:
            for rid in group:
                self._groups[rid] = group
                if context is not None:
                    self._contexts[rid] = context
            while len(self._groups) > MAX_GROUP:
                self._forget(next(iter(self._groups)))

    def run(self, window: Window) -> Contradiction | None:
        """The branch's final-channel text so far against its context and its siblings' latest
        texts (None: no final text yet, or a turn window, whose text is the context)."""
        rid = window.request_id
        if self.cadence.kind == "turn" and not window.final:
            with self._lock:
                self._contexts[rid] = window.text
                while len(self._contexts) > MAX_GROUP:  # turns that never finished
                    del self._contexts[next(iter(self._contexts))]
            return None
        answer = final_channel(window.context).strip()
        with self._lock:
            group = self._groups.get(rid, ())
            if group and answer:
                self._answers[rid] = answer  # kept for its siblings until the group goes
            if window.final and not group:  # a lone request's context is done with
                context = self._contexts.pop(rid, None)
            else:
                context = self._contexts.get(rid)
            siblings = [self._answers[s] for s in group if s != rid and s in self._answers]
        if not answer:
            return None
        pairs = ([(context, answer)] if context else []) + [(s, answer) for s in siblings]
        scores = self.scorer.score(pairs)
        against = scores[1:] if context else scores
        return Contradiction(scores[0] if context else None,
                             sum(against) / len(against) if against else None)

    def decide(self, value: Contradiction | None) -> str | None:
        return DECISION if value is not None and value.score >= self.threshold else None

    def _forget(self, request_id: str) -> None:
        for rid in self._groups.pop(request_id, ()):
            self._groups.pop(rid, None)
            self._contexts.pop(rid, None)
            self._answers.pop(rid, None)


def latest_scores(results: Iterable[Result], name: str = ContradictionSidecar.name
                  ) -> dict[str, float]:
    """Request id -> the latest contradiction score among a step's sidecar results (failed and
    empty ones skipped): what Branch.contradiction takes."""
    scores = {}
    for result in results:
        if result.sidecar == name and isinstance(result.value, Contradiction):
            scores[result.request_id] = result.value.score
    return scores
