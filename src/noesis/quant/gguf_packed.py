"""GGUF projections kept packed: the codes of llama.cpp's block types in PackedLinear's word
layout, beside the file's own scales and minimums, dequantized inside the matmul.

Every block type noesis reads maps exactly onto w = (code - zero) * scale (+ min) per group
(`gguf_quants.CODE_LAYOUTS`): 4-bit codes (Q4_0, Q4_1, Q4_K) pack eight to an int32 word, 5-,
6- and 8-bit codes (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) four. Scales and minimums keep their exact
type: the file's float16 for the legacy types, float32 for the K-quants' products of a
super-block scale and a 6-bit one. The weight is computed in float32 and rounded once to the
activations' dtype, so the layer multiplies by what dequantize-at-load would have stored.

Bytes per weight in memory against the file's: Q4_0 4.5 (4.5), Q4_1 5 (5), Q8_0 8.5 (8.5),
Q4_K 6 (4.5), Q5_0 8.5 (5.5), Q5_1 9 (6), Q5_K 10 (5.5), Q6_K 10 (6.6), bfloat16 16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from noesis.kernels import ops
from noesis.quant.linear import TILE_ELEMENTS
from noesis.quant.packing import pack, unpack
from noesis.weights.gguf_quants import CODE_LAYOUTS, values_from_codes

STORAGE_BITS = {4: 4, 5: 8, 6: 8, 8: 8}  # a code's bits -> the bits it takes in a word
# Scales and minimums are held as the integer bits of their float type, so that casting the
# model to its dtype (which converts every floating parameter) leaves them as the file has them.
BITS_DTYPE = {torch.float16: torch.int16, torch.float32: torch.int32}


def packable(type_name: str) -> bool:
    """Whether a GGUF tensor type stays packed (the block types; F32/F16/BF16 load as floats)."""
    return type_name in CODE_LAYOUTS


class PackedRows(nn.Module):
    """Output rows of one GGUF block type, packed: y = x @ W^T with W dequantized per tile."""

    def __init__(self, in_features: int, out_features: int, type_name: str) -> None:
        super().__init__()
        layout = CODE_LAYOUTS[type_name]
        self.type_name, self.layout = type_name, layout
        self.in_features, self.out_features = in_features, out_features
        self.bits = STORAGE_BITS[layout.code_bits]
        words = in_features // (32 // self.bits)
        groups = in_features // layout.group
        held = BITS_DTYPE[layout.scale_dtype]
        self.qweight = nn.Parameter(torch.empty(out_features, words, dtype=torch.int32),
                                    requires_grad=False)
        self.scale_bits = nn.Parameter(torch.empty(out_features, groups, dtype=held),
                                       requires_grad=False)
        self.min_bits = None
        if layout.has_min:
            self.min_bits = nn.Parameter(torch.empty(out_features, groups, dtype=held),
                                         requires_grad=False)

    @property
    def scales(self) -> torch.Tensor:
        return self.scale_bits.view(self.layout.scale_dtype)

    @property
    def mins(self) -> torch.Tensor | None:
        return None if self.min_bits is None else self.min_bits.view(self.layout.scale_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, K] -> [T, N]."""
        if ops.use_triton(x):
            from noesis.quant import kernel

            return kernel.packed_matmul(x, self.qweight, self.scales, self.layout.zero, None,
                                        self.bits, self.layout.group, self.mins)
        rows = max(1, TILE_ELEMENTS // self.in_features)
        tiles = [F.linear(x, self.dequantize(i, i + rows).to(x.dtype))
                 for i in range(0, self.out_features, rows)]
        return tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1)

    def dequantize(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """float32 weights [end - start, K] of rows start..end, equal to the `gguf` package's."""
        codes = unpack(self.qweight[start:end], self.bits)
        mins = None if self.mins is None else self.mins[start:end]
        return values_from_codes(codes, self.scales[start:end], mins, self.layout)

    def load(self, offset: int, codes: torch.Tensor, scales: torch.Tensor,
             mins: torch.Tensor | None) -> None:
        """Rows offset.. from `gguf_quants.split_codes`' (codes, scales, minimums)."""
        rows = codes.shape[0]
        self.qweight[offset : offset + rows] = pack(codes, self.bits)
        self.scales[offset : offset + rows] = scales
        if mins is not None:
            self.mins[offset : offset + rows] = mins

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"type={self.type_name}")


class GGUFLinear(nn.Module):
    """A decoder projection whose GGUF tensors stay packed. Fused parts (q/k/v, gate/up) of one
    type share a PackedRows; parts of different types (a Q4_K_M file keeps v in Q6_K beside
    Q4_K q and k) each get their own, and their outputs are concatenated."""

    def __init__(self, in_features: int, parts: list[tuple[str, int]], bias: bool) -> None:
        """`parts`: (GGUF type, rows) of each part, in row order."""
        super().__init__()
        runs: list[list] = []
        for type_name, rows in parts:
            if runs and runs[-1][0] == type_name:
                runs[-1][1] += rows
            else:
                runs.append([type_name, rows])
        self.in_features = in_features
        self.out_features = sum(rows for _, rows in parts)
        self.blocks = nn.ModuleList(PackedRows(in_features, rows, name) for name, rows in runs)
        self.bias = nn.Parameter(torch.empty(self.out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # [T, K]
        outputs = [block(flat) for block in self.blocks]
        y = outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=1)
        y = y.view(*x.shape[:-1], self.out_features)  # [..., N]
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] this layer multiplies by."""
        return torch.cat([block.dequantize() for block in self.blocks])

    def load_part(self, offset: int, codes: torch.Tensor, scales: torch.Tensor,
                  mins: torch.Tensor | None) -> None:
        """The part whose rows start at `offset` of the fused weight."""
        for block in self.blocks:
            if offset < block.out_features:
                block.load(offset, codes, scales, mins)
                return
            offset -= block.out_features
        raise AssertionError(f"row {offset} past the end of {self}")  # sources_for's offsets
