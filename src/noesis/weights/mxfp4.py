"""MXFP4 (OCP microscaling FP4) weights as gpt-oss stores its experts: dequantized on load, or
on CUDA kept packed (`Mxfp4Weight`) and, once loaded, repacked as tensor-core fragments
(`fragment_experts`, kernels/mxfp4_mma.py) for the fused experts kernels (kernels/moe_triton.py).

A block of 32 values shares one power-of-two scale: `*_blocks` [..., G, 16] uint8 holds two
E2M1 codes per byte (the low nibble is the earlier value), `*_scales` [..., G] uint8 the
exponents biased by 127. The result is [..., G * 32].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from noesis.quant.packing import as_int32

# E2M1 code -> value: sign bit, then two exponent bits and one mantissa bit.
FP4_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)
SCALE_BIAS = 127
MXFP4_BLOCK = 32  # values per scale; two per byte


@dataclass(frozen=True)
class Mxfp4Weight:
    """Stacked expert weights [E, N, K] as stored: blocks [E, N, K / 32, 16] uint8, scales
    [E, N, K / 32] uint8."""

    blocks: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, rows, groups, _ = self.blocks.shape
        return experts, rows, groups * MXFP4_BLOCK

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_mxfp4(self.blocks, self.scales, dtype)


def keeps_packed(device: torch.device) -> bool:
    """MXFP4 experts stay packed where the fused kernel reads them: CUDA. Elsewhere they are
    dequantized at load to the model dtype."""
    return device.type == "cuda"


def pack_experts(model: nn.Module) -> int:
    """Every experts module of `model` (built on the meta device) switched to packed MXFP4
    parameters before loading; returns how many."""
    from noesis.models.moe import Experts

    experts = [module for module in model.modules() if isinstance(module, Experts)]
    for module in experts:
        module.keep_mxfp4_packed()
    return len(experts)


def fragment_experts(model: nn.Module) -> int:
    """Every packed experts module of a loaded `model` not yet repacked as tensor-core
    fragments (`Experts.use_fragments`), the layout the CUDA kernels read; returns how many."""
    from noesis.models.moe import Experts

    experts = [m for m in model.modules() if isinstance(m, Experts) and m.packed
               and not m.fragments]  # fmt: skip
    for module in experts:
        module.use_fragments()
    return len(experts)


def packed_memory_lines(
    index: dict, float_bytes: int, dtype: torch.dtype, device: torch.device
) -> dict[str, str]:
    """`noesis info`'s memory lines for an MXFP4 checkpoint: the text weights with the experts
    packed (CUDA) against all of them dequantized to `dtype` (elsewhere). `index` maps checkpoint
    keys to (file, shape); `float_bytes` is every text weight in `dtype`."""
    packed = expert_values = 0
    for key, (_, shape) in index.items():
        if key.endswith(("_blocks", "_scales")):
            packed += math.prod(shape)  # one byte each
            expert_values += math.prod(shape) * 2 if key.endswith("_blocks") else 0
    kept = float_bytes - expert_values * dtype.itemsize + packed
    name = str(dtype).removeprefix("torch.")
    return {
        "weights in memory": f"{_gib(kept)} (experts MXFP4-packed)" if keeps_packed(device)
        else f"{_gib(float_bytes)} (experts dequantized to {name} at load)",
        "mxfp4 experts": f"{_gib(packed)} packed; {_gib(kept)} in all on CUDA, "
                         f"{kept / float_bytes:.0%} of {_gib(float_bytes)} dequantized",
    }  # fmt: skip


def _gib(num_bytes: int) -> str:
    return (
        f"{num_bytes / (1 << 30):.2f} GiB"
        if num_bytes >= 1 << 30
        else f"{num_bytes / (1 << 20):.1f} MiB"
    )


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 exponents -> [..., G * 32] in `dtype`.
    Exact in float32 and bfloat16 (same exponent range); float16 may overflow."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype}, {scales.dtype}")
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).long()  # [..., G, 16, 2]
    values = lut[codes].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents[..., None].float()).flatten(-2).to(dtype)


# ---- tensor-core fragments (kernels/mxfp4_mma.py says why and how they are read) --------------

FRAGMENT_ROWS = 16  # rows per fragment tile
FRAGMENT_CHUNK = 64  # columns per chunk (four mma's of 16)
SIGN_ROT = (0, 1, 2, 6)  # per fragment register: the left rotations of a word that put a
MAG_ROT = (0, 3, 12, 6)  # code's sign at bit 15 and its magnitude at bits 6-8


@dataclass(frozen=True)
class Mxfp4Fragments:
    """Stacked expert weights [E, N, K] in the fragment layout (`to_fragments`). With
    `gate_up`, the rows are [gate; up] (N = 2I) and tile T holds gate and up of columns
    8T .. 8T + 7 (rows g and g + 8)."""

    words: torch.Tensor  # [E, N' / 16, K' / 64, 32, 4] int32
    scales: torch.Tensor  # [E, N' / 16, K' / 64, 8] int32
    rows: int
    cols: int
    gate_up: bool = False

    @classmethod
    def pack(cls, blocks: torch.Tensor, scales: torch.Tensor, gate_up: bool = False):
        """From MXFP4 as stored (`weights.mxfp4.Mxfp4Weight`'s blocks and scales)."""
        rows = blocks.shape[1]
        order = gate_up_rows(rows // 2, blocks.device) if gate_up else None
        words, packed = to_fragments(blocks, scales, order)
        return cls(words, packed, rows, blocks.shape[2] * 32, gate_up)

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.words.shape[0], self.rows, self.cols

    @property
    def tiles(self) -> int:
        return self.words.shape[1]

    @property
    def chunks(self) -> int:
        return self.words.shape[2]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[E, N, K] in the caller's row order."""
        n = self.tiles * FRAGMENT_ROWS
        values = from_fragments(self.words, self.scales, n, self.cols, dtype)
        if not self.gate_up:
            return values[:, : self.rows]
        inner = self.rows // 2
        order = gate_up_rows(inner, values.device)
        out = values.new_empty(values.shape[0], self.rows, self.cols)
        keep = order >= 0
        out[:, order[keep]] = values[:, keep]
        return out


def gate_up_rows(inner: int, device) -> torch.Tensor:
    """Fragment row order of a [gate; up] projection: tile T's rows g and g + 8 are gate and
    up of column 8T + g (-1 past the last column)."""
    r = torch.arange(2 * 8 * -(-inner // 8), device=device)
    cols = (r // 16) * 8 + r % 8
    rows = cols + (r % 16 >= 8) * inner
    return torch.where(cols < inner, rows, -1)


def bits_of(register: int, half: int) -> tuple[int, int]:
    """(sign bit, lowest magnitude bit) in the packed word of fragment register `register`'s
    code in `half` (0 low, 1 high)."""
    return ((15 + 16 * half - SIGN_ROT[register]) % 32,
            (6 + 16 * half - MAG_ROT[register]) % 32)  # fmt: skip


def to_fragments(
    blocks: torch.Tensor, scales: torch.Tensor, rows: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 as stored (blocks [E, N, G, 16] uint8, two codes a byte, low nibble first; scales
    [E, N, G] uint8) -> (words, scales) in the fragment layout. `rows` [N'] orders the rows
    (an entry < 0 is a zero row); N' and G * 32 are padded to 16 and 64. One expert at a time
    (the temporaries are eight bytes a code)."""
    if blocks.shape[0] > 1:
        parts = [to_fragments(blocks[e : e + 1], scales[e : e + 1], rows)
                 for e in range(blocks.shape[0])]  # fmt: skip
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    experts, n, groups, _ = blocks.shape
    device = blocks.device
    codes = torch.stack((blocks & 15, blocks >> 4), dim=-1).reshape(experts, n, groups * 32)
    exps = scales
    if rows is not None:  # a zero row past the last for rows < 0
        codes = torch.cat((codes, codes.new_zeros(experts, 1, codes.shape[2])), dim=1)
        exps = torch.cat((exps, exps.new_full((experts, 1, groups), 127)), dim=1)
        rows = torch.where(rows < 0, n, rows).to(device)
        codes, exps, n = codes[:, rows], exps[:, rows], rows.numel()
    tiles, chunks = -(-n // FRAGMENT_ROWS), -(-groups * 32 // FRAGMENT_CHUNK)
    codes = _pad(codes, (0, chunks * FRAGMENT_CHUNK - groups * 32, 0, tiles * FRAGMENT_ROWS - n), 0)
    exps = _pad(exps, (0, 2 * chunks - groups, 0, tiles * FRAGMENT_ROWS - n), 127)
    # codes[e, T, h, g, c, b, t, i, col] -> word (e, T, c, lane = 4g + t, j = 2b + i)
    codes = codes.reshape(experts, tiles, 2, 8, chunks, 2, 4, 2, 4).long()
    codes = codes.permute(0, 1, 4, 3, 6, 5, 7, 2, 8)  # e, T, c, g, t, b, i, h, col
    word = torch.zeros(codes.shape[:-2], dtype=torch.int64, device=device)
    for h in range(2):
        for col in range(4):
            register, half = 2 * (col // 2) + h, col % 2
            sign, mag = bits_of(register, half)
            code = codes[..., h, col]
            word |= ((code >> 3) & 1) << sign
            word |= (code & 7) << mag
    words = as_int32(word).reshape(experts, tiles, chunks, 32, 4)
    # exps[e, T, h, g, c, b] -> (e, T, c, g) with byte 2h + b
    exps = exps.reshape(experts, tiles, 2, 8, chunks, 2).permute(0, 1, 4, 3, 2, 5).long()
    shifts = 8 * torch.arange(4, device=device)
    packed = (exps.reshape(experts, tiles, chunks, 8, 4) << shifts).sum(-1)
    return words.contiguous(), as_int32(packed).contiguous()


def from_fragments(words: torch.Tensor, scales: torch.Tensor, n: int, k: int,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """The fragment layout back to values [E, N, K] (rows in the packed order, padding cut)."""
    experts, tiles, chunks = words.shape[:3]
    word = words.long() & 0xFFFFFFFF  # [e, T, c, lane, j]
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=words.device)
    values = torch.empty(experts, tiles, chunks, 32, 4, 2, 4, dtype=torch.float32,
                         device=words.device)  # fmt: skip
    for h in range(2):
        for col in range(4):
            sign, mag = bits_of(2 * (col // 2) + h, col % 2)
            code = (((word >> sign) & 1) << 3) | ((word >> mag) & 7)
            values[..., h, col] = lut[code]
    # [e, T, c, g, t, b, i, h, col] -> [e, T, h, g, c, b, t, i, col]
    values = values.reshape(experts, tiles, chunks, 8, 4, 2, 2, 2, 4)
    values = values.permute(0, 1, 7, 3, 2, 5, 4, 6, 8).reshape(experts, tiles * 16, chunks * 64)
    exps = (scales.long() & 0xFFFFFFFF)[..., None] >> (8 * torch.arange(4, device=words.device))
    exps = (exps & 255).reshape(experts, tiles, chunks, 8, 2, 2)  # e, T, c, g, h, b
    exps = exps.permute(0, 1, 4, 3, 2, 5).reshape(experts, tiles * 16, chunks * 2)
    values = values * torch.exp2(exps.float() - 127).repeat_interleave(32, dim=2)
    return values[:, :n, :k].to(dtype)


def _pad(t: torch.Tensor, pad: tuple[int, ...], value: int) -> torch.Tensor:
    return torch.nn.functional.pad(t, pad, value=value) if any(pad) else t

