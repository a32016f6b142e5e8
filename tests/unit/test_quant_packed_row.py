"""The fused one-row block for packed weights (noesis.quant.packed_row) under TRITON_INTERPRET=1:
each kernel against the unfused packed path (PackedLinear on the portable path, then the
separate norm, SiLU-multiply, RoPE, cache write and residual add), int4 and int8, zero points
from a tensor and constant; and a tiny AWQ model's greedy tokens with the fused path on and off.

float32: the kernel sums 2^BITS * (1 + code / 2^BITS) * x per word, about 1e-6 relative error
(test_quant_gemv.py); the portable path dequantizes, then multiplies."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from checkpoints import noesis_greedy
from test_quant_checkpoints import write_quantized
from test_quant_linear import packed_layer

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from noesis.kernels import ops, row_gemv  # noqa: E402
from noesis.kv.fp8 import FP8LayerCache, quantize, scales_from_amax  # noqa: E402
from noesis.models import layers  # noqa: E402
from noesis.models.rope import apply_rotary  # noqa: E402
from noesis.quant import packed_row  # noqa: E402

EPS = 1e-5
FLOAT32_ERROR = 1e-5
# (bits, group size, constant zero point or None: a tensor of them)
LAYOUTS = {
    "int4-g32": (4, 32, None),
    "int4-g32-symmetric": (4, 32, 8),
    "int8-per-channel": (8, -1, None),
    "int8-g32-symmetric": (8, 32, 128),
}
# rows per program, a 64-column K tile (K = 96: the second tile runs past K), warps, stages
SMALL_TILES = (16, 64, 1, 2)


def packed(n, k, layout, seed):
    """(what the kernels take, the PackedLinear the unfused path runs with the same weight)."""
    bits, group, zero = LAYOUTS[layout]
    layer, _ = packed_layer(n, k, bits, group, seed=seed)
    if zero is None:
        return layer, layer
    with torch.no_grad():
        layer.qzeros.fill_(zero)
    return SimpleNamespace(qweight=layer.qweight, scales=layer.scales, qzeros=zero, bits=bits,
                           group_size=layer.group_size), layer


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def row_and_norm(width, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, width, generator=gen) * 3, torch.rand(width, generator=gen) + 0.5


@pytest.mark.parametrize(("layout", "config"), [
    *((layout, SMALL_TILES) for layout in LAYOUTS),
    ("int4-g32", None), ("int8-per-channel", None),  # the default config: one tile
])
def test_packed_gemv_adds_the_residual_to_the_packed_projection(layout, config):
    weights, layer = packed(40, 96, layout, seed=1)  # 40 rows: a partial program of 16
    x, residual = row_and_norm(96, seed=2)[0], torch.randn(1, 40)
    got = packed_row.gemv(x, weights, residual, config=config)
    assert got.shape == (1, 40)
    assert rel_err(got, layer(x) + residual) < FLOAT32_ERROR
    assert rel_err(packed_row.gemv(x, weights, config=config), layer(x)) < FLOAT32_ERROR


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_norm_glu_matches_norm_projection_silu_mul(layout):
    weights, layer = packed(2 * 24, 96, layout, seed=3)
    x, norm_weight = row_and_norm(96, seed=4)
    normed, _ = ops.add_rms_norm(x, None, norm_weight, EPS)  # CPU: the torch reference
    got = packed_row.norm_glu(x, norm_weight, EPS, weights, config=SMALL_TILES)
    assert got.shape == (1, 24)
    assert rel_err(got, ops.silu_mul(layer(normed))) < FLOAT32_ERROR


@pytest.mark.parametrize("layout", ["int4-g32", "int4-g32-symmetric"])
def test_bfloat16_input_within_its_rounding(layout):
    """bfloat16 activations and 4-bit codes in the plain GEMV: x's bfloat16 pairs read from
    memory, against the float32 unfused step on the same bfloat16 values: the output rounded to
    bfloat16 once (the interpreter truncates, 2e-3 to 3e-3); a pair from the wrong columns or a
    zero point left out is off by tens of percent. The interpreter computes bfloat16 sums and
    the normed modes' bfloat16 steps wrongly (the int8 path's too): no residual here, and the
    pairs made from normed floats are checked in test_quant_gemv.py's helper test."""
    weights, layer = packed(40, 96, layout, seed=6)
    x = row_and_norm(96, seed=7)[0].bfloat16()
    with torch.no_grad():  # bfloat16 scales (and zero points), the same values in the layer
        weights.scales.copy_(weights.scales.bfloat16().float())
    zeros = weights.qzeros if isinstance(weights.qzeros, int) else weights.qzeros.bfloat16()
    half = SimpleNamespace(qweight=weights.qweight, scales=weights.scales.bfloat16(),
                           qzeros=zeros, bits=4, group_size=weights.group_size)
    got = packed_row.gemv(x, half, config=SMALL_TILES)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, layer(x.float())) < 6e-3


def unfused_qkv(x, norm_weight, layer, heads, kv_heads, cos, sin):
    """q, k (rotated) and v [heads, d] of the unfused steps."""
    normed, _ = ops.add_rms_norm(x, None, norm_weight, EPS)
    q, k, v = layer(normed).view(-1, cos.shape[-1]).split([heads, kv_heads, kv_heads])
    return apply_rotary(q[None], cos, sin)[0], apply_rotary(k[None], cos, sin)[0], v


def qkv_inputs(layout, head_dim, seed):
    heads, kv_heads = 4, 2
    weights, layer = packed((heads + 2 * kv_heads) * head_dim, 96, layout, seed)
    x, norm_weight = row_and_norm(96, seed + 1)
    angles = torch.randn(1, head_dim // 2, generator=torch.Generator().manual_seed(seed + 2))
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    expected = unfused_qkv(x, norm_weight, layer, heads, kv_heads, cos, sin)
    return (x, norm_weight, EPS, weights, heads, kv_heads, cos, sin), expected


# head_dim 8: a half head of 4 rows, fewer than a program's 16 (the rows shrink to fit)
@pytest.mark.parametrize(("layout", "head_dim"), [("int4-g32", 16), ("int4-g32-symmetric", 8),
                                                  ("int8-per-channel", 16)])
def test_packed_norm_qkv_rope_store_matches_the_unfused_steps(layout, head_dim):
    args, (q, k, v) = qkv_inputs(layout, head_dim, seed=5)
    kv_heads, slot = args[5], 13
    kv = torch.zeros(2, 5, 4, kv_heads, head_dim)
    got = packed_row.norm_qkv_rope_store(*args, torch.tensor([slot]), kv[0], kv[1],
                                         config=SMALL_TILES)
    assert rel_err(got, torch.cat([q, k, v]).view(1, -1)) < FLOAT32_ERROR
    flat = kv.view(2, -1, kv_heads, head_dim)
    assert rel_err(flat[0, slot], k) < FLOAT32_ERROR
    assert rel_err(flat[1, slot], v) < FLOAT32_ERROR
    flat[:, slot] = 0
    assert flat.abs().sum() == 0  # nothing else written


def test_packed_norm_qkv_rope_store_writes_fp8_with_the_scales():
    """Into an fp8 cache: qkv unscaled as the unfused steps give it, and at the slot exactly
    quantize() of the kernel's own rotated k and its v."""
    args, (q, k, v) = qkv_inputs("int4-g32", 16, seed=8)
    kv_heads, slot = args[5], 6
    cache = FP8LayerCache.empty((2, 5, 4, kv_heads, 16), torch.device("cpu"))
    cache.scales.copy_(scales_from_amax(torch.tensor([[0.5, 1.0], [0.25, 2.0]])))
    got = packed_row.norm_qkv_rope_store(*args, torch.tensor([slot]), cache.data[0],
                                         cache.data[1], config=SMALL_TILES,
                                         kv_scales=cache.scales).view(-1, 16)
    assert rel_err(got, torch.cat([q, k, v])) < FLOAT32_ERROR
    heads = args[4]
    got_k, got_v = got[heads:heads + kv_heads], got[heads + kv_heads:]
    stored = cache.data.view(torch.uint8).view(2, -1, kv_heads, 16)
    assert torch.equal(stored[0, slot], quantize(got_k, cache.scales[0]).view(torch.uint8))
    assert torch.equal(stored[1, slot], quantize(got_v, cache.scales[1]).view(torch.uint8))
    stored[:, slot] = 0
    assert not stored.any()


def test_groups_that_split_a_tile_unevenly_are_refused():
    layer, _ = packed_layer(16, 96, 4, 32)
    layer.group_size = 48  # as a 48-column group would be: runs of it do not tile 64 columns
    with pytest.raises(ValueError, match="group size 48 against K tiles of 64"):
        packed_row.gemv(torch.zeros(1, 96), layer, config=SMALL_TILES)


@pytest.mark.parametrize("scheme", [
    {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True},
    pytest.param({"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": False,
                  "sym": True}, marks=pytest.mark.slow),
], ids=["awq-int4", "gptq-int8-per-channel"])
def test_fused_packed_decoder_generates_what_the_unfused_one_does(
    checkpoints, tmp_path, monkeypatch, scheme
):
    """A tiny packed llama with DecoderLayer.forward_one_row on every one-row step, its
    projections through packed_row: the greedy tokens and logprobs of the unfused blocks. One
    decode step (about two seconds under the interpreter): it writes the cache and attends to
    what it wrote."""
    from noesis import LLM

    packed_dir, _ = write_quantized(checkpoints.path("llama"), tmp_path, scheme)
    prompt, new_tokens = [0, 5, 9, 77, 31], 2

    def run():
        llm = LLM(str(packed_dir), device="cpu", dtype="float32", progress=False)
        return llm, noesis_greedy(llm, prompt, new_tokens)

    monkeypatch.setattr(ops, "one_row_fusion", lambda x: x.shape[0] == 1)  # on the CPU too
    reference, (want_ids, want_lps) = run()
    # off by default: slower than the unfused packed GEMVs on an H100 (models.layers)
    assert reference.engine.runner.model.fuse_one_row is False
    monkeypatch.setattr(layers, "PACKED_ONE_ROW", True)
    # wide programs: the interpreter's cost is per program (QKV's shrink to a half head); the
    # LM head is row_gemv's
    monkeypatch.setattr(packed_row, "packed_row_config", lambda *a: (128, 512, 4, 1))
    monkeypatch.setitem(row_gemv.ROW_GEMV_CONFIGS, row_gemv.PLAIN, (512, 512, 8, 1))
    launches = []
    for name in ("gemv", "norm_glu", "norm_qkv_rope_store"):
        kernel = getattr(packed_row, name)
        monkeypatch.setattr(packed_row, name,
                            lambda *a, k=kernel, n=name, **kw: launches.append(n) or k(*a, **kw))
    llm, (ids, lps) = run()
    assert llm.engine.runner.model.fuse_one_row
    steps, num_layers = new_tokens - 1, 2
    assert (launches.count("norm_qkv_rope_store") == launches.count("norm_glu")
            == steps * num_layers)
    assert launches.count("gemv") == 2 * steps * num_layers  # o and down
    assert ids == want_ids
    assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < 1e-4


def test_act_order_keeps_the_unfused_blocks(checkpoints, tmp_path, monkeypatch):
    """GPTQ with act-order: known only once its g_idx is loaded, and the one-row kernels read
    groups in whole runs, so the first one-row step decides against the fused blocks."""
    from noesis import LLM

    scheme = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True,
              "sym": False}
    packed_dir, _ = write_quantized(checkpoints.path("llama"), tmp_path, scheme)
    llm = LLM(str(packed_dir), device="cpu", dtype="float32", progress=False)
    model = llm.engine.runner.model
    assert model.fuse_one_row is None  # not decided before a one-row step
    monkeypatch.setattr(layers, "PACKED_ONE_ROW", True)
    monkeypatch.setattr(ops, "one_row_fusion", lambda x: x.shape[0] == 1)
    noesis_greedy(llm, [0, 5], 2)
    assert model.fuse_one_row is False
