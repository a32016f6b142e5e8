"""SpeculativeConfig: which proposer, how deep, and the adaptive-depth knobs. Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass

from noesis.errors import ConfigError

METHODS = ("draft", "ngram")
MAX_DEPTH = 16  # verify runs k + 1 target positions per row; past ~16 acceptance decays to nothing
MAX_NGRAM = 64
MIN_DRAFT_VOCAB = 256  # a head smaller than the byte-level alphabet cannot spell most text


@dataclass(frozen=True)
class SpeculativeConfig:
    """How a request's next tokens are guessed before one target forward checks them.

    `method="draft"` runs a smaller checkpoint that shares the target's tokenizer (`draft` is
    its path or hub id); `method="ngram"` looks the last few tokens up in the prompt and output
    so far and proposes what followed them. `k` is the largest number of tokens proposed per
    step (the depth the adaptive controller may go up to).

    Defaults:
    - ngram_max=4, ngram_min=2: the longest suffix tried first, down to the shortest.
    - adaptive=True: the depth follows the request's rolling acceptance rate.
    - acceptance_window=32: that rate counts the last 32 proposed tokens.
    - marginal_acceptance=0.3: propose the j-th token only while acceptance**j >= 0.3, the
      estimated chance it is used.
    - min_acceptance=0.55: below this rate the request backs off to plain decoding...
    - min_samples=8: ...once at least this many proposed tokens back the estimate.
    - reprobe_after=16: plain steps before proposing again; doubles after each failed probe,
      up to max_reprobe_after=256.
    - entropy_cutoff=3.0: the draft model stops drafting at a position whose own distribution
      has more entropy than this (nats); math.inf never stops early. Unused by "ngram".
    - max_batch=None: no fixed limit; N: no request speculates while more than N run (a large
      batch is compute-bound: verifying k + 1 positions per row then costs what it saves). With
      CUDA graphs (the default on CUDA) speculation also pauses while the running sequences plus
      their proposals exceed the largest graph (min(max_num_seqs * (k + 1), 128) rows, so at
      k=4 beyond 25 running): an eager verify step costs ~20 graph steps on a launch-bound
      model, and 128+ tokens per forward nears the compute-bound regime of a large one.
    - draft_vocab=None: the draft's LM head scores every token. N: it keeps N rows only, the
      tokens with the N lowest ids (BPE vocabularies number their tokens in merge order and
      SentencePiece ones by score, so these are roughly the most frequent) plus every control
      token and end-of-sequence id, and proposes from those alone. The head is most of a small
      draft's bytes at a 100k+ vocabulary, so each drafted token reads less; verification stays
      exact (a token the draft cannot propose is still what the target may pick), only the
      acceptance can fall. Unused by "ngram".
    """

    method: str
    draft: str | None = None
    k: int = 4
    ngram_max: int = 4
    ngram_min: int = 2
    adaptive: bool = True
    acceptance_window: int = 32
    marginal_acceptance: float = 0.3
    min_acceptance: float = 0.55
    min_samples: int = 8
    reprobe_after: int = 16
    max_reprobe_after: int = 256
    entropy_cutoff: float = 3.0
    max_batch: int | None = None
    draft_vocab: int | None = None

    def __post_init__(self) -> None:
        self._check_method()
        _check_int("k", self.k, 1, MAX_DEPTH)
        _check_int("ngram_min", self.ngram_min, 1, MAX_NGRAM)
        _check_int("ngram_max", self.ngram_max, self.ngram_min, MAX_NGRAM,
                   hint=" (and at least ngram_min)")
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"SpeculativeConfig.adaptive must be a bool, got {self.adaptive!r}")
        _check_int("acceptance_window", self.acceptance_window, 1, 1 << 20)
        _check_fraction("marginal_acceptance", self.marginal_acceptance)
        _check_fraction("min_acceptance", self.min_acceptance)
        _check_int("min_samples", self.min_samples, 1, 1 << 20)
        _check_int("reprobe_after", self.reprobe_after, 1, 1 << 20)
        _check_int("max_reprobe_after", self.max_reprobe_after, self.reprobe_after, 1 << 20,
                   hint=" (and at least reprobe_after)")
        if self.max_batch is not None:
            _check_int("max_batch", self.max_batch, 1, 1 << 20)
        if self.draft_vocab is not None:
            _check_int("draft_vocab", self.draft_vocab, MIN_DRAFT_VOCAB, 1 << 24)
            if self.method != "draft":
                raise ConfigError(
                    f"SpeculativeConfig.draft_vocab is only used with method='draft'; got "
                    f"{self.draft_vocab!r} with method={self.method!r}"
                )
        if not _is_number(self.entropy_cutoff) or not self.entropy_cutoff > 0:
            raise ConfigError(
                f"SpeculativeConfig.entropy_cutoff must be a positive number of nats (math.inf "
                f"disables it), got {self.entropy_cutoff!r}"
            )

    def _check_method(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(
                f"SpeculativeConfig.method must be one of {', '.join(METHODS)}, got {self.method!r}"
            )
        if self.method == "draft" and not (isinstance(self.draft, str) and self.draft):
            raise ConfigError(
                "SpeculativeConfig.draft must name the draft checkpoint (a path or hub id) when "
                f"method='draft', got {self.draft!r}"
            )
        if self.method == "ngram" and self.draft is not None:
            raise ConfigError(
                f"SpeculativeConfig.draft is only used with method='draft'; got {self.draft!r} "
                "with method='ngram'"
            )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _check_int(name: str, value: object, lo: int, hi: int, hint: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"SpeculativeConfig.{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"SpeculativeConfig.{name} must be in [{lo}, {hi}]{hint}, got {value}")


def _check_fraction(name: str, value: object) -> None:
    if not _is_number(value) or not 0.0 <= value <= 1.0:
        raise ConfigError(f"SpeculativeConfig.{name} must be a number in [0, 1], got {value!r}")
