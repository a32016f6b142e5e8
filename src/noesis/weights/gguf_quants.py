"""GGUF (llama.cpp) tensor types dequantized in vectorized torch: raw block bytes -> float32.

Each quantized type stores a row as blocks of `BLOCKS[type][0]` values in `BLOCKS[type][1]` bytes:
float16 scales (and minimums) then packed integer codes. Every function here works on all the
blocks of a chunk at once and performs the same float32 operations, in the same order, as the
`gguf` package's reference dequantization, so the results are equal to the bit.

Layouts (bytes, in order; "f16" is a little-endian IEEE half):
  Q8_0  f16 d, 32 x int8                                   -> d * q
  Q4_0  f16 d, 16 bytes of nibbles (low: 0-15, high: 16-31) -> d * (q - 8)
  Q4_1  f16 d, f16 m, 16 bytes of nibbles                  -> d * q + m
  Q5_0  f16 d, u32 fifth bits, 16 bytes of nibbles          -> d * (q - 16)
  Q5_1  f16 d, f16 m, u32 fifth bits, 16 bytes of nibbles   -> d * q + m
  Q4_K  f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles: 8 groups of 32
        -> (d * scale) * q - dmin * min
  Q5_K  as Q4_K with 32 bytes of fifth bits before the nibbles
  Q6_K  128 bytes low nibbles, 64 bytes of 2-bit highs, 16 x int8 scales, f16 d: 16 groups of 16
        -> (d * scale) * (q - 32)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

SUPER_BLOCK = 256  # values per K-quant block
# type name -> (values per block, bytes per block)
BLOCKS = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
# Values dequantized per chunk: bounds the float32 temporaries (a few times this many bytes x 4).
CHUNK_VALUES = 1 << 22


def dequantize(raw: torch.Tensor, type_name: str, num_values: int) -> torch.Tensor:
    """`num_values` float32 values from the bytes of a tensor of `type_name` (a 1-D uint8 tensor,
    or already float32/float16 for those types), flat, on `raw`'s device (where a GPU decodes a
    large tensor many times faster); reshape it to the tensor's shape."""
    block_values, block_bytes = BLOCKS[type_name]
    raw = raw.reshape(-1).view(torch.uint8)
    if raw.numel() * block_values != num_values * block_bytes:
        raise ValueError(
            f"{type_name}: {raw.numel()} bytes do not hold {num_values} values "
            f"({block_bytes} bytes per {block_values})"
        )
    blocks = raw.view(-1, block_bytes)  # [N, B]
    decode = DECODERS[type_name]
    step = max(1, CHUNK_VALUES // block_values)
    out = torch.empty(num_values, dtype=torch.float32, device=raw.device)
    for start in range(0, blocks.shape[0], step):  # chunks of many blocks, never one block
        values = decode(blocks[start : start + step]).flatten()
        out[start * block_values : start * block_values + values.numel()] = values
    return out


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte `offset` of every block, as float32 [N, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[N, G, 32] bytes -> [N, 2G, 32] 4-bit codes: each group's low nibbles, then its high."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=2).flatten(1, 2)


def _bits(packed: torch.Tensor, width: int) -> torch.Tensor:
    """[N, G, C] bytes -> [N, G * 8 / width, C]: field k of every byte (lowest bits first) in
    plane k of its group."""
    shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)
    planes = (packed.unsqueeze(2) >> shifts.view(1, 1, -1, 1)) & ((1 << width) - 1)
    return planes.flatten(1, 2)


def _float32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _float16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _bfloat16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float()


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    q = blocks[:, 2:].contiguous().view(torch.int8).float()
    return q * _f16(blocks, 0)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:].view(-1, 1, 16)).view(-1, 32).to(torch.int8) - 8
    return _f16(blocks, 0) * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 4:].view(-1, 1, 16)).view(-1, 32).float()
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _five_bit(blocks: torch.Tensor, high_at: int) -> torch.Tensor:
    """Q5_0/Q5_1 codes [N, 32]: nibbles after the 4 bytes at `high_at`, whose bit j is value
    j's fifth bit."""
    low = _nibbles(blocks[:, high_at + 4 :].view(-1, 1, 16)).view(-1, 32)
    high = _bits(blocks[:, high_at : high_at + 4].reshape(-1, 4, 1), 1).view(-1, 32)  # 8k + b
    return low | (high << 4)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _five_bit(blocks, 2).to(torch.int8) - 16
    return _f16(blocks, 0) * q.float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = _five_bit(blocks, 4).float()
    return _f16(blocks, 0) * q + _f16(blocks, 2)


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes -> (scales, mins), 8 six-bit values each [N, 8]: bytes 0-3 hold
    scales 0-3 (low 6 bits) and the top bits of scales 4-7, bytes 4-7 the same for mins, bytes
    8-11 the low nibbles of scales 4-7 (low half) and mins 4-7 (high half)."""
    d, m, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat((d & 0x3F, (low & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mins = torch.cat((m & 0x3F, (low >> 4) | ((m >> 2) & 0x30)), dim=1)
    return scales, mins


def _k_affine(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K values from codes q [N, 8, 32]: (d * scale) * q - dmin * min per group."""
    scales, mins = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks, 0) * scales.float()).unsqueeze(-1)
    dm = (_f16(blocks, 2) * mins.float()).unsqueeze(-1)
    return d * q.float() - dm


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 16:].view(-1, 4, 32))  # [N, 8, 32]
    return _k_affine(blocks, q)


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, 48:].view(-1, 4, 32))  # [N, 8, 32]
    high = _bits(blocks[:, 16:48].reshape(-1, 1, 32), 1)  # bit g of byte j: group g, value j
    return _k_affine(blocks, low | (high << 4))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    low = _nibbles(blocks[:, :128].reshape(-1, 4, 32))  # [N, 8, 32]
    # each half's 32 high bytes carry 2 bits for each of its 4 groups
    low = low.view(-1, 2, 2, 2, 32).transpose(2, 3).reshape(-1, 8, 32)
    high = _bits(blocks[:, 128:192].reshape(-1, 2, 32), 2)  # [N, 8, 32]
    q = ((low | (high << 4)).to(torch.int8) - 32).view(-1, 16, 16)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(blocks, 208) * scales).unsqueeze(-1)  # [N, 16, 1]
    return d * q.float()


DECODERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": _float32,
    "F16": _float16,
    "BF16": _bfloat16,
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


# ---- codes and scales kept apart (GGUF projections packed in memory) ----------------------------


@dataclass(frozen=True)
class CodeLayout:
    """A block type's values as integer codes: (code - zero) * scale, plus an additive minimum
    where the type has one, per group of `group` values. The K-quants' scales are products of a
    half-precision super-block scale and a small integer, exact in float32 and not in float16."""

    code_bits: int  # 4, 5, 6 or 8; codes are unsigned (Q8_0's int8 shifted by 128)
    group: int
    zero: int
    scale_dtype: torch.dtype
    has_min: bool


CODE_LAYOUTS = {
    "Q8_0": CodeLayout(8, 32, 128, torch.float16, False),
    "Q4_0": CodeLayout(4, 32, 8, torch.float16, False),
    "Q4_1": CodeLayout(4, 32, 0, torch.float16, True),
    "Q5_0": CodeLayout(5, 32, 16, torch.float16, False),
    "Q5_1": CodeLayout(5, 32, 0, torch.float16, True),
    "Q4_K": CodeLayout(4, 32, 0, torch.float32, True),
    "Q5_K": CodeLayout(5, 32, 0, torch.float32, True),
    "Q6_K": CodeLayout(6, 16, 32, torch.float32, False),
}
Codes = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def split_codes(raw: torch.Tensor, type_name: str, rows: int) -> Codes:
    """A block-quantized tensor of `rows` rows as (codes uint8 [rows, K], scales [rows, K / group],
    minimums like scales or None), on `raw`'s device; `values_from_codes` of them is
    `dequantize`'s result, to the bit."""
    block_values, block_bytes = BLOCKS[type_name]
    blocks = raw.reshape(-1).view(torch.uint8).view(-1, block_bytes)  # [N, B]
    codes, scales, mins = SPLITTERS[type_name](blocks)
    if blocks.shape[0] % rows:
        raise ValueError(f"{type_name}: {blocks.shape[0]} blocks do not split into {rows} rows")
    return (codes.reshape(rows, -1), scales.reshape(rows, -1),
            None if mins is None else mins.reshape(rows, -1))


def values_from_codes(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                      layout: CodeLayout) -> torch.Tensor:
    """float32 [R, K] values: (code - zero) * scale (+ min), the same float32 operations in the
    same order as the `gguf` package's dequantization."""
    rows, k = codes.shape
    groups = (codes.float() - layout.zero).view(rows, -1, layout.group)  # [R, G, g]
    values = groups * scales.float().unsqueeze(-1)
    if mins is not None:
        values = values + mins.float().unsqueeze(-1)
    return values.view(rows, k)


def _f16_raw(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The float16 at byte `offset` of every block, as it is stored [N, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16)


def _split_q8_0(blocks: torch.Tensor) -> Codes:
    return blocks[:, 2:] ^ 0x80, _f16_raw(blocks, 0), None  # int8 two's complement + 128


def _split_q4_0(blocks: torch.Tensor) -> Codes:
    return _nibbles(blocks[:, 2:].view(-1, 1, 16)).view(-1, 32), _f16_raw(blocks, 0), None


def _split_q4_1(blocks: torch.Tensor) -> Codes:
    codes = _nibbles(blocks[:, 4:].view(-1, 1, 16)).view(-1, 32)
    return codes, _f16_raw(blocks, 0), _f16_raw(blocks, 2)


def _split_q5_0(blocks: torch.Tensor) -> Codes:
    return _five_bit(blocks, 2), _f16_raw(blocks, 0), None


def _split_q5_1(blocks: torch.Tensor) -> Codes:
    return _five_bit(blocks, 4), _f16_raw(blocks, 0), _f16_raw(blocks, 2)


def _k_group_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K per-group float32 (d * scale, -(dmin * min)) [N, 8]."""
    scales, mins = _k_scales(blocks[:, 4:16])
    return _f16(blocks, 0) * scales.float(), -(_f16(blocks, 2) * mins.float())


def _split_q4_k(blocks: torch.Tensor) -> Codes:
    return _nibbles(blocks[:, 16:].view(-1, 4, 32)).flatten(1), *_k_group_scales(blocks)


def _split_q5_k(blocks: torch.Tensor) -> Codes:
    low = _nibbles(blocks[:, 48:].view(-1, 4, 32))  # [N, 8, 32]
    high = _bits(blocks[:, 16:48].reshape(-1, 1, 32), 1)
    return (low | (high << 4)).flatten(1), *_k_group_scales(blocks)


def _split_q6_k(blocks: torch.Tensor) -> Codes:
    low = _nibbles(blocks[:, :128].reshape(-1, 4, 32))
    low = low.view(-1, 2, 2, 2, 32).transpose(2, 3).reshape(-1, 8, 32)  # as in _q6_k
    high = _bits(blocks[:, 128:192].reshape(-1, 2, 32), 2)
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    return (low | (high << 4)).flatten(1), _f16(blocks, 208) * scales, None


SPLITTERS: dict[str, Callable[[torch.Tensor], Codes]] = {
    "Q8_0": _split_q8_0,
    "Q4_0": _split_q4_0,
    "Q4_1": _split_q4_1,
    "Q5_0": _split_q5_0,
    "Q5_1": _split_q5_1,
    "Q4_K": _split_q4_k,
    "Q5_K": _split_q5_k,
    "Q6_K": _split_q6_k,
}
