"""The K-quant encoders (noesis.quant.kquants): their bytes decoded by the `gguf` package and by
noesis's own GGUF dequantizer give back the input within each type's grid, better than the legacy
block type of about the same bits, and both decoders agree exactly."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GGMLType

from noesis.quant.kquants import BLOCK_BYTES, quantize_k
from noesis.weights.gguf_quants import dequantize

# (the legacy type of about the same bits per weight, a bound on the relative error of
# N(0, 0.02) rows with one outlier: about 0.073, 0.036 and 0.018 measured)
CASES = {"Q4_K": ("Q4_1", 0.08), "Q5_K": ("Q5_1", 0.04), "Q6_K": ("Q8_0", 0.02)}


def rows(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((48, 768)) * 0.02).astype(np.float32)
    x[3, 5], x[17, 300] = 0.5, -0.3  # outliers inside two blocks
    x[5, :256] = 0.0  # an all-zero block
    x[6, 256:512] = 0.01  # a constant block
    return x


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("kind", list(CASES))
def test_encoded_blocks_decode_to_the_input_within_the_grid(kind):
    x = rows()
    encoded = quantize_k(x, kind)
    assert encoded.dtype == np.uint8
    assert encoded.shape == (48, 768 // 256 * BLOCK_BYTES[kind])
    decoded = gguf.quants.dequantize(encoded, GGMLType[kind]).reshape(x.shape)
    legacy, bound = CASES[kind]
    error = relative_error(decoded, x)
    assert error < bound
    if kind != "Q6_K":  # the same bits as Q4_1 / Q5_1 (plus 0.5): no worse than those grids
        packed = gguf.quants.quantize(x, GGMLType[legacy])
        assert error < relative_error(gguf.quants.dequantize(packed, GGMLType[legacy]), x)
    assert np.all(decoded[5, :256] == 0)
    # a block's float16 step for 0.01 / (15 * 63) is subnormal: 0.3% is the format's precision
    assert np.allclose(decoded[6, 256:512], 0.01, rtol=5e-3)


@pytest.mark.parametrize("kind", list(CASES))
def test_noesis_decodes_the_blocks_as_the_gguf_package_does(kind):
    encoded = quantize_k(rows(seed=1), kind)
    ours = dequantize(torch.from_numpy(encoded.reshape(-1)), kind, 48 * 768)
    theirs = gguf.quants.dequantize(encoded, GGMLType[kind]).reshape(-1)
    assert torch.equal(ours.float(), torch.from_numpy(theirs))


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize_k(np.zeros((2, 96), np.float32), "Q4_K")
    with pytest.raises(ValueError, match="Q3_K"):
        quantize_k(np.zeros((2, 256), np.float32), "Q3_K")
