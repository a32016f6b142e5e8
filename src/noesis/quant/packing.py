"""Packed integer weights: noesis's in-memory layout, and the AWQ and GPTQ checkpoint layouts
converted into it as each tensor is loaded.

In memory (PackedLinear), output-major so that fused projections stack by rows as float ones do:
- `qweight` int32 [N, K / pack]: value k of row n in word k // pack, at bits (k % pack) * bits
- `scales` [N, G] and `qzeros` [N, G] (zero points unpacked, as exact small floats)
- `g_idx` int32 [P, K] (GPTQ): the group of each input column, one row per fused part
and w[n, k] = (q[n, k] - qzeros[n, g(k)]) * scales[n, g(k)].

In checkpoints (K inputs, N outputs, G groups):
- AWQ "gemm" (AutoAWQ): `qweight` int32 [K, N / 8] packed along N, nibble i of a word holding
  column AWQ_ORDER[i] of its eight; `qzeros` int32 [G, N / 8] packed the same way; `scales`
  [G, N].
- GPTQ v1 (AutoGPTQ): `qweight` int32 [K / pack, N] packed along K, low bits first; `qzeros`
  int32 [G, N / pack] packed along N, plain order, each holding zero - 1 (modulo 2^bits);
  `scales` [G, N]; `g_idx` int32 [K].
"""

from __future__ import annotations

import re

import torch

from noesis.errors import CheckpointMismatch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column AWQ_ORDER[i]
AWQ_COLUMNS = (0, 4, 1, 5, 2, 6, 3, 7)  # column c of an AWQ word sits in nibble AWQ_COLUMNS[c]
_LAYOUT = re.compile(r"(awq|gptq)(4|8)_(qweight|qzeros|scales|g_idx)")


def layout_name(method: str, bits: int, leaf: str) -> str:
    """The loader's name for one checkpoint tensor kind, e.g. "awq4_qweight"."""
    return f"{method}{bits}_{leaf}"


def is_packed_layout(layout: str) -> bool:
    return _LAYOUT.fullmatch(layout) is not None


def checkpoint_shape(layout: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The checkpoint tensor's shape, given its in-memory part's shape."""
    method, bits, leaf = _parse(layout)
    pack = 32 // bits
    if leaf == "g_idx":  # [P, K] in memory, one [K] per part
        return shape[1:]
    rows, cols = shape
    if leaf == "qweight":
        return (cols * pack, rows // pack) if method == "awq" else (cols, rows)
    if leaf == "qzeros":
        return (cols, rows // pack)
    return (cols, rows)  # scales


def to_memory_layout(layout: str, tensor: torch.Tensor, key: str) -> torch.Tensor:
    """One checkpoint tensor in the in-memory layout (see the module docstring)."""
    method, bits, leaf = _parse(layout)
    if leaf == "g_idx" or leaf == "scales":
        return tensor if leaf == "g_idx" else tensor.transpose(0, 1)
    if tensor.dtype != torch.int32:
        raise CheckpointMismatch(f"{key}: dtype {tensor.dtype}, {method} stores int32")
    if leaf == "qweight" and method == "gptq":
        return tensor.transpose(0, 1)  # the words already pack along K
    values = unpack(tensor, bits)  # [rows, cols * pack], along N
    if method == "awq":
        values = values.view(values.shape[0], -1, 8)[..., list(AWQ_COLUMNS)].flatten(1)
    else:  # GPTQ v1 zero points are stored minus one
        values = (values + 1) & ((1 << bits) - 1)
    if leaf == "qzeros":
        return values.transpose(0, 1)  # [N, G]
    return pack(values.transpose(0, 1), bits)  # AWQ qweight [N, K / 8]


def unpack(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [..., W] -> int32 [..., W * pack]: each word's values, low bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    return ((words[..., None] >> shifts) & ((1 << bits) - 1)).flatten(-2)


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers in [0, 2^bits) [..., K] -> int32 words [..., K / pack], low bits first."""
    pack_count = 32 // bits
    if values.shape[-1] % pack_count:
        raise ValueError(f"{values.shape[-1]} values do not fill {bits}-bit words of {pack_count}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    grouped = values.to(torch.int64).reshape(*values.shape[:-1], -1, pack_count)
    words = (grouped << shifts).sum(-1)  # disjoint bit fields: the sum is their OR
    return as_int32(words)


def as_int32(t: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> the same bits as int32."""
    return torch.where(t >= 1 << 31, t - (1 << 32), t).to(torch.int32)


def awq_checkpoint(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor):
    """AWQ gemm tensors (qweight, qzeros, scales) from int4 codes q [N, K], zero points
    zeros [N, G] and scales [N, G]."""
    def columns(values: torch.Tensor) -> torch.Tensor:  # [rows, N] -> words [rows, N / 8]
        return pack(values.reshape(values.shape[0], -1, 8)[..., list(AWQ_ORDER)].flatten(1), 4)

    return columns(q.t()), columns(zeros.t()), scales.t().contiguous()


def gptq_checkpoint(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int):
    """GPTQ v1 tensors (qweight, qzeros, scales) from codes q [N, K], zero points zeros [N, G]
    and scales [N, G]; g_idx is the caller's (it depends on the column order)."""
    stored_zeros = (zeros.t().to(torch.int64) - 1) & ((1 << bits) - 1)
    return pack(q, bits).t().contiguous(), pack(stored_zeros, bits), scales.t().contiguous()


def _parse(layout: str) -> tuple[str, int, str]:
    match = _LAYOUT.fullmatch(layout)
    assert match is not None, layout  # mapping.py builds the names with layout_name
    return match[1], int(match[2]), match[3]
