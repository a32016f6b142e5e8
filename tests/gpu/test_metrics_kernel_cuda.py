"""The per-token metrics kernel on CUDA: the 8B vocabulary against the PyTorch reference, and a
captured CUDA graph that replays onto new logits exactly as an eager call. `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

VOCAB = 128256  # the Llama 3 8B vocabulary


def _logits(batch: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(batch, VOCAB, device="cuda", generator=gen) * 3
    logits[0, 1000:] = float("-inf")  # a grammar mask
    logits[1, [7, 90000]] = 25.0  # the best two tie, in blocks far apart
    return logits


def test_kernel_matches_the_reference_on_the_8b_vocabulary():
    from noesis.sampling.metrics import reference_metrics, token_metrics

    logits = _logits(64, 0)
    assert torch.allclose(token_metrics(logits), reference_metrics(logits), rtol=1e-4, atol=1e-5)


def test_graph_replay_equals_eager():
    from noesis.sampling.metrics import token_metrics

    static = _logits(8, 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile off the capture
        token_metrics(static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = token_metrics(static)
    fresh = _logits(8, 2)
    static.copy_(fresh)
    graph.replay()
    assert torch.equal(captured, token_metrics(fresh))
