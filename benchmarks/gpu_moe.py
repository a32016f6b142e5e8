"""The fused MoE experts (issue 17) against transformers' MoE blocks on the same random weights:
gpt-oss-20b (MXFP4 experts, kept packed by noesis, dequantized to bf16 for transformers) and
Qwen3-30B-A3B (bf16) layer slices, router plus experts, at batch 1 and 64 (one decode step).

noesis runs the slice as one CUDA graph; transformers runs eagerly with its default experts
implementation (grouped_mm where it dispatches). The roofline is the bytes of the experts the
step actually reads (the distinct routed experts of each layer: weights, MXFP4 scales, biases)
over the copy bandwidth measured in the same run (a 1 GiB device copy, bytes read + written).

    python benchmarks/gpu_moe.py                  # the lent GPU
    python benchmarks/gpu_moe.py --smoke          # CPU, TRITON_INTERPRET=1, tiny shapes
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Shape:
    family: str
    experts: int
    top_k: int
    hidden: int
    inner: int
    mxfp4: bool


SHAPES = {
    "gpt-oss-20b": Shape("gpt_oss", 32, 4, 2880, 2880, True),
    "qwen3-30b-a3b": Shape("qwen3_moe", 128, 8, 2048, 768, False),
}
SMOKE = {name: replace(s, hidden=64, inner=64, experts=8) for name, s in SHAPES.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreted, tiny shapes")
    parser.add_argument("--layers", type=int, default=8, help="distinct MoE layers per step")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        args.layers, args.batches, args.iters = 1, [1, 4], 1
    device = "cpu" if args.smoke else "cuda"
    bandwidth = copy_bandwidth(device, 1 << 20 if args.smoke else 1 << 30)
    print(f"device {_device_name(device)}; copy bandwidth {bandwidth / 1e9:.0f} GB/s")
    print(
        "| shape | batch | noesis ms/step | transformers ms/step | speed-up | expert MB read "
        "| roofline ms | share of roofline | max rel. diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, shape in (SMOKE if args.smoke else SHAPES).items():
        for row in bench_shape(shape, args.layers, args.batches, args.iters, device, bandwidth):
            print(f"| {name} ({args.layers} MoE layers) | " + " | ".join(row) + " |")


def bench_shape(shape: Shape, layers: int, batches, iters: int, device: str, bandwidth: float):
    torch.manual_seed(0)
    ours, theirs = zip(*(build_layer(shape, device) for _ in range(layers)), strict=True)
    for batch in batches:
        x = torch.randn(batch, shape.hidden, device=device, dtype=_dtype(device))
        with torch.no_grad():
            diff = max(_rel_diff(_forward(o, x), _hf_forward(t, x))
                       for o, t in zip(ours, theirs, strict=True))  # fmt: skip
        ours_ms = time_ms(lambda x=x: [_forward(block, x) for block in ours], iters, device,
                          graph=True)  # fmt: skip
        theirs_ms = time_ms(lambda x=x: [_hf_forward(block, x) for block in theirs], iters, device)
        read = sum(expert_bytes_read(block, x) for block in ours)
        roofline_ms = read / bandwidth * 1e3
        yield [str(batch), f"{ours_ms:.3f}", f"{theirs_ms:.3f}", f"{theirs_ms / ours_ms:.2f}x",
               f"{read / 1e6:.1f}", f"{roofline_ms:.3f}", f"{roofline_ms / ours_ms:.0%}",
               f"{diff:.1e}"]  # fmt: skip


def build_layer(shape: Shape, device: str):
    """(noesis SparseMoeBlock, transformers' MoE block) of one layer, the same random weights."""
    import transformers

    from noesis.models.config import ModelConfig
    from noesis.models.moe import SparseMoeBlock

    hf_config = _hf_config(shape)
    config = ModelConfig.from_hf(hf_config.to_dict())
    ours = SparseMoeBlock(config)
    if shape.mxfp4:
        ours.experts.keep_mxfp4_packed()
    ours = ours.to(dtype=_dtype(device)).to_empty(device=device)
    _fill(ours, shape)
    if shape.family == "gpt_oss":
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as HfBlock
    else:
        from transformers.models.qwen3_moe.modeling_qwen3_moe import (
            Qwen3MoeSparseMoeBlock as HfBlock,
        )
    theirs = HfBlock(hf_config).to(device=device, dtype=_dtype(device))
    _copy_to_hf(ours, theirs, shape, device)
    if shape.mxfp4 and device == "cuda":
        ours.experts.use_fragments()  # as a CUDA load repacks them
    del transformers
    return ours.eval(), theirs.eval()


def _hf_config(shape: Shape):
    import transformers

    common = dict(hidden_size=shape.hidden, num_hidden_layers=1, vocab_size=256,
                  num_experts_per_tok=shape.top_k, num_attention_heads=8,
                  num_key_value_heads=8)  # fmt: skip
    if shape.family == "gpt_oss":
        config = transformers.GptOssConfig(intermediate_size=shape.inner, head_dim=64,
                                           num_local_experts=shape.experts, **common)  # fmt: skip
    else:
        config = transformers.Qwen3MoeConfig(
            moe_intermediate_size=shape.inner, num_experts=shape.experts, norm_topk_prob=True,
            intermediate_size=4 * shape.inner, **common)  # fmt: skip
    config._experts_implementation = "grouped_mm" if torch.cuda.is_available() else "eager"
    return config


def _fill(block, shape: Shape) -> None:
    """Random weights at decode-realistic scales; MXFP4 codes uniform, exponents near 2^-5."""
    with torch.no_grad():
        for name, param in block.named_parameters():
            if param.dtype == torch.uint8:
                low, high = (0, 256) if name.endswith("_blocks") else (119, 123)
                param.copy_(torch.randint(low, high, param.shape, dtype=torch.uint8))
            else:
                param.normal_(0, 0.02)


def _copy_to_hf(ours, theirs, shape: Shape, device: str) -> None:
    experts = ours.experts
    gate_up, down = (experts._projection(n) for n in ("gate_up_proj", "down_proj"))
    if shape.mxfp4:
        gate_up, down = gate_up.dequantize(_dtype(device)), down.dequantize(_dtype(device))
    with torch.no_grad():
        if shape.family == "gpt_oss":  # [E, in, out], gate and up interleaved
            inner = shape.inner
            theirs.router.weight.copy_(ours.router.weight)
            theirs.router.bias.copy_(ours.router.bias)
            fused = theirs.experts.gate_up_proj
            fused[:, :, 0::2].copy_(gate_up[:, :inner].transpose(1, 2))
            fused[:, :, 1::2].copy_(gate_up[:, inner:].transpose(1, 2))
            theirs.experts.gate_up_proj_bias[:, 0::2].copy_(experts.gate_up_proj_bias[:, :inner])
            theirs.experts.gate_up_proj_bias[:, 1::2].copy_(experts.gate_up_proj_bias[:, inner:])
            theirs.experts.down_proj.copy_(down.transpose(1, 2))
            theirs.experts.down_proj_bias.copy_(experts.down_proj_bias)
        else:
            theirs.gate.weight.copy_(ours.router.weight)
            theirs.experts.gate_up_proj.copy_(gate_up)
            theirs.experts.down_proj.copy_(down)


def expert_bytes_read(block, x: torch.Tensor) -> int:
    """Bytes of the distinct experts `block` routes x's tokens to: weights (packed or not),
    scales and biases of those experts."""
    from noesis.kernels import moe as moe_ops

    _, ids = moe_ops.route(block.router(x), block.top_k, block.routing, block.renormalize)
    tensors = [*block.experts.parameters(), *block.experts.buffers()]  # buffers: MXFP4 fragments
    per_expert = sum(p[0].nbytes for p in tensors)
    return int(ids.unique().numel()) * per_expert


def time_ms(step, iters: int, device: str, graph: bool = False) -> float:
    """Milliseconds per call of `step`, after a warm-up; replayed from one CUDA graph if asked."""
    with torch.no_grad():
        step()
        if device != "cuda":
            start = time.perf_counter()
            for _ in range(iters):
                step()
            return (time.perf_counter() - start) / iters * 1e3
        if graph:
            captured = torch.cuda.CUDAGraph()
            with torch.cuda.graph(captured):
                step()
            step = captured.replay
        step()
        torch.cuda.synchronize()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(iters):
            step()
        end.record()
        torch.cuda.synchronize()
        return begin.elapsed_time(end) / iters


def copy_bandwidth(device: str, num_bytes: int) -> float:
    """Bytes per second a device copy moves (read + written)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), 20, device)
    return 2 * num_bytes / (ms / 1e3)


def _rel_diff(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.float() - theirs.float()).norm() / theirs.float().norm()).item()


def _forward(block, x: torch.Tensor) -> torch.Tensor:
    """noesis's SparseMoeBlock forward with the experts in the fused kernels on any device (on
    CUDA it is what the block runs; --smoke interprets the kernels on the CPU)."""
    from noesis.kernels import moe as moe_ops
    from noesis.kernels import moe_triton

    weights, ids = moe_ops.route(block.router(x), block.top_k, block.routing, block.renormalize)
    experts = block.experts
    projections = (experts._projection("gate_up_proj"), experts._projection("down_proj"))
    return moe_triton.experts(x, ids, weights, *projections, experts.activation.limit,
                              experts.activation.alpha, experts.gate_up_proj_bias,
                              experts.down_proj_bias)  # fmt: skip


def _hf_forward(block, x: torch.Tensor) -> torch.Tensor:
    out = block(x[:, None])  # [T, 1, H]; gpt-oss's block also returns its router scores
    return (out[0] if isinstance(out, tuple) else out)[:, 0]


def _dtype(device: str) -> torch.dtype:
    """bf16 on the GPU; float32 in --smoke (the Triton interpreter's bf16 tl.dot is wrong)."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


if __name__ == "__main__":
    sys.exit(main())
