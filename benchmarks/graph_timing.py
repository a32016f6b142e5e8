"""GPU time of a call measured inside a CUDA graph, as the engine's decode step runs it: timed
back to back from Python instead, a Triton launch costs tens of microseconds and hides kernels
that take a few."""

from __future__ import annotations

import torch


def graph_us(fn, reps: int = 20) -> float:
    """Microseconds per call of `fn`, from a graph of `reps` calls replayed five times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (5 * reps)
