"""Whisper-style log-mel spectrogram in torch: 16 kHz, 25 ms Hann frames every 10 ms, 80 mels.

Matches what Whisper was trained on: power STFT (centered, reflect padded, last frame dropped),
Slaney-scale mel filters with Slaney area normalization (librosa's default), log10 clamped to
1e-10 and to 8 below the maximum, then (x + 4) / 4.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from noesis.errors import InvalidRequest

SAMPLE_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
N_MELS = 80


@functools.lru_cache(maxsize=8)
def mel_filterbank(
    n_mels: int = N_MELS, n_fft: int = N_FFT, sample_rate: int = SAMPLE_RATE
) -> torch.Tensor:
    """Triangular Slaney-scale filters, area-normalized: [n_mels, n_fft // 2 + 1] float32."""
    fft_hz = np.linspace(0.0, sample_rate / 2, n_fft // 2 + 1)
    edges_hz = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate / 2), n_mels + 2))
    widths = np.diff(edges_hz)  # [n_mels + 1]
    rising = (fft_hz[None, :] - edges_hz[:-2, None]) / widths[:-1, None]
    falling = (edges_hz[2:, None] - fft_hz[None, :]) / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(rising, falling))  # [n_mels, n_fft // 2 + 1]
    weights *= (2.0 / (edges_hz[2:] - edges_hz[:-2]))[:, None]  # equal area per filter
    return torch.from_numpy(weights.astype(np.float32))


def log_mel_spectrogram(audio: np.ndarray | torch.Tensor, n_mels: int = N_MELS) -> torch.Tensor:
    """Whisper log-mel features of 16 kHz mono audio: [n_mels, T // HOP_LENGTH] float32."""
    samples = torch.as_tensor(audio, dtype=torch.float32)
    if samples.ndim != 1:
        raise InvalidRequest(
            f"log_mel_spectrogram takes mono audio [T], got {tuple(samples.shape)}"
        )
    if samples.numel() <= N_FFT // 2:
        raise InvalidRequest(
            f"need more than {N_FFT // 2} samples for one frame, got {samples.numel()}"
        )
    window = torch.hann_window(N_FFT, device=samples.device)
    stft = torch.stft(samples, N_FFT, HOP_LENGTH, window=window, return_complex=True)
    power = stft[:, :-1].abs() ** 2  # [N_FFT // 2 + 1, frames]; Whisper drops the last frame
    mel = mel_filterbank(n_mels).to(samples.device) @ power  # [n_mels, frames]
    log_mel = torch.clamp(mel, min=1e-10).log10()
    log_mel = torch.maximum(log_mel, log_mel.max() - 8.0)
    return (log_mel + 4.0) / 4.0


def _hz_to_mel(hz: np.ndarray | float) -> np.ndarray:
    """Slaney mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above."""
    hz = np.asarray(hz, dtype=np.float64)
    linear = hz / (200.0 / 3)
    log_part = 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(hz >= 1000.0, log_part, linear)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    linear = mel * (200.0 / 3)
    log_part = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0))
    return np.where(mel >= 15.0, log_part, linear)
