"""The typed messages that flow between voice actors: frozen; all but microphone audio name a turn.

Times are `time.monotonic()` seconds. Audio is float32 mono numpy in [-1, 1] (see protocols.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class AudioChunk:
    """Microphone samples as captured. Belongs to no turn: a barge-in never drops them."""

    samples: np.ndarray  # [n] float32
    sample_rate: int
    captured_at: float


@dataclass(frozen=True, slots=True)
class Utterance:
    """One user utterance, cut by the voice detector."""

    turn: int
    audio: np.ndarray  # [n] float32
    sample_rate: int
    speech_end_at: float  # when the detector handed it on (its end decided, or a pause)
    # A continuation: the user resumed speaking before `continues` (the previous turn, cancelled)
    # was answered aloud; this turn answers the joined words. `earlier_audio` is that turn's
    # audio, for the recognizer when it never transcribed it.
    continues: int | None = None
    earlier_audio: np.ndarray | None = None


@dataclass(frozen=True, slots=True)
class UserTranscript:
    turn: int
    text: str
    asr_seconds: float


@dataclass(frozen=True, slots=True)
class RouteDecision:
    turn: int
    text: str
    task: str  # the router's label
    confidence: float  # softmax probability of `task`
    expert: str  # name in the expert pool
    device: str  # "cuda" or "cpu"


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """New final-channel text of the answer; `done` closes the turn's answer (text may be "")."""

    turn: int
    text: str
    done: bool = False


@dataclass(frozen=True, slots=True)
class TextChunk:
    """A piece of the answer ready to speak (a sentence or clause)."""

    turn: int
    index: int
    text: str
    last: bool
    ready_at: float  # when the token completing it arrived


@dataclass(frozen=True, slots=True)
class AudioOut:
    """Synthesized speech of one TextChunk."""

    turn: int
    index: int
    samples: np.ndarray  # [n] float32
    sample_rate: int
    last: bool
    text_ready_at: float  # TextChunk.ready_at, to measure token -> audio latency


class Control:
    """Marker base: control messages skip the queues and reach their targets at once."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class BargeIn(Control):
    """The user spoke over turn `turn`: abort its generation, drop its audio, stop playback."""

    turn: int
    at: float


# Stages of a turn, in the order they normally happen.
STAGES = (
    "speech_end",
    "asr_done",
    "routed",
    "first_token",
    "first_chunk",
    "first_audio_ready",
    "first_audio",
    "last_audio",
)


@dataclass(frozen=True, slots=True)
class TurnTiming:
    """When each stage of one turn happened (monotonic seconds; None: never reached)."""

    turn: int
    marks: tuple[tuple[str, float], ...]
    barged_in: bool = False

    def at(self, stage: str) -> float | None:
        return dict(self.marks).get(stage)

    def since_speech_end(self) -> dict[str, float]:
        """Stage -> seconds after the end of user speech, for the stages reached."""
        marks = dict(self.marks)
        start = marks.get("speech_end")
        if start is None:
            return {}
        return {stage: marks[stage] - start for stage in STAGES if stage in marks}
