"""The fused MoE kernels on the lent GPU: equal to the PyTorch reference on the real gpt-oss-20b
(MXFP4) and Qwen3-30B-A3B expert shapes at decode and prefill sizes, and replayed from a CUDA
graph equal to eager. `pytest -m gpu tests/gpu/test_moe_triton_cuda.py`."""

from __future__ import annotations

import pytest
import torch

from noesis.kernels import moe, moe_triton
from noesis.weights.mxfp4 import Mxfp4Fragments, Mxfp4Weight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# name -> (experts, top_k, hidden, inner, mxfp4, gpt-oss's clamp limit, biases)
SHAPES = {
    "gpt-oss-20b": (32, 4, 2880, 2880, True, 7.0, True),
    "qwen3-30b-a3b": (128, 8, 2048, 768, False, None, False),
}


def _problem(name: str, tokens: int, dtype=torch.bfloat16):
    experts, top_k, hidden, inner, mxfp4, limit, biases = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(tokens)

    def weight(rows, cols, gate_up=False):  # MXFP4: as the load repacks it
        if not mxfp4:
            return torch.randn(experts, rows, cols, device="cuda", generator=gen).to(dtype) * 0.02
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8,
                               device="cuda", generator=gen)  # fmt: skip
        scales = torch.randint(119, 123, (experts, rows, cols // 32), dtype=torch.uint8,
                               device="cuda", generator=gen)  # fmt: skip
        return Mxfp4Fragments.pack(blocks, scales, gate_up=gate_up)

    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    weights, ids = moe.route(logits, top_k, "topk_softmax", False)
    bias = (lambda n: torch.randn(experts, n, device="cuda", generator=gen).to(dtype) * 0.1
            ) if biases else (lambda n: None)  # fmt: skip
    return (x, ids, weights, weight(2 * inner, hidden, gate_up=True), weight(hidden, inner),
            moe.Activation(limit), bias(2 * inner), bias(hidden))  # fmt: skip


def _reference(x, ids, weights, gate_up, down, activation, up_bias, down_bias):
    dense = [w.dequantize(x.dtype) if isinstance(w, Mxfp4Fragments) else w for w in (gate_up, down)]
    return moe.grouped(x, ids, weights, *dense, activation, up_bias, down_bias)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 3, 64, 300])
def test_fused_experts_match_the_reference(name, tokens):
    args = _problem(name, tokens)
    x, ids, weights, gate_up, down, activation, up_bias, down_bias = args
    ours = moe.experts(*args)
    ref = _reference(*args)
    err = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-2, (name, tokens, err)


@pytest.mark.parametrize("name", list(SHAPES))
def test_fused_experts_in_float32_match_closely(name):
    args = _problem(name, 64, torch.float32)
    ours, ref = moe.experts(*args), _reference(*args)
    assert torch.allclose(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 64])
def test_graph_replay_equals_eager(name, tokens):
    args = _problem(name, tokens)
    eager = moe.experts(*args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe.experts(*args)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe.experts(*args)
    x, ids = args[0], args[1]
    x.copy_(torch.randn_like(x))
    ids.copy_(torch.randint_like(ids, 0, SHAPES[name][0]))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, moe.experts(*args))
    assert not torch.equal(captured, eager)  # the replay read the new inputs


def test_layouts_switch_where_expected():
    assert moe_triton.uses_gemv(4, 32, 4) and moe_triton.uses_gemv(32, 128, 8)
    assert not moe_triton.uses_gemv(256, 32, 4)


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("tokens", [1, 64, 300])
def test_fused_routing_matches_torch(name, tokens):
    experts, top_k = SHAPES[name][:2]
    routing, renormalize = ("topk_softmax", False) if name == "gpt-oss-20b" else ("softmax_topk",
                                                                                True)  # fmt: skip
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    # distinct multiples of 1/16, exact in bf16: no ties for the two to break differently
    logits = torch.stack([torch.randperm(256, device="cuda", generator=gen)[:experts]
                          for _ in range(tokens)])  # fmt: skip
    logits = ((logits.float() - 128) / 16).to(torch.bfloat16)
    weights, ids = moe.route(logits, top_k, routing, renormalize)  # the fused kernel on CUDA
    want_weights, want_ids = moe.torch_route(logits, top_k, routing, renormalize)
    assert torch.equal(ids, want_ids)
    assert weights.dtype == want_weights.dtype
    torch.testing.assert_close(weights, want_weights, rtol=1e-2 if weights.dtype ==
                               torch.bfloat16 else 1e-5, atol=0)  # fmt: skip



@pytest.mark.parametrize("tokens", [1, 2, 64, 300])  # the GEMV layout, then the sorted one
def test_fragments_hold_the_stored_experts_and_replay(tokens):
    """gpt-oss-20b's experts as the checkpoint stores them, repacked: the fragments dequantize
    to the same values, and the experts over them equal dequantize-then-matmul, also from a
    graph replay."""
    experts, _, hidden, inner = SHAPES["gpt-oss-20b"][:4]
    gen = torch.Generator(device="cuda").manual_seed(11)
    blocks = torch.randint(0, 256, (experts, 2 * inner, hidden // 32, 16), dtype=torch.uint8,
                           device="cuda", generator=gen)  # fmt: skip
    scales = torch.randint(119, 123, blocks.shape[:3], dtype=torch.uint8, device="cuda",
                           generator=gen)  # fmt: skip
    stored = Mxfp4Weight(blocks, scales)
    packed = Mxfp4Fragments.pack(blocks, scales, gate_up=True)
    assert torch.equal(packed.dequantize(), stored.dequantize())
    x, ids, weights, _, down, activation, up_bias, down_bias = _problem("gpt-oss-20b", tokens)
    args = (x, ids, weights, packed, down, activation, up_bias, down_bias)
    ours = moe.experts(*args)
    ref = _reference(*args)
    err = ((ours.float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 1e-2, err
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe.experts(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, ours)
