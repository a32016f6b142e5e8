"""Test audio made on the spot: espeak-ng and Piper speech at 16 kHz, silence, and noise.

Nothing here is a recording; every waveform is synthesized from text when a test asks for it, so the
tests need only espeak-ng (Debian) and the pip-installed voice.
"""

from __future__ import annotations

import functools

import numpy as np

from noesis.voice.audio import resample
from noesis.voice.tts import EspeakSynthesizer, PiperSynthesizer

RATE = 16000

# Open-domain sentences without digits (Whisper writes numbers as digits) or proper names.
SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Please turn off the lights in the kitchen.",
    "What is the weather going to be like tomorrow?",
    "I would like a cup of coffee with milk.",
    "The train to the city leaves in a few minutes.",
    "Can you remind me to call my mother tonight?",
    "She planted tomatoes and beans in the garden.",
    "How far is the nearest hospital from here?",
    "The museum is closed on public holidays.",
    "We need to buy bread, eggs and butter.",
    "Set an alarm for early tomorrow morning.",
    "The children are playing football in the park.",
    "Read me the latest news about science.",
    "My computer is running very slowly today.",
    "The concert was loud but the music was great.",
    "Could you explain how a rainbow forms?",
    "It started to rain just after we left the house.",
    "Send a message saying I will be late.",
    "The library has thousands of old books.",
    "He forgot his umbrella on the bus again.",
    "Which river is the longest in the world?",
    "Add sugar to the shopping list.",
    "The engine makes a strange noise when it is cold.",
    "Tell me a short story about a brave little mouse.",
    "Open the window because it is warm in here.",
    "The baker sells fresh bread every morning.",
    "Do you know where I left my keys?",
    "Turn the music down while I am on the phone.",
    "Birds fly south when the winter comes.",
    "Please book a table for dinner on Friday.",
)

# WER bounds the tests hold Whisper tiny.en to, each well above what benchmarks/voice_wer.py
# measured (Piper voice 2-4%, espeak-ng's formant voice about 15%).
PIPER_WER_BOUND = 0.12
ESPEAK_WER_BOUND = 0.40

COMMANDS = ("stop", "cancel", "louder", "quieter", "pause", "resume", "repeat that", "go back")


@functools.cache
def _piper() -> PiperSynthesizer:
    # No sampling noise (VITS samples it by default): the same text gives the same samples on
    # every run.
    return PiperSynthesizer(threads=1, noise_scale=0.0, noise_w=0.0)


@functools.cache
def _espeak() -> EspeakSynthesizer:
    return EspeakSynthesizer()


def piper_speech(text: str) -> np.ndarray:
    voice = _piper()
    return resample(voice.synthesize(text), voice.sample_rate, RATE)


def espeak_speech(text: str) -> np.ndarray:
    voice = _espeak()
    return resample(voice.synthesize(text), voice.sample_rate, RATE)


def speech(voice: str, text: str) -> np.ndarray:
    return {"piper": piper_speech, "espeak": espeak_speech}[voice](text)


def silence(seconds: float) -> np.ndarray:
    return np.zeros(round(seconds * RATE), dtype=np.float32)


def noise(seconds: float, level: float = 0.01, seed: int = 0) -> np.ndarray:
    """White Gaussian noise of standard deviation `level`."""
    rng = np.random.default_rng(seed)
    return (level * rng.standard_normal(round(seconds * RATE))).astype(np.float32)
