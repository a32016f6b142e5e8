"""e4m3 rounding inside Triton kernels: what a kernel writing an fp8 KV cache stores, bit for bit
the value noesis.kv.fp8.quantize stores (torch's division, clamp and round-to-nearest-even cast).

The rounding is done in float32 arithmetic before the cast, so the cast itself is exact: the GPU's
conversion instruction and Triton's interpreter (whose conversion rounds ties up and drops the
carry of a rounding into the next binade, 31.5 -> 16) then store the same bits.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_MAX: tl.constexpr = tl.constexpr(448.0)  # the largest finite e4m3fn value (kv.fp8.FP8_MAX)


@triton.jit
def quantize_e4m3(x, scale):
    """x / scale (float32, correctly rounded), clamped to the finite range and rounded to the
    nearest e4m3 value, ties to even, as float8e4nv."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    bits = y.to(tl.int32, bitcast=True)
    # e4m3 keeps 3 fraction bits: spacing 2^(e - 3) in binade e, and 2^-9 under 2^-6 (subnormal).
    # Adding 2^(e + 20), whose float32 spacing is that, rounds |y| to it (ties to even).
    exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # biased binade of |y|
    magic = ((exponent + 20) << 23).to(tl.float32, bitcast=True)
    rounded = (tl.abs(y) + magic) - magic
    # the sign back by a product: Triton's negation is 0 - x, which makes -0.0 into +0.0
    return (rounded * tl.where(bits < 0, -1.0, 1.0)).to(tl.float8e4nv)
