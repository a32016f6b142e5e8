"""WAV reading/writing, resampling, and the sound-card errors of noesis.voice.audio."""

from __future__ import annotations

import struct
import sys
import types

import numpy as np
import pytest

from noesis.voice import audio
from noesis.voice.audio import (
    AudioDeviceUnavailable,
    AudioFormatError,
    Microphone,
    decode_wav,
    read_wav,
    resample,
    write_wav,
)


def _riff(fmt_tag: int, channels: int, rate: int, bits: int, payload: bytes, extra=b"") -> bytes:
    block = channels * bits // 8
    fmt = struct.pack("<HHIIHH", fmt_tag, channels, rate, rate * block, block, bits) + extra
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt
    body += b"data" + struct.pack("<I", len(payload)) + payload
    return b"RIFF" + struct.pack("<I", len(body)) + body


def _tone(rate: int, seconds: float = 0.5, hz: float = 440.0) -> np.ndarray:
    return (0.5 * np.sin(2 * np.pi * hz * np.arange(round(rate * seconds)) / rate)).astype(
        np.float32
    )


def test_pcm16_round_trip_is_within_one_quantization_step(tmp_path):
    tone = _tone(16000)
    write_wav(tmp_path / "a.wav", tone, 16000)
    samples, rate = read_wav(tmp_path / "a.wav")
    assert rate == 16000 and samples.dtype == np.float32 and samples.shape == tone.shape
    assert np.abs(samples - tone).max() <= 1.0 / 32767


def test_float32_round_trip_is_exact(tmp_path):
    tone = _tone(22050)
    write_wav(tmp_path / "f.wav", tone, 22050, float32=True)
    samples, rate = read_wav(tmp_path / "f.wav")
    assert rate == 22050
    np.testing.assert_array_equal(samples, tone)


def test_pcm16_clips_out_of_range_samples(tmp_path):
    write_wav(tmp_path / "c.wav", np.array([2.0, -3.0, 0.25], np.float32), 8000)
    samples, _ = read_wav(tmp_path / "c.wav")
    np.testing.assert_allclose(samples, [32767 / 32768, -32767 / 32768, 0.25], atol=1e-4)


def test_stereo_is_mixed_down_to_the_channel_mean():
    left = np.array([1000, -2000, 3000], np.int16)
    right = np.array([3000, 2000, -3000], np.int16)
    payload = np.stack([left, right], axis=1).astype("<i2").tobytes()  # interleaved L R
    samples, rate = decode_wav(_riff(1, 2, 44100, 16, payload))
    assert rate == 44100
    np.testing.assert_allclose(samples, [2000 / 32768, 0.0, 0.0], atol=1e-7)


def test_24_bit_8_bit_and_extensible_float_decode():
    values = [0, 1 << 22, -(1 << 22), (1 << 23) - 1]
    pcm24 = b"".join(struct.pack("<i", v)[:3] for v in values)
    samples, _ = decode_wav(_riff(1, 1, 16000, 24, pcm24))
    np.testing.assert_allclose(samples, [0.0, 0.5, -0.5, 1.0 - 2**-23], atol=1e-7)
    samples, _ = decode_wav(_riff(1, 1, 8000, 8, bytes([128, 192, 64])))
    np.testing.assert_allclose(samples, [0.0, 0.5, -0.5])
    # WAVE_FORMAT_EXTENSIBLE whose sub-format GUID starts with 3 (IEEE float)
    extra = struct.pack("<HHI", 22, 32, 4) + struct.pack("<H", 3) + bytes(14)
    floats = np.array([0.25, -0.75], "<f4").tobytes()
    samples, _ = decode_wav(_riff(0xFFFE, 1, 16000, 32, floats, extra))
    np.testing.assert_array_equal(samples, [0.25, -0.75])


def test_streamed_header_with_oversized_data_length_reads_what_is_there():
    payload = np.array([100, -100], "<i2").tobytes()
    data = bytearray(_riff(1, 1, 16000, 16, payload))
    data[40:44] = struct.pack("<I", 0xFFFFFFFF)  # what a pipe writer (espeak-ng) leaves there
    samples, _ = decode_wav(bytes(data))
    np.testing.assert_allclose(samples, [100 / 32768, -100 / 32768])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"not a wav file at all", "not a RIFF/WAVE"),
        (b"RIFF\x04\x00\x00\x00WAVE", "no 'fmt ' chunk"),
        (_riff(1, 1, 16000, 16, b"")[:36], "no 'data' chunk"),
        (_riff(2, 1, 16000, 4, b"\x00\x00"), "unsupported WAV encoding"),
        (_riff(1, 0, 16000, 16, b"\x00\x00"), "0 channels"),
        (_riff(3, 1, 16000, 32, np.array([np.nan], "<f4").tobytes()), "NaN"),
    ],
)
def test_bad_wav_data_raises_audio_format_error(data, message):
    with pytest.raises(AudioFormatError, match=message):
        decode_wav(data)


def test_bad_sample_arrays_are_rejected(tmp_path):
    with pytest.raises(AudioFormatError, match="mono"):
        write_wav(tmp_path / "x.wav", np.zeros((10, 2), np.float32), 16000)
    with pytest.raises(AudioFormatError, match="NaN"):
        write_wav(tmp_path / "x.wav", np.array([0.0, np.nan]), 16000)
    with pytest.raises(AudioFormatError, match="positive"):
        write_wav(tmp_path / "x.wav", np.zeros(4), 0)


@pytest.mark.parametrize(
    ("from_rate", "to_rate"), [(48000, 16000), (22050, 16000), (16000, 22050), (8000, 16000)]
)
def test_resample_keeps_an_in_band_tone(from_rate, to_rate):
    tone = _tone(from_rate, seconds=1.0, hz=440.0)
    out = resample(tone, from_rate, to_rate)
    assert out.dtype == np.float32 and out.size == -(-tone.size * to_rate // from_rate)
    expected = 0.5 * np.sin(2 * np.pi * 440.0 * np.arange(out.size) / to_rate)
    edge = to_rate // 50  # the first and last 20 ms see the zero padding
    assert np.abs(out - expected)[edge:-edge].max() < 1e-3


def test_resample_removes_what_would_alias():
    tone = _tone(48000, seconds=0.5, hz=11000.0)  # above 8 kHz, the 16 kHz Nyquist rate
    out = resample(tone, 48000, 16000)
    assert np.sqrt(np.mean(out[320:-320] ** 2)) < 1e-3  # the tone itself has RMS 0.35


def test_resample_same_rate_is_a_copy_and_bad_rates_raise():
    tone = _tone(16000)
    out = resample(tone, 16000, 16000)
    np.testing.assert_array_equal(out, tone)
    assert out is not tone
    with pytest.raises(AudioFormatError, match="positive"):
        resample(tone, 0, 16000)


def test_missing_sounddevice_gives_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "sounddevice", None)  # import raises ImportError
    with pytest.raises(AudioDeviceUnavailable, match="pip install sounddevice"):
        audio.play(np.zeros(10, np.float32), 16000)


def test_no_input_device_gives_a_clear_error(monkeypatch):
    class PortAudioError(Exception):
        pass

    def query_devices(device=None, kind=None):
        raise PortAudioError("Error querying device -1")

    fake = types.SimpleNamespace(PortAudioError=PortAudioError, query_devices=query_devices)
    monkeypatch.setitem(sys.modules, "sounddevice", fake)
    with pytest.raises(AudioDeviceUnavailable, match="no input audio device"):
        with Microphone():
            pass
