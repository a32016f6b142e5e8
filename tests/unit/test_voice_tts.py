"""Piper and espeak-ng synthesis: Piper id conventions, audible output, Whisper reading it back."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from voice_synth import ESPEAK_WER_BOUND, PIPER_WER_BOUND, SENTENCES

from noesis.voice.asr import word_error_rate
from noesis.voice.tts import (
    EspeakNotFound,
    EspeakSynthesizer,
    PiperSynthesizer,
    phonemize_clause,
)


@pytest.fixture(scope="module")
def piper() -> PiperSynthesizer:
    return PiperSynthesizer()


@pytest.fixture(scope="module")
def espeak() -> EspeakSynthesizer:
    return EspeakSynthesizer()


def _rms(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean(samples.astype(np.float64) ** 2)))


def _read_back(whisper, texts: list[str], clips: list[np.ndarray], rate: int) -> tuple[str, str]:
    """(what was said, what Whisper heard) for the clips half a second apart in one recording:
    one encoder pass (over a 30 s window, as the shared fixture runs it) instead of one per clip."""
    gap = np.zeros(rate // 2, dtype=np.float32)
    heard = whisper.transcribe(np.concatenate([part for c in clips for part in (c, gap)]), rate)
    return " ".join(texts), heard.text


def test_espeak_gives_ipa_and_we_keep_the_clause_punctuation():
    assert phonemize_clause("Hello,", "en-us") == "həlˈoʊ,"
    assert phonemize_clause("Is it?", "en-us") == "ɪz ˈɪt?"
    assert phonemize_clause("-v --help", "en-us")  # read as text on stdin, not as options


def test_piper_ids_follow_bos_pad_eos_conventions(piper):
    sentences = piper.phoneme_sentences("Hello, world. Is it?")
    assert sentences == ["həlˈoʊ, wˈɜːld.", "ɪz ˈɪt?"]
    ids = piper.phoneme_ids(sentences[0])
    id_map = piper.config["phoneme_id_map"]
    pad = id_map["_"][0]
    assert ids[:2] == [id_map["^"][0], pad] and ids[-1] == id_map["$"][0]
    assert all(i == pad for i in ids[1:-1:2])  # every phoneme is followed by a pad
    body = [i for i in ids[2:-1:2]]
    assert body[0] == id_map["h"][0] and id_map[","][0] in body and body[-1] == id_map["."][0]
    assert len(body) == len("həlˈoʊ, wˈɜːld.")  # each IPA character (already NFD) has an id


def test_piper_speech_is_audible_at_its_rate_and_whisper_reads_it_back(piper, whisper):
    assert piper.sample_rate == 22050 and piper.name == "piper:en_US-joe-medium"
    clips = []
    for text in SENTENCES[:4]:
        samples = piper.synthesize(text)
        assert samples.dtype == np.float32 and np.abs(samples).max() <= 1.0
        assert 0.8 < samples.size / piper.sample_rate < 6.0
        assert _rms(samples) > 0.02
        clips.append(samples)
    pairs = [_read_back(whisper, SENTENCES[:4], clips, piper.sample_rate)]
    assert word_error_rate(pairs) <= PIPER_WER_BOUND, pairs


def test_piper_joins_sentences_with_silence(piper):
    one = piper.synthesize("Stop the music.")
    two = piper.synthesize("Stop the music. Stop the music.")
    gap = round(piper.sentence_silence * piper.sample_rate)
    assert abs(two.size - (2 * one.size + gap)) < 0.25 * one.size  # VITS durations are sampled
    assert piper.synthesize("  ").size == 0 and piper.synthesize("...!").size == 0


def test_piper_without_noise_is_deterministic_and_length_scale_slows_it():
    steady = PiperSynthesizer(noise_scale=0.0, noise_w=0.0)
    first, second = steady.synthesize("Good morning."), steady.synthesize("Good morning.")
    np.testing.assert_array_equal(first, second)
    slow = PiperSynthesizer(noise_scale=0.0, noise_w=0.0, length_scale=1.5)
    assert slow.synthesize("Good morning.").size > 1.2 * first.size


def test_espeak_speech_is_audible_and_whisper_reads_it_back(espeak, whisper):
    assert espeak.sample_rate == 22050 and espeak.name == "espeak-ng:en-us"
    clips = []
    for text in SENTENCES[2:4]:
        samples = espeak.synthesize(text)
        assert samples.dtype == np.float32 and _rms(samples) > 0.02
        assert 0.8 < samples.size / espeak.sample_rate < 6.0
        clips.append(samples)
    pairs = [_read_back(whisper, SENTENCES[2:4], clips, espeak.sample_rate)]
    assert word_error_rate(pairs) <= ESPEAK_WER_BOUND, pairs
    assert espeak.synthesize("").size == 0


def test_missing_espeak_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(EspeakNotFound, match="apt-get install -y espeak-ng"):
        EspeakSynthesizer()
    with pytest.raises(EspeakNotFound, match="espeak-ng is not on PATH"):
        PiperSynthesizer()
