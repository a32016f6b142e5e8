"""Audio at the edges: WAV files in and out, resampling, and the microphone and speaker.

Everything returned is float32 mono in [-1, 1]. WAV parsing is our own (the stdlib `wave` module
rejects IEEE float files); the sound card goes through `sounddevice` only when it is installed and
PortAudio finds a device.
"""

from __future__ import annotations

import math
import queue
import struct
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

from noesis.errors import NoesisError


class AudioFormatError(NoesisError, ValueError):
    """A WAV file or an audio array is malformed or in a format we do not read."""


class AudioDeviceUnavailable(NoesisError, RuntimeError):
    """No sound input/output here: `sounddevice`/PortAudio is missing or there is no device."""


_PCM = 1
_IEEE_FLOAT = 3
_EXTENSIBLE = 0xFFFE


@dataclass(frozen=True, slots=True)
class _Format:
    tag: int
    channels: int
    sample_rate: int
    bits: int


def read_wav(path: str | Path) -> tuple[np.ndarray, int]:
    """Samples (float32 mono, channels averaged) and the sample rate of a PCM or float WAV file."""
    return decode_wav(Path(path).read_bytes(), str(path))


def decode_wav(data: bytes, name: str = "WAV data") -> tuple[np.ndarray, int]:
    """read_wav on bytes in memory; `name` is what error messages call them."""
    fmt, payload = _parse_riff(data, name)
    frames = _decode(payload, fmt, name)  # [T, C]
    return frames.mean(axis=1, dtype=np.float32), fmt.sample_rate


def write_wav(
    path: str | Path, samples: np.ndarray, sample_rate: int, float32: bool = False
) -> None:
    """Write mono samples as 16-bit PCM (clipped to [-1, 1]) or, with `float32`, IEEE float."""
    samples = as_mono_float32(samples)
    if sample_rate <= 0:
        raise AudioFormatError(f"sample_rate must be positive, got {sample_rate}")
    if float32:
        tag, bits, payload = _IEEE_FLOAT, 32, samples.astype("<f4").tobytes()
    else:
        pcm = np.round(np.clip(samples, -1.0, 1.0) * 32767.0).astype("<i2")
        tag, bits, payload = _PCM, 16, pcm.tobytes()
    block_align = bits // 8
    fmt_chunk = struct.pack(
        "<HHIIHH", tag, 1, sample_rate, sample_rate * block_align, block_align, bits
    )
    body = b"WAVE" + _chunk(b"fmt ", fmt_chunk) + _chunk(b"data", payload)
    Path(path).write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)


def as_mono_float32(samples: np.ndarray) -> np.ndarray:
    """Check that `samples` is a 1-D array of finite numbers and return it as float32."""
    samples = np.asarray(samples)
    if samples.ndim != 1:
        raise AudioFormatError(f"expected mono samples of shape [T], got shape {samples.shape}")
    if not (np.issubdtype(samples.dtype, np.floating) or np.issubdtype(samples.dtype, np.integer)):
        raise AudioFormatError(f"expected numeric samples, got dtype {samples.dtype}")
    samples = samples.astype(np.float32, copy=False)
    if not np.all(np.isfinite(samples)):
        raise AudioFormatError("samples contain NaN or infinity")
    return samples


def resample(
    samples: np.ndarray, from_rate: int, to_rate: int, zero_crossings: int = 16
) -> np.ndarray:
    """Band-limited polyphase resampling by the rational factor to_rate / from_rate.

    Each output sample is a Kaiser-windowed sinc of the input evaluated at its fractional time;
    the filter of each of the `up` fractional phases is tabulated once. The cutoff is the lower
    Nyquist rate, so downsampling does not alias.
    """
    samples = as_mono_float32(samples)
    if from_rate <= 0 or to_rate <= 0:
        raise AudioFormatError(f"sample rates must be positive, got {from_rate} -> {to_rate}")
    if from_rate == to_rate or samples.size == 0:
        return samples.copy()
    gcd = math.gcd(from_rate, to_rate)
    up, down = to_rate // gcd, from_rate // gcd
    bank, half_width = _polyphase_bank(up, down, zero_crossings)  # [up, 2K]
    padded = np.pad(samples, (half_width, half_width + 1)).astype(np.float64)
    num_out = -(-samples.size * up // down)  # ceil
    out = np.empty(num_out, dtype=np.float32)
    taps = np.arange(bank.shape[1])
    for start in range(0, num_out, 16384):  # bound the [N, 2K] gather's memory
        n = np.arange(start, min(start + 16384, num_out))
        base, phase = np.divmod(n * down, up)  # output n sits at input time base + phase/up
        windows = padded[base[:, None] + taps[None, :] + 1]  # [N, 2K]
        out[n] = np.einsum("nk,nk->n", windows, bank[phase])
    return out


def _polyphase_bank(up: int, down: int, zero_crossings: int) -> tuple[np.ndarray, int]:
    scale = min(1.0, up / down)  # cutoff relative to the input's Nyquist rate
    half_width = math.ceil(zero_crossings / scale)
    # tap i of the window reads input sample base - half_width + 1 + i, at distance tau from
    # the output time base + phase / up
    taps = np.arange(2 * half_width)
    tau = np.arange(up)[:, None] / up + (half_width - 1 - taps)[None, :]  # [up, 2K]
    window = np.i0(8.6 * np.sqrt(np.clip(1.0 - (tau / half_width) ** 2, 0.0, None))) / np.i0(8.6)
    return scale * np.sinc(scale * tau) * window, half_width


def _chunk(tag: bytes, payload: bytes) -> bytes:
    pad = b"\x00" if len(payload) % 2 else b""
    return tag + struct.pack("<I", len(payload)) + payload + pad


def _parse_riff(data: bytes, name: str) -> tuple[_Format, bytes]:
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise AudioFormatError(f"{name} is not a RIFF/WAVE file")
    fmt, payload, pos = None, None, 12
    while pos + 8 <= len(data):
        tag, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        body = data[pos + 8 : pos + 8 + size]
        if tag == b"fmt ":
            fmt = _parse_fmt(body, name)
        elif tag == b"data":
            payload = body  # a truncated file keeps what is there
        pos += 8 + size + (size & 1)
    if fmt is None:
        raise AudioFormatError(f"{name} has no 'fmt ' chunk")
    if payload is None:
        raise AudioFormatError(f"{name} has no 'data' chunk")
    return fmt, payload


def _parse_fmt(body: bytes, name: str) -> _Format:
    if len(body) < 16:
        raise AudioFormatError(f"{name}: 'fmt ' chunk is {len(body)} bytes, expected >= 16")
    tag, channels, sample_rate, _, _, bits = struct.unpack("<HHIIHH", body[:16])
    if tag == _EXTENSIBLE and len(body) >= 26:
        tag = struct.unpack("<H", body[24:26])[0]  # first two bytes of the sub-format GUID
    if channels == 0 or sample_rate == 0:
        raise AudioFormatError(f"{name}: {channels} channels at {sample_rate} Hz")
    return _Format(tag, channels, sample_rate, bits)


def _decode(payload: bytes, fmt: _Format, name: str) -> np.ndarray:
    width = fmt.bits // 8
    usable = len(payload) - len(payload) % (width * fmt.channels) if width else 0
    raw = payload[:usable]
    if fmt.tag == _PCM and fmt.bits == 8:
        values = (np.frombuffer(raw, np.uint8).astype(np.float32) - 128.0) / 128.0
    elif fmt.tag == _PCM and fmt.bits in (16, 32):
        dtype = "<i2" if fmt.bits == 16 else "<i4"
        values = np.frombuffer(raw, dtype).astype(np.float32) / float(2 ** (fmt.bits - 1))
    elif fmt.tag == _PCM and fmt.bits == 24:
        triples = np.frombuffer(raw, np.uint8).reshape(-1, 3).astype(np.int32)
        ints = triples[:, 0] | (triples[:, 1] << 8) | (triples[:, 2] << 16)
        values = (np.where(ints >= 1 << 23, ints - (1 << 24), ints) / float(1 << 23)).astype(
            np.float32
        )
    elif fmt.tag == _IEEE_FLOAT and fmt.bits in (32, 64):
        values = np.frombuffer(raw, "<f4" if fmt.bits == 32 else "<f8").astype(np.float32)
    else:
        raise AudioFormatError(
            f"{name}: unsupported WAV encoding (format tag {fmt.tag}, {fmt.bits} bits); "
            "noesis reads 8/16/24/32-bit PCM and 32/64-bit float"
        )
    if not np.all(np.isfinite(values)):
        raise AudioFormatError(f"{name}: samples contain NaN or infinity")
    return values.reshape(-1, fmt.channels)


# ---- sound card -------------------------------------------------------------------------------


def sounddevice_module() -> ModuleType:
    """The `sounddevice` module, or AudioDeviceUnavailable saying why it cannot be used."""
    try:
        import sounddevice
    except ImportError as exc:
        raise AudioDeviceUnavailable(
            "microphone/speaker need the optional 'sounddevice' package: pip install sounddevice"
        ) from exc
    except OSError as exc:  # sounddevice raises OSError when libportaudio is not installed
        raise AudioDeviceUnavailable(
            f"sounddevice cannot load PortAudio ({exc}); install it, e.g. "
            "apt-get install libportaudio2"
        ) from exc
    return sounddevice


def _check_device(sd: ModuleType, kind: str, device: int | str | None) -> None:
    try:
        sd.query_devices(device, kind=kind)
    except (sd.PortAudioError, ValueError) as exc:
        raise AudioDeviceUnavailable(f"no {kind} audio device available ({exc})") from exc


class Microphone:
    """Blocks of float32 mono samples from the default (or named) input device.

    Use as a context manager; `read()` returns the next block of `block_samples` samples.
    """

    def __init__(
        self, sample_rate: int = 16000, block_samples: int = 512, device: int | str | None = None
    ) -> None:
        self.sample_rate = sample_rate
        self.block_samples = block_samples
        self.device = device
        self._blocks: queue.Queue[np.ndarray] = queue.Queue()
        self._stream = None

    def __enter__(self) -> Microphone:
        sd = sounddevice_module()
        _check_device(sd, "input", self.device)
        self._stream = sd.InputStream(
            samplerate=self.sample_rate,
            blocksize=self.block_samples,
            channels=1,
            dtype="float32",
            device=self.device,
            callback=self._on_block,
        )
        self._stream.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._stream is not None:
            self._stream.stop()
            self._stream.close()
            self._stream = None

    def read(self, timeout: float | None = None) -> np.ndarray:
        if self._stream is None:
            raise RuntimeError("Microphone.read() outside its `with` block")
        return self._blocks.get(timeout=timeout)

    def _on_block(self, block: np.ndarray, frames: int, time: object, status: object) -> None:
        self._blocks.put(block[:, 0].copy())  # [frames, 1] -> [frames]


def play(samples: np.ndarray, sample_rate: int, device: int | str | None = None) -> None:
    """Play mono samples on the default (or named) output device and wait until done."""
    samples = as_mono_float32(samples)
    sd = sounddevice_module()
    _check_device(sd, "output", device)
    sd.play(samples, samplerate=sample_rate, device=device, blocking=True)
