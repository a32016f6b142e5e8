"""The fused MoE kernels (kernels/moe_triton.py) interpreted on the CPU against the PyTorch
gather/scatter path: both layouts of the pairs, bf16-shaped and MXFP4 weights, top-k 2 and 4,
biases and gpt-oss's clamped activation. float32 throughout where tl.dot runs (the interpreter's
bf16 tl.dot is wrong); bf16 on the GEMV layout. Real shapes and graphs: tests/gpu."""

from __future__ import annotations

import pytest
import torch

from noesis.kernels import moe, moe_triton  # noqa: E402
from noesis.weights.mxfp4 import Mxfp4Fragments, Mxfp4Weight  # noqa: E402

EXPERTS, HIDDEN, INNER = 8, 32, 32


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    """Tiles the size of the problem: the interpreter's cost is the elements it touches."""
    tiles = (moe_triton.Tiles(16, 64, 4), moe_triton.Tiles(32, 32, 4))
    monkeypatch.setattr(moe_triton, "GEMV_TILES", tiles)
    monkeypatch.setattr(moe_triton, "FRAG_SORTED_TILES", (2, 2))
    monkeypatch.setattr(moe_triton, "SORTED", moe_triton.Tiles(16, 32, 4))


def _problem(tokens, top_k, mxfp4, biases, dtype=torch.float32):
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)

    def weight(rows, cols, gate_up=False):  # MXFP4: as the CUDA load repacks it
        if mxfp4:
            blocks = torch.randint(0, 256, (EXPERTS, rows, cols // 32, 16), dtype=torch.uint8,
                                   generator=gen)  # fmt: skip
            scales = torch.randint(120, 125, (EXPERTS, rows, cols // 32), dtype=torch.uint8,
                                   generator=gen)  # fmt: skip
            return Mxfp4Fragments.pack(blocks, scales, gate_up=gate_up)
        return (torch.randn(EXPERTS, rows, cols, generator=gen) * 0.2).to(dtype)

    x = torch.randn(tokens, HIDDEN, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
    up_bias = torch.randn(EXPERTS, 2 * INNER, generator=gen).to(dtype) if biases else None
    down_bias = torch.randn(EXPERTS, HIDDEN, generator=gen).to(dtype) if biases else None
    gate_up, down = weight(2 * INNER, HIDDEN, gate_up=True), weight(HIDDEN, INNER)
    return x, ids, weights, gate_up, down, up_bias, down_bias


def _compare(tokens, top_k, mxfp4, biases, limit, dtype=torch.float32, tol=1e-5):
    x, ids, weights, gate_up, down, up_bias, down_bias = _problem(tokens, top_k, mxfp4, biases,
                                                                  dtype)  # fmt: skip
    activation = moe.Activation(limit)
    dense = [w.dequantize(dtype) if mxfp4 else w for w in (gate_up, down)]
    ref = moe.gathered(x, ids, weights, *dense, activation, up_bias, down_bias)
    ours = moe_triton.experts(x, ids, weights, gate_up, down, limit, activation.alpha, up_bias,
                              down_bias)  # fmt: skip
    assert ours.dtype == x.dtype and ours.shape == x.shape
    scale = ref.abs().max().item()
    assert torch.allclose(ours.float(), ref.float(), rtol=tol, atol=tol * scale), (
        (ours.float() - ref.float()).abs().max().item(),
        scale,
    )


@pytest.mark.parametrize(
    "tokens, top_k, mxfp4, biases, limit, gemv",
    [
        (1, 2, False, False, None, True),  # Qwen3 / Mixtral style
        (1, 4, True, True, 7.0, True),  # gpt-oss
        (2, 1, True, False, None, True),  # MXFP4 with SiLU-GLU, two tokens
        (3, 2, False, True, 7.0, False),
        (5, 4, True, True, 7.0, False),  # gpt-oss; experts repeat and pad their blocks
    ],
)
def test_fused_experts_equal_the_gather_path(tokens, top_k, mxfp4, biases, limit, gemv):
    assert moe_triton.uses_gemv(tokens * top_k, EXPERTS, top_k) == gemv
    _compare(tokens, top_k, mxfp4, biases, limit)


@pytest.mark.parametrize("tokens", [1, 5])  # both layouts end in the slot sum
def test_the_residual_is_added_after_the_experts_output_is_rounded(tokens):
    x, ids, weights, gate_up, down, up_bias, down_bias = _problem(tokens, 2, False, True,
                                                                  torch.float16)  # fmt: skip
    residual = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(x.dtype)
    args = (x, ids, weights, gate_up, down, None, 1.702, up_bias, down_bias)
    alone = moe_triton.experts(*args)
    assert torch.equal(moe_triton.experts(*args, residual), alone + residual)
    with pytest.raises(ValueError, match="residual"):
        moe_triton.experts(*args, residual[:, :8])


def test_bf16_gemv_rounds_where_the_reference_does():
    _compare(1, 4, True, True, 7.0, torch.bfloat16, tol=2e-2)


def test_align_by_expert_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([3, 1, 3, 3, 0, 1, 3])  # pairs 0..6
    rows, experts = moe_triton.align_by_expert(ids, num_experts=5, block_m=2)
    # expert 0: pair 4 + pad; expert 1: pairs 1, 5; expert 3: pairs 0, 2 | 3, 6; then unused
    assert rows.tolist()[:10] == [4, 7, 1, 5, 0, 2, 3, 6, 7, 7]
    assert experts.tolist() == [0, 1, 3, 3] + [-1] * (len(experts) - 4)
    assert len(experts) == 4 + 5  # ceil(7 / 2) + min(E, P): enough for any routing


def test_bad_shapes_are_named():
    x, ids, weights, gate_up, down, _, _ = _problem(1, 2, False, False)
    with pytest.raises(ValueError, match="down"):
        moe_triton.experts(x, ids, weights, gate_up, down[:, :, :16], None, 1.702)
    with pytest.raises(ValueError, match="ids"):
        moe_triton.experts(x, ids[:, :1], weights, gate_up, down, None, 1.702)


def test_packed_experts_refuse_the_cpu_path():
    x, ids, weights, gate_up, down, _, _ = _problem(1, 2, True, False)
    with pytest.raises(ValueError, match="CUDA only"):
        moe.experts(x, ids, weights, gate_up, down, moe.Activation())


def test_stored_mxfp4_must_be_repacked_for_the_kernels():
    x, ids, weights, _, down, _, _ = _problem(1, 2, True, False)
    blocks = torch.zeros(EXPERTS, 2 * INNER, HIDDEN // 32, 16, dtype=torch.uint8)
    stored = Mxfp4Weight(blocks, torch.full(blocks.shape[:3], 127, dtype=torch.uint8))
    with pytest.raises(TypeError, match="Mxfp4Fragments.pack"):
        moe_triton.experts(x, ids, weights, stored, down, None, 1.702)


def test_mxfp4_experts_load_packed_and_info_prices_them(checkpoints, tmp_path):
    """What a CUDA load does, on the CPU: packed parameters filled straight from the checkpoint
    (gate / up de-interleaved) dequantize to what the default load holds; `noesis info` prices
    the packed experts."""
    from test_families_moe import _mxfp4_checkpoints

    from noesis.engine.loading import describe_checkpoint, load_model
    from noesis.models.moe import Experts
    from noesis.weights import mxfp4
    from noesis.weights.loader import load_weights

    packed_dir, _ = _mxfp4_checkpoints(checkpoints, tmp_path)
    loaded = load_model(packed_dir, device="cpu", dtype="float32", progress=False)
    with torch.device("meta"):
        model = type(loaded.model)(loaded.config)
    assert mxfp4.pack_experts(model) > 0
    model = model.to_empty(device="cpu")
    load_weights(model, loaded.config, packed_dir, progress=False)
    pairs = [(m, n) for m, n in zip(model.modules(), loaded.model.modules(), strict=True)
             if isinstance(m, Experts)]  # fmt: skip
    for ours, default in pairs:
        assert ours.gate_up_proj_blocks.dtype == torch.uint8
        for name in ("gate_up_proj", "down_proj"):
            assert torch.equal(ours._projection(name).dequantize(), getattr(default, name))
    assert mxfp4.fragment_experts(model) == len(pairs)  # what the CUDA load does next
    assert mxfp4.fragment_experts(model) == 0  # once
    for ours, default in pairs:
        assert not hasattr(ours, "gate_up_proj_blocks")
        for name in ("gate_up_proj", "down_proj"):
            assert isinstance(ours._projection(name), Mxfp4Fragments)
            assert torch.equal(ours._projection(name).dequantize(), getattr(default, name))
    info = describe_checkpoint(packed_dir)
    assert "dequantized" in info["weights in memory"] and "packed" in info["mxfp4 experts"]


@pytest.mark.parametrize(
    "experts, top_k, routing, renormalize, dtype",
    [
        (8, 2, "softmax_topk", True, torch.float32),  # Mixtral
        (128, 8, "softmax_topk", True, torch.bfloat16),  # Qwen3-MoE
        (60, 4, "softmax_topk", False, torch.float32),  # not a power of two, not renormalized
        (32, 4, "topk_softmax", False, torch.bfloat16),  # gpt-oss
        (32, 3, "topk_softmax", False, torch.float32),
        (256, 8, "softmax_topk", True, torch.float32),  # DeepSeek-V3's 256
        (160, 4, "topk_softmax", False, torch.bfloat16),
    ],
)
def test_fused_routing_equals_torch(experts, top_k, routing, renormalize, dtype):
    gen = torch.Generator().manual_seed(experts + top_k)
    # distinct multiples of 1/16 in [-8, 8), exact in bf16 (no ties to break); in float32 one
    # token far below zero, where an unshifted softmax over the top k would underflow
    logits = torch.stack([torch.randperm(256, generator=gen)[:experts] for _ in range(5)])
    logits = (logits.float() - 128) / 16
    if dtype == torch.float32:
        logits[4] -= 300
    logits = logits.to(dtype)
    want_weights, want_ids = moe.torch_route(logits.float(), top_k, routing, renormalize)
    weights, ids = moe_triton.route(logits, top_k, routing, renormalize)
    assert weights.dtype == (torch.float32 if routing == "softmax_topk" else dtype)
    assert ids.dtype == torch.int64 and torch.equal(ids, want_ids)
    # float32 arithmetic rounded once to the weights' dtype (within one bf16 step: Triton's
    # interpreter truncates where the GPU rounds to nearest)
    tol = 1e-5 if weights.dtype == torch.float32 else 2**-7
    assert torch.allclose(weights.float(), want_weights, rtol=tol, atol=0), (weights, want_weights)
    if routing == "softmax_topk":  # renormalizing changes the weights
        other, _ = moe_triton.route(logits, top_k, routing, not renormalize)
        assert not torch.allclose(other, weights)


@pytest.mark.parametrize("experts", [8, 200])
def test_fused_routing_takes_the_lowest_expert_of_equal_logits(experts):
    logits = torch.full((1, experts), -5.0)
    logits[0, :8] = torch.tensor([0.5, 2.0, 1.0, 2.0, 2.0, -1.0, 0.0, 2.0])
    _, ids = moe_triton.route(logits, 3, "softmax_topk", True)
    assert ids.tolist() == [[1, 3, 4]]
