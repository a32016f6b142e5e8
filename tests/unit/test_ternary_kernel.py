"""The compiled ternary CPU kernel against the unpacked float reference, on every code path."""

from __future__ import annotations

import pytest
import torch

from noesis.ternary import kernel
from noesis.ternary.quant import pack, reference_linear

# (tokens, out_features, in_features): tails of every block size, odd K, small batches
SHAPES = [
    (1, 64, 32),
    (1, 320, 192),
    (1, 33, 257),
    (2, 96, 200),
    (3, 17, 1031),
    (4, 128, 384),
    (5, 64, 512),
    (9, 40, 96),
]


def random_case(tokens: int, out_features: int, in_features: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ternary = torch.randint(-1, 2, (out_features, in_features), generator=generator)
    scale = torch.rand(out_features, generator=generator) + 0.05
    x = torch.randn(tokens, in_features, generator=generator) * 3
    return x, pack(ternary.to(torch.int8)), scale


@pytest.mark.parametrize("shape", SHAPES)
def test_native_kernel_matches_float_reference(shape):
    x, packed, scale = random_case(*shape)
    y = kernel.ternary_linear(x, packed, scale, shape[2])
    expected = reference_linear(x, packed, scale, shape[2])
    assert y.shape == (shape[0], shape[1])
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("isa", ["avx2", "scalar"])
@pytest.mark.parametrize("shape", SHAPES[:5])
def test_narrower_code_paths_match_reference(isa, shape):
    x, packed, scale = random_case(*shape, seed=1)
    y = kernel.ternary_linear(x, packed, scale, shape[2], isa=isa)
    torch.testing.assert_close(
        y, reference_linear(x, packed, scale, shape[2]), rtol=1e-5, atol=1e-4
    )


def test_kernel_recovers_exact_integer_sums():
    """With unit scales and activations already on the int8 grid the result is an exact integer."""
    generator = torch.Generator().manual_seed(2)
    ternary = torch.randint(-1, 2, (48, 300), generator=generator)
    q = torch.randint(-127, 128, (3, 300), generator=generator).float()
    q[:, 0] = 127  # absmax 127: s = 1, so x is its own quantization
    y = kernel.ternary_linear(q, pack(ternary.to(torch.int8)), torch.ones(48), 300)
    assert torch.equal(y, q @ ternary.float().T)


def test_threads_do_not_change_the_result():
    x, packed, scale = random_case(2, 2048, 512)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel.ternary_linear(x, packed, scale, 512)
        torch.set_num_threads(2)
        two = kernel.ternary_linear(x, packed, scale, 512)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)


def test_zero_activations_give_zero_output():
    _, packed, scale = random_case(1, 16, 64)
    assert kernel.ternary_linear(torch.zeros(1, 64), packed, scale, 64).abs().sum() == 0


def test_bad_arguments_are_named():
    x, packed, scale = random_case(1, 16, 64)
    with pytest.raises(ValueError, match=r"x must be \[tokens, 64\]"):
        kernel.ternary_linear(x[:, :60], packed, scale, 64)
    with pytest.raises(ValueError, match="scale"):
        kernel.ternary_linear(x, packed, scale[:8], 64)
    with pytest.raises(ValueError, match="unknown isa"):
        kernel.library("avx9000")


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("NOESIS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(kernel.KernelUnavailable, match="no-such-compiler"):
        kernel._build("native")
    monkeypatch.delenv("CC")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(kernel.KernelUnavailable, match="no gcc or cc on PATH"):
        kernel._build("native")


def test_failed_build_shows_the_compiler_output(monkeypatch, tmp_path):
    monkeypatch.setenv("NOESIS_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(kernel.ISA_FLAGS, "broken", ["-fno-such-flag"])
    with pytest.raises(kernel.KernelUnavailable, match="no-such-flag"):
        kernel._build("broken")


def test_native_build_uses_the_widest_available_path():
    flags = open("/proc/cpuinfo").read()
    expected = "avx512-vnni" if " avx512_vnni" in flags and " avx512bw" in flags else "avx2"
    if " avx2" not in flags:
        expected = "scalar"
    assert kernel.kernel_isa("native") == expected
