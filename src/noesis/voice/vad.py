"""Voice activity: Silero VAD on onnxruntime, and the end-of-turn state machine built on it.

`SileroVad` scores one 512-sample frame at 16 kHz, carrying the model's recurrent state and the
last 64 samples of the previous frame (the context the model was exported to expect).
`EndOfTurnDetector` turns those scores into SpeechStarted / SpeechEnded events, keeping a pre-roll
so the utterance handed on starts shortly before the speech was confirmed.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from noesis.errors import InvalidRequest
from noesis.voice import assets
from noesis.voice.audio import as_mono_float32
from noesis.voice.protocols import (
    SpeechEnded,
    SpeechPaused,
    SpeechResumed,
    SpeechStarted,
    VadEvent,
)

SAMPLE_RATE = 16000
FRAME_SAMPLES = 512  # what the 16 kHz Silero model takes per call
CONTEXT_SAMPLES = 64  # samples of the previous frame prepended to each call


class SpeechScorer(Protocol):
    """Probability that a frame of FRAME_SAMPLES samples at 16 kHz holds speech."""

    def __call__(self, frame: np.ndarray) -> float: ...

    def reset(self) -> None: ...


class SileroVad:
    """The Silero VAD ONNX model, one frame at a time; stateful across calls until `reset`."""

    def __init__(self, model_path: str | Path | None = None, threads: int = 1) -> None:
        import onnxruntime

        path = Path(model_path) if model_path else assets.locate(assets.SILERO_VAD)
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        self._session = onnxruntime.InferenceSession(
            str(path), sess_options=options, providers=["CPUExecutionProvider"]
        )
        self._rate = np.array(SAMPLE_RATE, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._context = np.zeros(CONTEXT_SAMPLES, dtype=np.float32)

    def __call__(self, frame: np.ndarray) -> float:
        if frame.shape != (FRAME_SAMPLES,):
            raise InvalidRequest(
                f"SileroVad takes frames of {FRAME_SAMPLES} samples, got {frame.shape}"
            )
        window = np.concatenate([self._context, frame.astype(np.float32)])[None, :]  # [1, 576]
        inputs = {"input": window, "state": self._state, "sr": self._rate}
        probability, self._state = self._session.run(None, inputs)  # [1, 1], [2, 1, 128]
        self._context = window[0, -CONTEXT_SAMPLES:]
        return float(probability[0, 0])


@dataclass(frozen=True)
class TurnConfig:
    threshold: float = 0.5  # a frame is speech from this probability
    release_threshold: float = 0.35  # once speaking, a frame stays speech down to this
    start_seconds: float = 0.2  # speech this long in a row confirms SpeechStarted
    end_seconds: float = 0.3  # silence this long in a row ends the turn
    # Silence this long in a row (shorter than end_seconds) hands the utterance on early
    # (SpeechPaused), so its recognition can start before the turn ends; None: never.
    early_end_seconds: float | None = None
    pre_roll_seconds: float = 0.3  # audio kept from before the speech run began
    max_utterance_seconds: float = 30.0  # a turn is cut here even without silence

    def __post_init__(self) -> None:
        if not 0.0 < self.release_threshold <= self.threshold < 1.0:
            raise InvalidRequest(
                "TurnConfig needs 0 < release_threshold <= threshold < 1, got "
                f"{self.release_threshold} and {self.threshold}"
            )
        for name in ("start_seconds", "end_seconds", "max_utterance_seconds"):
            if getattr(self, name) <= 0:
                raise InvalidRequest(f"TurnConfig.{name} must be positive")
        if self.pre_roll_seconds < 0:
            raise InvalidRequest("TurnConfig.pre_roll_seconds must be >= 0")
        early = self.early_end_seconds
        if early is not None and not 0.0 < early < self.end_seconds:
            raise InvalidRequest(
                f"TurnConfig.early_end_seconds must be in (0, end_seconds={self.end_seconds}), "
                f"got {early}"
            )


class EndOfTurnDetector:
    """VoiceActivityDetector: feed 16 kHz audio in any block size, get start/end-of-turn events."""

    sample_rate = SAMPLE_RATE
    frame_samples = FRAME_SAMPLES

    def __init__(
        self, config: TurnConfig | None = None, scorer: SpeechScorer | None = None
    ) -> None:
        self.config = config or TurnConfig()
        self.scorer = scorer if scorer is not None else SileroVad()
        frame_seconds = FRAME_SAMPLES / SAMPLE_RATE
        self._start_frames = max(1, round(self.config.start_seconds / frame_seconds))
        self._end_frames = max(1, round(self.config.end_seconds / frame_seconds))
        early = self.config.early_end_seconds
        # An early end that rounds to the end's own frame count would only repeat it.
        self._early_frames = (
            min(max(1, round(early / frame_seconds)), self._end_frames - 1) if early else 0
        )
        self._max_frames = max(1, round(self.config.max_utterance_seconds / frame_seconds))
        self._pre_roll_frames = round(self.config.pre_roll_seconds / frame_seconds)
        self.reset()

    def reset(self) -> None:
        self.scorer.reset()
        self._pending = np.zeros(0, dtype=np.float32)
        self._frames_fed = 0
        self._pre_roll: collections.deque[np.ndarray] = collections.deque(
            maxlen=self._pre_roll_frames
        )
        self._candidate: list[np.ndarray] = []  # a speech run not yet long enough to confirm
        self._utterance: list[np.ndarray] | None = None  # set while a turn is in progress
        self._silent_run = 0
        self._paused = False  # a SpeechPaused went out for the current silence run
        self.last_probability = 0.0

    @property
    def in_speech(self) -> bool:
        return self._utterance is not None

    def feed(self, samples: np.ndarray) -> list[VadEvent]:
        samples = as_mono_float32(samples)
        self._pending = np.concatenate([self._pending, samples])
        events: list[VadEvent] = []
        whole = len(self._pending) // FRAME_SAMPLES * FRAME_SAMPLES
        for frame in self._pending[:whole].reshape(-1, FRAME_SAMPLES):  # [n, 512]
            event = self._step(frame.copy())
            if event is not None:
                events.append(event)
        self._pending = self._pending[whole:]
        return events

    def finish(self) -> list[VadEvent]:
        """The audio source closed: end a turn still in progress (partial frame included)."""
        if self._utterance is None:
            self.reset()
            return []
        audio = np.concatenate([*self._utterance, self._pending])
        seconds = self._seconds_fed() + len(self._pending) / SAMPLE_RATE
        self.reset()
        return [SpeechEnded(at=seconds, audio=audio)]

    def _step(self, frame: np.ndarray) -> VadEvent | None:
        self._frames_fed += 1
        self.last_probability = self.scorer(frame)
        if self._utterance is None:
            return self._step_silent(frame, self.last_probability >= self.config.threshold)
        return self._step_speaking(frame, self.last_probability >= self.config.release_threshold)

    def _step_silent(self, frame: np.ndarray, voiced: bool) -> SpeechStarted | None:
        if not voiced:
            self._pre_roll.extend(self._candidate)
            self._pre_roll.append(frame)
            self._candidate = []
            return None
        self._candidate.append(frame)
        if len(self._candidate) < self._start_frames:
            return None
        self._utterance = [*self._pre_roll, *self._candidate]
        self._candidate, self._silent_run = [], 0
        self._pre_roll.clear()
        return SpeechStarted(at=self._seconds_fed())

    def _step_speaking(self, frame: np.ndarray, voiced: bool) -> VadEvent | None:
        assert self._utterance is not None
        self._utterance.append(frame)
        self._silent_run = 0 if voiced else self._silent_run + 1
        if voiced and self._paused:
            self._paused = False
            return SpeechResumed(at=self._seconds_fed())
        if self._silent_run < self._end_frames and len(self._utterance) < self._max_frames:
            if self._silent_run == self._early_frames and self._early_frames and not self._paused:
                self._paused = True  # the silence so far goes with it: a word's tail may be in it
                return SpeechPaused(at=self._seconds_fed(), audio=np.concatenate(self._utterance))
            return None
        audio = np.concatenate(self._utterance)
        self._utterance, self._silent_run, self._paused = None, 0, False
        return SpeechEnded(at=self._seconds_fed(), audio=audio)

    def _seconds_fed(self) -> float:
        return self._frames_fed * FRAME_SAMPLES / SAMPLE_RATE
