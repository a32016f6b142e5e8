"""int4 group-quantized weights as tensor-core fragments (torch only): the layout
kernels/frag_gemv.py multiplies with `mma.sync` (int4_mma.py says how a word becomes operands).

From noesis.quant.packing's in-memory layout (codes [N, K / 8] int32, scales and zero points
[N, G]), for 16-bit float scales and groups of a multiple of 64 columns (one group a row: G = 1):
- words [N/16, K/64, 32, 4] int32: tile T, chunk c, lane l = 4g + t, word j = 2b + i holds rows
  16T + g and 16T + g + 8 at columns 64c + 32b + 8t + 4i + e, e = 0..3; the code of row half h
  at column e sits at nibble (2 (e // 2) + h) + 4 (e % 2).
- params [N/16, G, 8, 2] int32: per (tile, group, g) the scales of rows g and g + 8 as a pair
  of the scales' 16-bit floats, then -(base + zero) of the same rows, a pair too (base 128 for
  bfloat16, 1024 for float16: the number whose low mantissa bits the codes fill).
N is padded with zero rows (scale 0) to whole tiles. The bytes are the stored layout's: the
codes the same, the scales and zero points four bytes a (row, group) as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from noesis.quant.packing import as_int32, unpack

TILE_ROWS, CHUNK = 16, 64
BASE = {torch.bfloat16: 128, torch.float16: 1024}  # the 16-bit float whose low bits take a code
# Rows packed at a time: the int64 temporaries of a block (about 40 bytes a weight) stay small
# beside the weights being loaded (a multiple of TILE_ROWS).
PACK_ROWS = 2048


@dataclass
class Int4Fragments:
    """A projection's int4 codes in the fragment layout (module docstring) and its sizes."""

    words: torch.Tensor  # [N / 16, K / 64, 32, 4] int32
    params: torch.Tensor  # [N / 16, G, 8, 2] int32
    out_features: int
    in_features: int
    group_size: int
    dtype: torch.dtype  # the scales' (and the input's) 16-bit float type

    @property
    def tiles(self) -> int:
        return self.words.shape[0]

    @property
    def chunks(self) -> int:
        return self.words.shape[1]

    @property
    def groups(self) -> int:
        return self.params.shape[1]

    @classmethod
    def pack(cls, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
             group_size: int) -> Int4Fragments:  # fmt: skip
        """From a PackedLinear's int4 tensors (noesis.quant.packing), ordered groups only."""
        n, k = qweight.shape[0], qweight.shape[1] * 8
        groups = scales.shape[1]
        if scales.dtype not in BASE:
            raise ValueError(f"int4 fragments take bfloat16 or float16 scales, not {scales.dtype}")
        if k % CHUNK or group_size % CHUNK or groups * group_size != k:
            raise ValueError(
                f"int4 fragments need K ({k}) and the group size ({group_size}) to be multiples "
                f"of {CHUNK}, {groups} groups covering K"
            )
        blocks = [(_words(unpack(qweight[start : start + PACK_ROWS], 4), k),
                   _params(scales[start : start + PACK_ROWS], qzeros[start : start + PACK_ROWS]))
                  for start in range(0, n, PACK_ROWS)]  # fmt: skip
        words = torch.cat([w for w, _ in blocks]) if len(blocks) > 1 else blocks[0][0]
        params = torch.cat([p for _, p in blocks]) if len(blocks) > 1 else blocks[0][1]
        return cls(words, params, n, k, group_size, scales.dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weights [N, K] the layout stands for: scale x (code - zero), in float32, then
        dtype (test and reference use; the kernels never materialize it)."""
        tiles, chunks = self.tiles, self.chunks
        word = self.words.long() & 0xFFFFFFFF  # [T, c, lane, j]
        codes = torch.empty(tiles, chunks, 32, 4, 2, 4, dtype=torch.int64, device=word.device)
        for h in range(2):
            for e in range(4):
                codes[..., h, e] = (word >> (4 * _nibble(h, e))) & 15
        # [T, c, g, t, b, i, h, e] -> [T, h, g, c, b, t, i, e]
        codes = codes.reshape(tiles, chunks, 8, 4, 2, 2, 2, 4).permute(0, 6, 2, 1, 4, 3, 5, 7)
        codes = codes.reshape(tiles * TILE_ROWS, chunks * CHUNK)
        pairs = self.params.long() & 0xFFFFFFFF  # [T, G, g, 2]
        halves = torch.stack((pairs & 0xFFFF, pairs >> 16), dim=-1)  # [T, G, g, 2, h]
        values = _floats(halves, self.dtype)
        scale = values[:, :, :, 0].permute(0, 3, 2, 1).reshape(tiles * TILE_ROWS, -1)
        zero = -values[:, :, :, 1].permute(0, 3, 2, 1).reshape(tiles * TILE_ROWS, -1)
        zero = zero - BASE[self.dtype]
        per_column = self.group_size
        weight = (codes - zero.repeat_interleave(per_column, 1)) * scale.repeat_interleave(
            per_column, 1)
        return weight[: self.out_features, : self.in_features].to(dtype)


def _nibble(h: int, e: int) -> int:
    """Where the code of row half h at column e of a word sits (register 2 (e // 2) + h)."""
    return 2 * (e // 2) + h + 4 * (e % 2)


def _words(codes: torch.Tensor, k: int) -> torch.Tensor:
    n = codes.shape[0]
    tiles, chunks = -(-n // TILE_ROWS), k // CHUNK
    codes = torch.nn.functional.pad(codes, (0, 0, 0, tiles * TILE_ROWS - n)).long()
    # codes[T, h, g, c, b, t, i, e] -> (T, c, g, t, b, i, h, e)
    codes = codes.reshape(tiles, 2, 8, chunks, 2, 4, 2, 4).permute(0, 3, 2, 5, 4, 6, 1, 7)
    word = torch.zeros(codes.shape[:-2], dtype=torch.int64, device=codes.device)
    for h in range(2):
        for e in range(4):
            word |= codes[..., h, e] << (4 * _nibble(h, e))
    return as_int32(word).reshape(tiles, chunks, 32, 4).contiguous()


def _params(scales: torch.Tensor, qzeros: torch.Tensor) -> torch.Tensor:
    n, dtype, groups = scales.shape[0], scales.dtype, scales.shape[1]
    tiles = -(-n // TILE_ROWS)
    pad = (0, 0, 0, tiles * TILE_ROWS - n)
    scales = torch.nn.functional.pad(scales, pad)
    minus = -(torch.nn.functional.pad(qzeros.float(), pad) + BASE[dtype])
    bits = torch.stack((_bits(scales), _bits(minus.to(dtype))), dim=-1)  # [N', G, 2]
    # bits[T, h, g, G, w] -> (T, G, g, w, h): row g's half low, row g + 8's high
    bits = bits.reshape(tiles, 2, 8, groups, 2).permute(0, 3, 2, 4, 1)
    return as_int32(bits[..., 0] | (bits[..., 1] << 16)).contiguous()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A 16-bit float tensor's bit patterns as int64 in [0, 2^16)."""
    return t.contiguous().view(torch.int16).long() & 0xFFFF


def _floats(bits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 bit patterns in [0, 2^16) -> float32 values of the 16-bit float type."""
    signed = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16)
    return signed.view(dtype).float()

