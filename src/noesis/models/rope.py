"""Rotary position embeddings: inverse frequencies per scaling kind and the cos/sin tables.

Static kinds (default, linear, llama3, yarn) precompute one table for the whole context at load.
Length-dependent kinds (dynamic NTK, longrope) pick their frequencies from the sequence length a
step reaches, as Hugging Face does, so each token is rotated with the frequencies in force when it
was computed.
"""

from __future__ import annotations

import math

import torch

from noesis.models.config import RopeConfig


class RotaryEmbedding:
    def __init__(
        self, rope: RopeConfig, max_position_embeddings: int, max_len: int, device: torch.device
    ) -> None:
        self.rope = rope
        self.dim = rope.rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.device = device
        self.length_dependent = rope.rope_type in ("dynamic", "longrope")
        inv_freq, self.scaling = _inv_freq(rope, max_position_embeddings, seq_len=None)
        self.cos, self.sin = self._table(inv_freq.to(device), torch.arange(max_len, device=device))

    def _table(self, inv_freq: torch.Tensor, positions: torch.Tensor):
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def cos_sin(self, positions: torch.Tensor, seq_lens: list[tuple[int, int]] | None = None):
        """cos/sin [T, dim] for `positions` [T].

        `seq_lens` lists (num_tokens, length reached) per sequence in order; only length-dependent
        kinds read it.
        """
        if not self.length_dependent or seq_lens is None:
            return self.cos[positions], self.sin[positions]
        cos_parts, sin_parts, start = [], [], 0
        for num_tokens, length in seq_lens:
            pos = positions[start : start + num_tokens]
            if self._uses_base_table(length):
                cos_parts.append(self.cos[pos])
                sin_parts.append(self.sin[pos])
            else:
                inv_freq, _ = _inv_freq(self.rope, self.max_position_embeddings, seq_len=length)
                cos, sin = self._table(inv_freq.to(self.device), pos)
                cos_parts.append(cos)
                sin_parts.append(sin)
            start += num_tokens
        return torch.cat(cos_parts), torch.cat(sin_parts)

    def _uses_base_table(self, length: int) -> bool:
        if self.rope.rope_type == "dynamic":
            return length <= self.max_position_embeddings
        return length <= self.rope.original_max_position_embeddings


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [T, heads, head_dim] (half-split layout)."""
    dim = cos.shape[-1]
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    if dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :dim], x[..., dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _inv_freq(rope: RopeConfig, max_pos: int, seq_len: int | None) -> tuple[torch.Tensor, float]:
    dim = rope.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    base_inv = 1.0 / (rope.theta**exponents)
    kind = rope.rope_type
    if kind == "default":
        return base_inv, 1.0
    if kind == "linear":
        return base_inv / rope.factor, 1.0
    if kind == "dynamic":
        length = max(seq_len or max_pos, max_pos)
        base = rope.theta * ((rope.factor * length / max_pos) - (rope.factor - 1)) ** (
            dim / (dim - 2)
        )
        return 1.0 / (base**exponents), 1.0
    if kind == "llama3":
        return _llama3(rope, base_inv), 1.0
    if kind == "yarn":
        return _yarn(rope, max_pos, exponents)
    if kind == "longrope":
        return _longrope(rope, max_pos, exponents, seq_len)
    raise AssertionError(f"unhandled rope type {kind}")  # ModelConfig validated the kind


def _llama3(rope: RopeConfig, inv_freq: torch.Tensor) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, max_pos: int, exponents: torch.Tensor) -> tuple[torch.Tensor, float]:
    dim, base, factor = rope.rotary_dim, rope.theta, rope.factor
    original = rope.original_max_position_embeddings
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base**exponents
    extrapolation = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (
        1.0 / pos_freqs
    ) * extrapolation
    return inv_freq, float(attention_factor)


def _longrope(rope: RopeConfig, max_pos: int, exponents: torch.Tensor, seq_len: int | None):
    original = rope.original_max_position_embeddings
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    long = seq_len is not None and seq_len > original
    ext = torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
    return 1.0 / (ext * rope.theta**exponents), float(attention_factor)
