"""The torch log-mel against librosa's filters, a numpy STFT, and faster-whisper's extractor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from noesis.errors import InvalidRequest
from noesis.voice.mel import HOP_LENGTH, N_FFT, log_mel_spectrogram, mel_filterbank

# Golden entries of librosa.filters.mel(sr=16000, n_fft=400, n_mels=80) from librosa 0.11.0
# (identical, max |diff| 0.0, to whisper/assets/mel_filters.npz of openai-whisper 20250625):
# (mel row, fft bin) -> weight at each row's peak, plus the sum of the whole matrix.
LIBROSA_PEAKS = {
    (0, 1): 0.02486259490251541,
    (1, 2): 0.022871771827340126,
    (5, 6): 0.014908484183251858,
    (20, 20): 0.013890394009649754,
    (40, 43): 0.014735566452145576,
    (50, 63): 0.00946230161935091,
    (70, 136): 0.004571974277496338,
    (79, 192): 0.0031647118739783764,
}
LIBROSA_SUM = 1.9990241527557373
LIBROSA_NONZERO = {0: 1, 40: 3, 79: 14}  # row -> count of non-zero weights


def test_filterbank_matches_librosa_golden_values():
    filters = mel_filterbank().numpy()
    assert filters.shape == (80, 201) and filters.dtype == np.float32
    for (row, column), weight in LIBROSA_PEAKS.items():
        assert int(np.argmax(filters[row])) == column
        assert filters[row, column] == pytest.approx(weight, rel=1e-6)
    assert float(filters.sum()) == pytest.approx(LIBROSA_SUM, rel=1e-6)
    for row, count in LIBROSA_NONZERO.items():
        assert int((filters[row] > 0).sum()) == count


def test_filterbank_matches_faster_whispers_librosa_port():
    from faster_whisper.feature_extractor import FeatureExtractor

    reference = FeatureExtractor(feature_size=80).mel_filters  # [80, 201] float64
    np.testing.assert_allclose(mel_filterbank().numpy(), reference, rtol=0, atol=1e-8)


def _numpy_log_mel(samples: np.ndarray) -> np.ndarray:
    """Whisper's recipe written directly with numpy's rfft, in float64."""
    padded = np.pad(samples.astype(np.float64), N_FFT // 2, mode="reflect")
    num_frames = 1 + (padded.size - N_FFT) // HOP_LENGTH
    starts = np.arange(num_frames) * HOP_LENGTH
    frames = padded[starts[:, None] + np.arange(N_FFT)[None, :]]  # [F, N_FFT]
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)  # periodic Hann
    power = np.abs(np.fft.rfft(frames * window, axis=1)) ** 2  # [F, 201]
    mel = mel_filterbank().numpy().astype(np.float64) @ power[:-1].T  # [80, F - 1]
    log_mel = np.log10(np.maximum(mel, 1e-10))
    return (np.maximum(log_mel, log_mel.max() - 8.0) + 4.0) / 4.0


def _speechlike(seconds: float, seed: int = 0) -> np.ndarray:
    """Harmonics of a wandering pitch in a little noise: energy spread over many mel bands."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(16000 * seconds)) / 16000
    pitch = 140 + 30 * np.sin(2 * np.pi * 1.5 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / 16000
    voiced = sum(np.sin(k * phase) / k for k in range(1, 20))
    return (0.1 * voiced + 0.01 * rng.standard_normal(t.size)).astype(np.float32)


# Tolerance: float32 torch against float64 numpy differs by < 1e-4 in these (x + 4) / 4 units
# (1e-4 is 0.0004 in log10 power, under 0.01 dB); measured max about 2e-6.
TOLERANCE = 1e-4


@pytest.mark.parametrize("seconds", [0.5, 3.0])
def test_log_mel_matches_numpy_stft_reference(seconds):
    samples = _speechlike(seconds)
    ours = log_mel_spectrogram(samples)
    assert ours.shape == (80, samples.size // HOP_LENGTH) and ours.dtype == torch.float32
    np.testing.assert_allclose(ours.numpy(), _numpy_log_mel(samples), rtol=0, atol=TOLERANCE)


def test_log_mel_matches_faster_whisper_features():
    from faster_whisper.feature_extractor import FeatureExtractor

    samples = _speechlike(2.0, seed=1)
    reference = FeatureExtractor(feature_size=80)(samples, padding=0)  # [80, frames]
    ours = log_mel_spectrogram(samples).numpy()
    np.testing.assert_allclose(ours, reference[:, : ours.shape[1]], rtol=0, atol=TOLERANCE)


def test_log_mel_dynamic_range_is_clamped_to_eight_decades():
    samples = np.concatenate([_speechlike(0.5), np.zeros(8000, np.float32)])
    features = log_mel_spectrogram(samples)
    assert float(features.max() - features.min()) == pytest.approx(2.0, abs=1e-5)  # 8 / 4


def test_log_mel_rejects_bad_input():
    with pytest.raises(InvalidRequest, match="mono"):
        log_mel_spectrogram(np.zeros((2, 16000), np.float32))
    with pytest.raises(InvalidRequest, match="samples"):
        log_mel_spectrogram(np.zeros(100, np.float32))
