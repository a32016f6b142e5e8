"""Rotary position embeddings: inverse frequencies per scaling kind and the cos/sin tables.

Static kinds (default, linear, llama3, yarn) precompute one table for the whole context at load.
Length-dependent kinds (dynamic NTK, longrope) rotate the token at position p with the frequencies
of length max(p + 1, prompt_len): what Hugging Face's cached generation gives (the prompt at its
length, then each new token at the length it makes), and the same however the sequence is chunked
or recomputed after preemption.
"""

from __future__ import annotations

import math

import torch

from noesis.models.config import RopeConfig
from noesis.weights.memory import MemoryNeed, check_fits


class RotaryEmbedding:
    def __init__(
        self, rope: RopeConfig, max_position_embeddings: int, max_len: int, device: torch.device
    ) -> None:
        self.rope = rope
        self.dim = rope.rotary_dim
        self.max_position_embeddings = max_position_embeddings
        self.device = device
        self.length_dependent = rope.length_dependent
        _check_table_fits(rope, max_len, device)
        inv_freq, self.scaling = _inv_freq(rope, max_position_embeddings, seq_len=None)
        positions = torch.arange(max_len, device=device)
        self.cos, self.sin = self._table(inv_freq.to(device), positions)
        if rope.rope_type == "longrope":  # the long factors, used past the original context
            original = rope.original_max_position_embeddings
            long_inv_freq, _ = _inv_freq(rope, max_position_embeddings, seq_len=original + 1)
            self.long_cos, self.long_sin = self._table(long_inv_freq.to(device), positions)
        self.local = None  # Gemma 3's sliding-layer rotary
        if rope.local is not None:
            self.local = RotaryEmbedding(rope.local, max_position_embeddings, max_len, device)

    def _table(self, inv_freq: torch.Tensor, positions: torch.Tensor):
        freqs = positions.float()[:, None] * inv_freq  # [T, dim/2]; inv_freq [dim/2] or [T, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def cos_sin(self, positions: torch.Tensor, seq_lens: list[tuple[int, ...]] | None = None):
        """cos/sin [T, dim] for `positions` [T] ([T, 2 * dim] with a local rotary: the global
        table's channels, then the local one's).

        `seq_lens` lists, per sequence in batch order, (num_tokens, end) or (num_tokens, end,
        prompt_len); only length-dependent kinds read it. Without prompt_len the step's end
        stands in for it, so a whole chunk is rotated at the length it reaches.
        """
        cos, sin = self._cos_sin(positions, seq_lens)
        if self.local is None:
            return cos, sin
        local_cos, local_sin = self.local.cos_sin(positions)
        return torch.cat((cos, local_cos), dim=-1), torch.cat((sin, local_sin), dim=-1)

    def _cos_sin(self, positions: torch.Tensor, seq_lens: list[tuple[int, ...]] | None):
        if not self.length_dependent or seq_lens is None:
            return self.cos[positions], self.sin[positions]
        lengths = self._token_lengths(positions, seq_lens)  # [T]
        if self.rope.rope_type == "longrope":
            long = (lengths > self.rope.original_max_position_embeddings)[:, None]
            cos = torch.where(long, self.long_cos[positions], self.cos[positions])
            return cos, torch.where(long, self.long_sin[positions], self.sin[positions])
        inv_freq = _dynamic_inv_freq(self.rope, self.max_position_embeddings, lengths.float())
        return self._table(inv_freq, positions)

    def _token_lengths(self, positions: torch.Tensor, seq_lens: list[tuple[int, ...]]):
        """max(p + 1, prompt_len) per token, without a host sync."""
        counts = [entry[0] for entry in seq_lens]
        floors = [entry[2] if len(entry) > 2 else entry[1] for entry in seq_lens]
        floor = torch.repeat_interleave(
            torch.tensor(floors, device=self.device),
            torch.tensor(counts, device=self.device),
            output_size=sum(counts),
        )
        return torch.maximum(positions + 1, floor)


def _check_table_fits(rope: RopeConfig, max_len: int, device: torch.device) -> None:
    """The tables cover every position up to max_len: a huge context is refused by what it would
    cost, before torch tries to allocate it."""
    need = MemoryNeed(
        "the RoPE cos/sin tables",
        f"max_model_len={max_len:,} positions and rotary dimension {rope.rotary_dim}",
        rope.table_bytes(max_len),
    )
    check_fits([need], device, "the RoPE cos/sin tables", "Lower max_model_len.")


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
        lengths = torch.tensor([float(seq_len or max_pos)])
        return _dynamic_inv_freq(rope, max_pos, lengths)[0], 1.0
    if kind == "llama3":
        return _llama3(rope, base_inv), 1.0
    if kind == "yarn":
        return _yarn(rope, max_pos, exponents)
    if kind == "longrope":
        return _longrope(rope, max_pos, exponents, seq_len)
    raise AssertionError(f"unhandled rope type {kind}")  # ModelConfig validated the kind


def _dynamic_inv_freq(rope: RopeConfig, max_pos: int, lengths: torch.Tensor) -> torch.Tensor:
    """NTK-aware inverse frequencies [N, dim/2] for sequence lengths [N]; the base ones up to
    max_pos (the formula gives exactly theta there)."""
    dim = rope.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=lengths.device).float() / dim
    lengths = lengths.clamp(min=max_pos)
    base = rope.theta * ((rope.factor * lengths / max_pos) - (rope.factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base[:, None] ** exponents)


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
