"""The safety sidecar: a streaming classifier over the final channel. Each window's new clauses of
the text a user reads are scored; past the threshold the decision is "block", and the engine ends
the request with finish_reason "content_filter" and the verdict as its reason.

The classifier is an encoder with a linear head (noesis.sidecars.encoder_classifier; the bundled
models/noesis-safety is all-MiniLM-L6-v2 fine-tuned by scripts/train_safety_encoder.py) or the
router's model (noesis.voice.router: hashed n-grams and an MLP, scripts/train_safety.py), with
the labels "safe" and "unsafe".
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from noesis.errors import ConfigError
from noesis.sidecars.encoder_classifier import EncoderClassifier, is_encoder_classifier
from noesis.sidecars.runtime import CLAUSE_END, Cadence, Placement, Window
from noesis.voice.router import Router

UNSAFE = "unsafe"
DEFAULT_THRESHOLD = 0.8  # p(unsafe) that blocks when neither the config nor the model sets one
THINK = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL)  # an unclosed one runs to the end
HARMONY_FINAL = "<|channel|>final<|message|>"
HARMONY_CHANNEL = "<|channel|>"
MIN_CLAUSE_CHARS = 12  # "Sure." alone says nothing: shorter clauses join the next one


def final_channel(text: str) -> str:
    """What a user reads of `text`: reasoning (`<think>...</think>`) dropped; in Harmony markup,
    what follows the last final-channel header (nothing before one)."""
    if HARMONY_FINAL in text:
        return text.rsplit(HARMONY_FINAL, 1)[1]
    if HARMONY_CHANNEL in text:
        return ""
    return THINK.sub("", text)


@dataclass(frozen=True, slots=True)
class Verdict:
    p_unsafe: float  # the highest of the window's clauses
    clause: str  # the clause that scored it

    def __str__(self) -> str:
        return f"unsafe content (p={self.p_unsafe:.2f}): {self.clause.strip()[:120]!r}"


class SafetySidecar:
    """Scores each window's new final-channel clauses; "block" at p(unsafe) >= threshold."""

    name = "safety"

    def __init__(self, classifier: EncoderClassifier | Router, threshold: float | None = None,
                 policy: str = "open", cadence: Cadence | None = None,
                 placement: Placement | None = None) -> None:
        """threshold None: the classifier's own (an encoder classifier's config may recommend
        one, chosen on its validation split), else DEFAULT_THRESHOLD."""
        if UNSAFE not in classifier.labels:
            raise ConfigError(f"a safety classifier needs the label {UNSAFE!r}; this one has "
                              f"{list(classifier.labels)}")
        if threshold is None:
            threshold = getattr(classifier, "threshold", None) or DEFAULT_THRESHOLD
        if not 0.0 < threshold <= 1.0:
            raise ConfigError(f"safety threshold must be in (0, 1], got {threshold!r}")
        self.classifier = classifier
        self.unsafe_index = classifier.labels.index(UNSAFE)
        self.threshold = threshold
        self.policy = policy
        self.cadence = cadence or Cadence("clause")
        self.placement = placement or Placement()

    @classmethod
    def load(cls, path: str | Path, **options) -> SafetySidecar:
        """An encoder classifier's directory (config.json with a "classifier" table), loaded
        on the placement's device, or a router's (CPU)."""
        placement = options.get("placement")
        classifier = (EncoderClassifier(path, device=placement.device if placement else "cpu")
                      if is_encoder_classifier(path) else Router.load(path))
        return cls(classifier, **options)

    def run(self, window: Window) -> Verdict | None:
        """The most unsafe of the window's clauses (None: no final-channel text in it)."""
        return self.run_batch([window])[0]

    def run_batch(self, windows: list[Window]) -> list[Verdict | None]:
        """`run` of each window, their clauses scored in one classifier call."""
        clauses = [split_clauses(_new_final_text(w)) for w in windows]
        flat = [c for cs in clauses for c in cs]
        if not flat:
            return [None] * len(windows)
        scores = self.classifier.probabilities(flat)[:, self.unsafe_index]  # [N]
        verdicts, at = [], 0
        for cs in clauses:
            if not cs:
                verdicts.append(None)
                continue
            best = at + int(scores[at: at + len(cs)].argmax())
            verdicts.append(Verdict(float(scores[best]), flat[best]))
            at += len(cs)
        return verdicts

    def decide(self, verdict: Verdict | None) -> str | None:
        return "block" if verdict is not None and verdict.p_unsafe >= self.threshold else None


def _new_final_text(window: Window) -> str:
    """The final-channel text the window adds to its context."""
    before = final_channel(window.context[: window.start])
    after = final_channel(window.context[: window.start + len(window.text)])
    return after[len(before):] if after.startswith(before) else after


def split_clauses(text: str) -> list[str]:
    """`text` cut after each clause end; a clause shorter than MIN_CLAUSE_CHARS joins the next
    (the last one stays, however short)."""
    clauses, start, pending = [], 0, ""
    for match in CLAUSE_END.finditer(text):
        pending += text[start : match.end()]
        start = match.end()
        if len(pending.strip()) >= MIN_CLAUSE_CHARS:
            clauses.append(pending)
            pending = ""
    pending += text[start:]
    if pending.strip():
        clauses.append(pending)
    return clauses
