"""GGUF projections kept packed: codes and scales split out of the file's blocks dequantize to the
`gguf` package's values exactly, the packed layer equals the float layer on those values (the
portable path exactly, the Triton kernel under TRITON_INTERPRET=1), and a file loaded packed
generates what it generates dequantized, in less memory."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from checkpoints import noesis_greedy
from gguf import GGMLQuantizationType as GGMLType
from test_gguf import bpe_vocab, encode, hf_model, write_gguf

from noesis import LLM
from noesis.engine.loading import describe_checkpoint, load_model
from noesis.errors import ConfigError
from noesis.quant.gguf_packed import GGUFLinear, PackedRows
from noesis.weights.gguf import keeps_packed
from noesis.weights.gguf_quants import CODE_LAYOUTS, split_codes

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TYPES = list(CODE_LAYOUTS)  # Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K


def quantized(qtype: str, rows: int, k: int, seed: int = 0):
    """A random [rows, k] weight in `qtype`: its split (codes, scales, minimums) and the `gguf`
    package's float32 dequantization."""
    rng = np.random.default_rng(seed)
    stored = encode(rng.standard_normal((rows, k)).astype(np.float32) * 0.1, qtype, rng)
    reference = torch.from_numpy(gguf.quants.dequantize(stored, GGMLType[qtype]).copy())
    return split_codes(torch.from_numpy(stored), qtype, rows), reference


def packed_rows(qtype: str, rows: int, k: int, seed: int = 0):
    """A loaded PackedRows of `qtype` and its reference weight."""
    codes, reference = quantized(qtype, rows, k, seed)
    layer = PackedRows(k, rows, qtype)
    with torch.no_grad():
        layer.load(0, *codes)
    return layer, reference


@pytest.mark.parametrize("qtype", TYPES)
def test_packed_rows_equal_the_float_layer_on_the_gguf_weights(qtype):
    layer, reference = packed_rows(qtype, 24, 256)
    assert torch.equal(layer.dequantize(), reference)
    assert layer.scales.dtype == CODE_LAYOUTS[qtype].scale_dtype
    x = torch.randn(3, 256)
    assert torch.equal(layer(x), F.linear(x, reference))  # the same weights, the same matmul


@pytest.mark.parametrize(
    ("qtype", "m"),
    [("Q4_1", 20), ("Q8_0", 3), ("Q4_K", 1), ("Q6_K", 2)],  # minimums, int8, fp32, group 16
)
def test_triton_kernel_matches_the_portable_path(qtype, m):
    pytest.importorskip("triton")
    from noesis.quant import kernel

    layer, reference = packed_rows(qtype, 40, 256, seed=1)
    x = torch.randn(m, 256)
    got = kernel.packed_matmul(x, layer.qweight, layer.scales, layer.layout.zero, None,
                               layer.bits, layer.layout.group, layer.mins)
    assert torch.allclose(got, F.linear(x, reference), rtol=1e-5, atol=1e-5)


def test_fused_parts_of_different_types_run_as_blocks():
    """q and k in Q4_K share a block, v in Q6_K gets its own; the outputs are concatenated."""
    (codes, scales, mins), qk_ref = quantized("Q4_K", 32, 256, seed=2)
    v_codes, v_ref = quantized("Q6_K", 16, 256, seed=3)
    layer = GGUFLinear(256, [("Q4_K", 16), ("Q4_K", 16), ("Q6_K", 16)], bias=True)
    assert [block.type_name for block in layer.blocks] == ["Q4_K", "Q6_K"]
    with torch.no_grad():
        for offset in (0, 16):
            rows = slice(offset, offset + 16)
            layer.load_part(offset, codes[rows], scales[rows], mins[rows])
        layer.load_part(32, *v_codes)
        layer.bias.copy_(torch.randn(48))
    weight = torch.cat([qk_ref, v_ref])
    assert torch.equal(layer.dequantize(), weight)
    x = torch.randn(2, 5, 256)
    assert torch.allclose(layer(x), F.linear(x, weight, layer.bias), rtol=1e-6, atol=1e-6)


# ---- whole files --------------------------------------------------------------------------------

# a Q4_K_M-like file: Q4_K projections with v and down in Q6_K, the embedding in Q8_0
MIXED = {"token_embd.weight": "Q8_0"} | {
    f"blk.{i}.{name}.weight": "Q6_K" for i in range(2) for name in ("attn_v", "ffn_down")
}


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf-packed") / "llama-q4_k_m.gguf"
    model = hf_model("llama", hidden=256, intermediate_size=256)
    write_gguf(path, model, "llama", "Q4_K", bpe_vocab(), types=MIXED)
    return path


def test_a_packed_file_generates_what_it_generates_dequantized(mixed_file):
    def run(mode):
        llm = LLM(str(mixed_file), device="cpu", dtype="float32", progress=False,
                  max_model_len=64, gguf_weights=mode)
        return llm, noesis_greedy(llm, [0, 5, 9, 77, 100, 21], 10)

    packed, (tokens, logprobs) = run("packed")
    qkv = packed.engine.loaded.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GGUFLinear)
    assert [block.type_name for block in qkv.blocks] == ["Q4_K", "Q6_K"]
    _, (ref_tokens, ref_logprobs) = run("dequantized")
    assert tokens == ref_tokens
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-5)


def test_packed_weights_keep_their_scales_exact_in_bfloat16(mixed_file):
    """Casting the model to bfloat16 leaves the packed scales as the file has them, and the
    packed model takes less memory than the dequantized one."""
    def load(mode):
        return load_model(mixed_file, device="cpu", dtype="bfloat16", progress=False,
                          gguf_weights=mode).model

    packed, dequantized = load("packed"), load("dequantized")
    down = packed.model.layers[1].mlp.down_proj
    assert down.blocks[0].scales.dtype == torch.float32
    assert torch.equal(down.dequantize().bfloat16(),
                       dequantized.model.layers[1].mlp.down_proj.weight)

    def size(model):
        return sum(p.numel() * p.element_size() for p in model.parameters())

    assert size(packed) < 0.8 * size(dequantized)


def test_info_shows_the_packed_bytes(mixed_file):
    info = describe_checkpoint(mixed_file, dtype="bfloat16")
    assert info["weights in memory"].endswith("(dequantized to bfloat16 at load)")
    assert "% of " in info["gguf packed weights"]


def test_auto_packs_on_cuda_only():
    assert keeps_packed("auto", torch.device("cuda"))
    assert keeps_packed("packed", torch.device("cpu"))
    assert not keeps_packed("auto", torch.device("cpu"))
    assert not keeps_packed("dequantized", torch.device("cuda"))
    with pytest.raises(ConfigError, match="gguf_weights must be auto, packed or dequantized"):
        keeps_packed("int4", torch.device("cpu"))
