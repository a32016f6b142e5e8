"""Ternary (BitNet b1.58-style) projections: QAT training, the packed 2-bit format, a CPU kernel.

- `quant`: the arithmetic shared by training and inference (absmean ternarization, per-token
  absmax int8 activations) and the packed checkpoint format.
- `bitlinear`: `BitLinear`, the QAT layer of the tiny trainer, and the packed export.
- `kernel`: the compiled CPU kernel for `y = x @ W^T` on packed weights.
- `linear`: `TernaryLinear`, the engine's packed projection, and the hook that installs it when a
  checkpoint's config.json declares `"quant_method": "ternary"`.
"""

from noesis.ternary.quant import TernaryFormatError

__all__ = ["TernaryFormatError"]
