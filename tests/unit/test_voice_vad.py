"""Silero VAD on onnxruntime and the end-of-turn state machine, on synthesized speech and noise."""

from __future__ import annotations

import numpy as np
import pytest
from voice_synth import SENTENCES, noise, piper_speech, silence

from noesis.errors import InvalidRequest
from noesis.voice.protocols import SpeechEnded, SpeechPaused, SpeechResumed, SpeechStarted
from noesis.voice.vad import FRAME_SAMPLES, EndOfTurnDetector, SileroVad, TurnConfig

RATE = 16000
FRAME_SECONDS = FRAME_SAMPLES / RATE


class ScriptedScorer:
    """Stands in for Silero: returns the next scripted probability for each frame."""

    def __init__(self, probabilities: list[float]) -> None:
        self.probabilities = probabilities
        self.calls = 0

    def __call__(self, frame: np.ndarray) -> float:
        assert frame.shape == (FRAME_SAMPLES,)
        self.calls += 1
        return self.probabilities[self.calls - 1]

    def reset(self) -> None:
        self.calls = 0


def _frames(values: list[float]) -> np.ndarray:
    """One frame per value, each frame filled with its value (so audio shows which frame it is)."""
    return np.repeat(np.array(values, np.float32), FRAME_SAMPLES)


def _feed_in_blocks(detector, audio: np.ndarray, block: int) -> list:
    events = []
    for start in range(0, audio.size, block):
        events += detector.feed(audio[start : start + block])
    return events


def _onset_and_offset(speech: np.ndarray, level: float = 0.02) -> tuple[float, float]:
    loud = np.flatnonzero(np.abs(speech) > level)
    return loud[0] / RATE, loud[-1] / RATE


@pytest.fixture(scope="module")
def silero() -> SileroVad:
    return SileroVad()


def test_silero_scores_speech_high_and_noise_low(silero):
    speech = piper_speech(SENTENCES[0])
    silero.reset()
    speech_scores = [silero(f) for f in speech[: speech.size // 512 * 512].reshape(-1, 512)]
    silero.reset()
    hiss = noise(2.0, level=0.02)
    noise_scores = [silero(f) for f in hiss[: hiss.size // 512 * 512].reshape(-1, 512)]
    assert np.mean(np.array(speech_scores) > 0.5) > 0.6
    assert max(noise_scores) < 0.3


def test_silero_rejects_wrong_frame_size(silero):
    with pytest.raises(InvalidRequest, match="512"):
        silero(np.zeros(480, np.float32))


def test_turns_in_synthesized_speech_with_noise_and_silence(silero):
    first, second = piper_speech(SENTENCES[1]), piper_speech(SENTENCES[2])
    lead = noise(1.0, level=0.005, seed=1)
    gap = silence(1.2) + noise(1.2, level=0.003, seed=2)
    audio = np.concatenate([lead, first, gap, second, silence(1.0)])
    detector = EndOfTurnDetector(scorer=silero)
    events = _feed_in_blocks(detector, audio, block=1600)  # 100 ms blocks, not frame-aligned
    assert [type(e) for e in events] == [SpeechStarted, SpeechEnded, SpeechStarted, SpeechEnded]
    offsets = [lead.size / RATE, (lead.size + first.size + gap.size) / RATE]
    for (started, ended), speech, offset in zip(
        (events[:2], events[2:]), (first, second), offsets, strict=True
    ):
        onset, offset_end = (offset + t for t in _onset_and_offset(speech))
        # The confirming run of voiced frames (0.2 s = 6 frames, ending at started.at) may begin
        # on the speech's faint first samples, tens of ms before its loud onset, but never
        # before any speech at all.
        first_sound = offset + _onset_and_offset(speech, level=0.002)[0]
        first_voiced_frame_end = started.at - (detector._start_frames - 1) * FRAME_SECONDS
        assert first_voiced_frame_end >= first_sound and started.at <= onset + 0.6
        assert offset_end + 0.3 <= ended.at + FRAME_SECONDS and ended.at <= offset_end + 1.0
        utterance_start = ended.at - ended.audio.size / RATE
        assert utterance_start <= onset  # pre-roll: the first syllable is not clipped
        assert utterance_start >= onset - 0.3 - 0.6


def test_state_machine_confirms_only_long_enough_runs_and_keeps_pre_roll():
    # 7 silent frames, a 3-frame blip (too short for 0.2 s = 6 frames), 3 silent, 8 voiced,
    # then voiced-enough (hysteresis) and silent frames.
    script = [0.1] * 7 + [0.9] * 3 + [0.1] * 3 + [0.9] * 8 + [0.4, 0.9] + [0.1] * 10
    detector = EndOfTurnDetector(
        TurnConfig(pre_roll_seconds=4 * FRAME_SECONDS), ScriptedScorer(script)
    )
    audio = _frames([float(i) / 100 for i in range(len(script))])
    events = _feed_in_blocks(detector, audio, block=700)
    assert [type(e) for e in events] == [SpeechStarted, SpeechEnded]
    assert events[0].at == pytest.approx(19 * FRAME_SECONDS)  # 13 before, 6th voiced frame
    # 0.3 s is 9 frames of silence after the last voiced frame (frame 22)
    assert events[1].at == pytest.approx(32 * FRAME_SECONDS)
    frames_kept = events[1].audio[::FRAME_SAMPLES] * 100
    np.testing.assert_allclose(frames_kept, np.arange(9, 32), atol=1e-4)  # 4 pre-roll frames


def test_state_machine_is_configurable_and_cuts_long_turns():
    config = TurnConfig(
        start_seconds=2 * FRAME_SECONDS,
        end_seconds=3 * FRAME_SECONDS,
        pre_roll_seconds=0.0,
        max_utterance_seconds=10 * FRAME_SECONDS,
    )
    script = [0.9] * 2 + [0.1] * 3 + [0.9] * 20
    detector = EndOfTurnDetector(config, ScriptedScorer(script))
    events = detector.feed(_frames([0.0] * len(script)))
    kinds = [(type(e).__name__, round(e.at / FRAME_SECONDS)) for e in events]
    assert kinds == [
        ("SpeechStarted", 2),
        ("SpeechEnded", 5),  # 3 silent frames end it
        ("SpeechStarted", 7),
        ("SpeechEnded", 15),  # cut at 10 frames of utterance
        ("SpeechStarted", 17),
        ("SpeechEnded", 25),
    ]
    assert events[1].audio.size == 5 * FRAME_SAMPLES


def test_an_early_end_hands_the_utterance_on_at_a_pause_and_says_when_speech_resumes():
    config = TurnConfig(
        start_seconds=2 * FRAME_SECONDS,
        end_seconds=6 * FRAME_SECONDS,
        early_end_seconds=2 * FRAME_SECONDS,
        pre_roll_seconds=0.0,
    )
    # 3 voiced, a 3-frame pause (past the early end, short of the end), 2 voiced, 8 silent.
    script = [0.9] * 3 + [0.1] * 3 + [0.9] * 2 + [0.1] * 8
    detector = EndOfTurnDetector(config, ScriptedScorer(script))
    events = detector.feed(_frames([float(i) / 100 for i in range(len(script))]))
    kinds = [(type(e).__name__, round(e.at / FRAME_SECONDS)) for e in events]
    assert kinds == [
        ("SpeechStarted", 2),
        ("SpeechPaused", 5),  # 2 silent frames after frame 3
        ("SpeechResumed", 7),
        ("SpeechPaused", 10),  # once per silence run, then the end after 6 silent frames
        ("SpeechEnded", 14),
    ]
    first, second, ended = events[1].audio, events[3].audio, events[4].audio
    assert first.size == 5 * FRAME_SAMPLES and second.size == 10 * FRAME_SAMPLES
    np.testing.assert_array_equal(ended[: second.size], second)  # the same utterance, growing
    assert isinstance(events[1], SpeechPaused) and isinstance(events[2], SpeechResumed)
    with pytest.raises(InvalidRequest, match="early_end_seconds"):
        TurnConfig(end_seconds=0.3, early_end_seconds=0.3)


def test_block_size_does_not_change_events_and_reset_restarts():
    script = ([0.1] * 5 + [0.9] * 10 + [0.1] * 12) * 2
    audio = _frames([0.0] * len(script))
    one = _feed_in_blocks(EndOfTurnDetector(scorer=ScriptedScorer(script)), audio, block=1)
    big = _feed_in_blocks(EndOfTurnDetector(scorer=ScriptedScorer(script)), audio, block=10000)
    assert [(type(e), e.at) for e in one] == [(type(e), e.at) for e in big]
    assert len(one) == 4
    detector = EndOfTurnDetector(scorer=ScriptedScorer(script))
    detector.feed(audio[: 8 * FRAME_SAMPLES])
    assert not detector.in_speech
    detector.feed(audio[8 * FRAME_SAMPLES : 11 * FRAME_SAMPLES])
    assert detector.in_speech
    detector.feed(audio[11 * FRAME_SAMPLES : 12 * FRAME_SAMPLES + 100])
    (ended,) = detector.finish()  # the source closed mid-turn
    assert isinstance(ended, SpeechEnded) and not detector.in_speech
    assert ended.audio.size == 12 * FRAME_SAMPLES + 100  # the 5 silent frames are all pre-roll
    assert detector.finish() == []
    detector.feed(audio[: 8 * FRAME_SAMPLES])
    detector.reset()
    assert not detector.in_speech and detector.feed(audio[:FRAME_SAMPLES]) == []


def test_bad_config_and_input_raise():
    with pytest.raises(InvalidRequest, match="release_threshold"):
        TurnConfig(threshold=0.3, release_threshold=0.5)
    with pytest.raises(InvalidRequest, match="end_seconds"):
        TurnConfig(end_seconds=0)
    detector = EndOfTurnDetector(scorer=ScriptedScorer([0.0]))
    with pytest.raises(ValueError, match="mono"):
        detector.feed(np.zeros((512, 2), np.float32))
