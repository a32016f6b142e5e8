"""The seams of the voice pipeline: what a recognizer, a synthesizer and a voice detector provide.

Audio crosses every seam as float32 mono numpy samples in [-1, 1] at a stated sample rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class Transcript:
    text: str
    seconds: float  # compute time spent recognizing
    confidence: float | None = None


class SpeechRecognizer(Protocol):
    name: str

    def transcribe(self, audio: np.ndarray, sample_rate: int) -> Transcript: ...


class SpeechSynthesizer(Protocol):
    name: str
    sample_rate: int

    def synthesize(self, text: str) -> np.ndarray: ...


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    at: float  # seconds of audio fed so far when speech was confirmed


@dataclass(frozen=True, slots=True)
class SpeechEnded:
    at: float  # seconds of audio fed so far when the end of the turn was decided
    audio: np.ndarray  # the utterance, from shortly before its start to its end


@dataclass(frozen=True, slots=True)
class SpeechPaused:
    """The speaker has been silent for the early-end time (shorter than the end of turn): the
    utterance so far, handed on so that recognizing and answering it can start before the turn
    is decided. SpeechResumed or SpeechEnded follows."""

    at: float
    audio: np.ndarray


@dataclass(frozen=True, slots=True)
class SpeechResumed:
    """Speech came back after a SpeechPaused, before the end of the turn: the paused utterance
    was not the whole turn."""

    at: float


VadEvent = SpeechStarted | SpeechPaused | SpeechResumed | SpeechEnded


class VoiceActivityDetector(Protocol):
    sample_rate: int
    frame_samples: int

    def feed(self, samples: np.ndarray) -> list[VadEvent]: ...

    def reset(self) -> None: ...
