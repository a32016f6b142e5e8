"""PackedLinear: a projection whose weight stays packed (int4 or int8 codes, per-group scales and
zero points) and is dequantized inside the matmul; and the factory the decoder layers call.

A checkpoint whose quantization_config names AWQ or GPTQ gets one for every attention and MLP
projection; `weights/mapping.py` routes each checkpoint tensor into it (stacking q/k/v and gate/up
by output rows) and `weights/loader.py` converts it to the layout of `noesis.quant.packing`, then
calls `check_loaded`. Embeddings, norms and the LM head stay float.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from noesis.errors import CheckpointMismatch, UnsupportedModel
from noesis.kernels import ops
from noesis.models.config import ModelConfig
from noesis.quant.int4_fragments import CHUNK, Int4Fragments
from noesis.quant.packing import unpack
from noesis.quant.scheme import WeightQuant, weight_quant

# Dequantized elements per tile of the portable path: bounds its temporary memory (64 MiB of
# float32 at most, several temporaries of it) whatever the projection's size.
TILE_ELEMENTS = 1 << 22
# A CUDA load (sm_80 or later) lays each eligible int4 projection's codes out as tensor-core
# fragments (quant/int4_fragments.py, `fragment_projections`) in place of the stored layout, and
# its forward reads those (kernel.fragment_linear: one row, up to 64 rows as the mma's columns,
# tl.dot tiles beyond). Measured against the stored layout's kernels on an H200, 8B shape, AWQ
# int4 g128 (benchmarks/RESULTS.md, nineteenth session): 467 against 348 tok/s at batch 1,
# 3035 against 1197 at batch 8, 7160 against 6685 at batch 64, prefill 5-7% faster. False keeps
# the stored layout (the benchmarks' comparison).
INT4_FRAGMENTS = True


class PackedLinear(nn.Module):
    """y = x @ dequantize(W)^T (+ bias), W kept packed (layout: noesis.quant.packing).

    On CUDA a Triton kernel dequantizes tiles in registers; elsewhere a tile of output rows at
    a time is dequantized into the input's dtype and multiplied."""

    def __init__(self, in_features: int, out_features: int, bias: bool, quant: WeightQuant,
                 parts: int = 1) -> None:
        super().__init__()
        group = quant.group_of(in_features)
        if in_features % group or in_features % quant.pack:
            raise UnsupportedModel(
                f"a {quant.describe()} projection needs in_features divisible by {group} and "
                f"{quant.pack}, got {in_features}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = quant.bits, group
        groups = in_features // group
        codes = torch.empty(out_features, in_features // quant.pack, dtype=torch.int32)
        self.qweight = nn.Parameter(codes, requires_grad=False)
        self.scales = nn.Parameter(torch.empty(out_features, groups), requires_grad=False)
        self.qzeros = nn.Parameter(torch.empty(out_features, groups), requires_grad=False)
        self.g_idx = None  # GPTQ: the group of each input column, one row per fused part
        if quant.method == "gptq":
            table = torch.empty(parts, in_features, dtype=torch.int32)
            self.g_idx = nn.Parameter(table, requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # Whether groups follow g_idx (GPTQ act-order) rather than the column order; decided by
        # check_loaded from the loaded table, so that ordered checkpoints take the faster path.
        self.act_order = False
        self._fragment_dtype: torch.dtype | None = None  # use_fragments (INT4_FRAGMENTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # [T, K]
        frags = self.fragments
        groups = self.g_idx[0] if self.act_order else None
        if frags is not None or ops.use_triton(flat):
            from noesis.quant import kernel

            y = (kernel.fragment_linear(flat, frags) if frags is not None
                 else kernel.packed_matmul(flat, self.qweight, self.scales, self.qzeros, groups,
                                           self.bits, self.group_size))  # fmt: skip
        else:
            y = dequantized_matmul(flat, self.qweight, self.scales, self.qzeros, groups,
                                   self.bits, self.group_size)
        y = y.view(*x.shape[:-1], self.out_features)  # [..., N]
        return y if self.bias is None else y + self.bias

    @property
    def fragments(self) -> Int4Fragments | None:
        """The codes as tensor-core fragments, once `use_fragments` laid them out (read from
        this module's buffers, so that they follow it across devices)."""
        if self._fragment_dtype is None:
            return None
        return Int4Fragments(self.fragment_words, self.fragment_params, self.out_features,
                             self.in_features, self.group_size, self._fragment_dtype)  # fmt: skip

    def use_fragments(self) -> bool:
        """Lay the codes out as tensor-core fragments in place of the stored layout (qweight,
        scales and qzeros are freed), if this projection fits them: int4, groups in column
        order of a multiple of 64 columns, 16-bit float scales. Whether it did."""
        if self._fragment_dtype is not None:
            return True
        fits = (self.bits == 4 and not self.act_order and self.group_size % CHUNK == 0
                and self.scales.dtype in (torch.bfloat16, torch.float16))  # fmt: skip
        if fits:
            frags = Int4Fragments.pack(self.qweight, self.scales, self.qzeros, self.group_size)
            for name in ("qweight", "scales", "qzeros"):
                delattr(self, name)
                setattr(self, name, None)
            self.register_buffer("fragment_words", frags.words)
            self.register_buffer("fragment_params", frags.params)
            self._fragment_dtype = frags.dtype
        return fits

    def whole_tile_groups(self) -> bool:
        """Whether every K tile of a power-of-two width holds whole groups or lies inside one,
        as the one-row kernels (noesis.quant.packed_row) need: no act-order, one group per
        row or groups of a power-of-two size. Known once the weights are loaded."""
        one_group = self.group_size == self.in_features
        power_of_two = self.group_size & (self.group_size - 1) == 0
        return not self.act_order and (one_group or power_of_two)

    def dequantize(self) -> torch.Tensor:
        """The float weight [N, K] this layer multiplies by, in the scales' dtype."""
        frags = self.fragments
        if frags is not None:
            return frags.dequantize(frags.dtype)
        groups = self.g_idx[0] if self.act_order else None
        index = group_index(groups, self.in_features, self.group_size, self.qweight.device)
        return dequantize(self.qweight, self.scales, self.qzeros, index, self.bits)

    def check_loaded(self, name: str) -> None:
        """Called by the weight loader once the tensors are in: a GPTQ table must give every
        fused part the same grouping and name real groups."""
        if self.g_idx is None:
            return
        table = self.g_idx
        if not bool((table == table[0]).all()):
            raise CheckpointMismatch(
                f"{name}.g_idx: the fused projections' g_idx differ (noesis needs one grouping "
                "of the input columns for the projections that share an input)"
            )
        groups = self.scales.shape[1]
        if bool(((table < 0) | (table >= groups)).any()):
            raise CheckpointMismatch(f"{name}.g_idx: values outside [0, {groups})")
        ordered = torch.arange(self.in_features, device=table.device) // self.group_size
        self.act_order = not torch.equal(table[0].long(), ordered)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, bias={self.bias is not None}")


def fragment_projections(model: nn.Module) -> int:
    """Every int4 PackedLinear of a loaded `model` that fits the fragment layout takes it in
    place of the stored one (`PackedLinear.use_fragments`), one at a time (the extra memory is
    one projection's); returns how many."""
    return sum(m.use_fragments() for m in model.modules() if type(m) is PackedLinear)


def projection(config: ModelConfig, in_features: int, out_features: int, bias: bool,
               parts: int = 1) -> nn.Module:
    """A decoder projection: nn.Linear, or a PackedLinear when the checkpoint is AWQ / GPTQ.
    `parts` is how many checkpoint projections are fused into it (q/k/v: 3)."""
    quant = weight_quant(config)
    if quant is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return PackedLinear(in_features, out_features, bias, quant, parts)


def dequantized_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       qzeros: torch.Tensor, groups: torch.Tensor | None, bits: int,
                       group_size: int) -> torch.Tensor:
    """x [T, K] @ dequantize(W)^T -> [T, N], a tile of output rows at a time."""
    k = x.shape[1]
    index = group_index(groups, k, group_size, x.device)
    rows = max(1, TILE_ELEMENTS // k)
    tiles = [
        F.linear(x, dequantize(qweight[i : i + rows], scales[i : i + rows],
                               qzeros[i : i + rows], index, bits).to(x.dtype))
        for i in range(0, qweight.shape[0], rows)
    ]
    return tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
               index: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] weights (q - zero) * scale in the scales' dtype; `index` [K] is each column's
    group. The difference is exact; the product rounds once, as the kernel's does."""
    q = unpack(qweight, bits).to(scales.dtype)  # [N, K]
    return (q - qzeros[:, index]) * scales[:, index]


def group_index(groups: torch.Tensor | None, in_features: int, group_size: int,
                device: torch.device) -> torch.Tensor:
    """Each input column's group: from the act-order table, else consecutive runs."""
    if groups is not None:
        return groups.long()
    return torch.arange(in_features, device=device) // group_size
