"""Quantization on the lent GPU: the packed int4/int8 Triton kernel compiled against
dequantize-then-matmul at decode and prefill shapes (bf16, which Triton's interpreter cannot
check), a tiny AWQ model's greedy tokens with and without CUDA graphs, and the fp8 KV cache's
kernels and engine. `pytest -m gpu tests/gpu/test_quant_cuda.py`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoints import build_checkpoint, noesis_greedy  # noqa: E402

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
PROMPTS = [[0, 5, 9, 77, 100, 21], [0, 3] * 20, list(range(2, 90)), [0, 44, 45]]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def packed_weight(n, k, bits, group, act_order, gen):
    """(qweight, scales, zeros, g_idx or None) with random codes, bf16 scales and zero points."""
    from noesis.quant.packing import pack

    groups = k // group
    codes = torch.randint(0, 1 << bits, (n, k), device="cuda", generator=gen)
    zeros = torch.randint(0, 1 << bits, (n, groups), device="cuda", generator=gen)
    scales = torch.rand(n, groups, device="cuda", generator=gen) * 0.02 + 0.001
    g_idx = None
    if act_order:
        order = torch.randperm(k, device="cuda", generator=gen)
        g_idx = (torch.argsort(order) // group).to(torch.int32)
    return pack(codes, bits), scales.bfloat16(), zeros.bfloat16(), g_idx


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 300], ids=lambda m: f"M{m}")
@pytest.mark.parametrize(
    ("n", "k", "bits", "group", "act_order"),
    [
        (384, 512, 4, 128, False),  # AWQ int4, group 128
        (4096, 4096, 4, 128, False),  # the 8B o_proj shape: many K splits at decode
        (256, 1024, 8, 1024, False),  # int8 per channel
        (256, 512, 4, 64, True),  # GPTQ act-order: groups looked up per column
    ],
    ids=["int4-g128", "int4-8b-o", "int8-channel", "gptq-act-order"],
)
def test_packed_kernel_matches_dequantized_matmul_compiled(rows, n, k, bits, group, act_order):
    from noesis.quant import kernel
    from noesis.quant.linear import dequantized_matmul

    gen = torch.Generator(device="cuda").manual_seed(rows + n + bits)
    qweight, scales, zeros, g_idx = packed_weight(n, k, bits, group, act_order, gen)
    x = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    out = kernel.packed_matmul(x, qweight, scales, zeros, g_idx, bits, group)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # float32 throughout: the kernel rounds each dequantized weight to bf16 once (~2^-9)
    want = dequantized_matmul(x.float(), qweight, scales.float(), zeros.float(), g_idx, bits,
                              group)
    assert rel_err(out, want) < 1e-2
    # the portable path in bf16 rounds the same weights the same way
    portable = dequantized_matmul(x, qweight, scales, zeros, g_idx, bits, group)
    assert rel_err(out, portable) < 5e-3


def test_packed_kernel_replays_in_a_graph():
    from noesis.quant import kernel

    gen = torch.Generator(device="cuda").manual_seed(5)
    args = (*packed_weight(1024, 2048, 4, 128, False, gen), 4, 128)
    x = torch.randn(1, 2048, device="cuda", generator=gen).bfloat16()
    eager = kernel.packed_matmul(x, *args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernel.packed_matmul(x, *args)
    x.copy_(torch.randn(1, 2048, device="cuda", generator=gen))
    graph.replay()
    assert not torch.equal(captured, eager) and torch.equal(captured,
                                                            kernel.packed_matmul(x, *args))


@pytest.fixture(scope="module")
def awq_checkpoint(tmp_path_factory):
    """A tiny bf16 Llama quantized to AWQ int4 (group 128) by `noesis quantize`."""
    from noesis.quant.quantize import quantize_checkpoint

    root = tmp_path_factory.mktemp("quant-gpu")
    source = build_checkpoint(root / "float", "llama", std=0.1, dtype=torch.bfloat16,
                              hidden_size=256, intermediate_size=512, num_attention_heads=8,
                              num_key_value_heads=2, num_hidden_layers=3)
    quantize_checkpoint(source, root / "awq", bits=4, progress=False)
    return root / "awq"


def test_awq_model_greedy_equal_with_and_without_graphs(awq_checkpoint):
    from noesis import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = {}
    for graphs in (True, False):
        llm = LLM(str(awq_checkpoint), device="cuda", dtype="bfloat16", progress=False,
                  cuda_graphs=graphs)
        proj = llm.engine.loaded.model.model.layers[0].mlp.gate_up_proj
        assert type(proj).__name__ == "PackedLinear"
        runs[graphs] = [o.token_ids for o in llm.generate(PROMPTS, params)]
        assert (llm.engine.runner.step_counts["graph"] > 0) == graphs
        del llm
    assert runs[True] == runs[False]


# ---- fp8 KV ------------------------------------------------------------------------------------


def test_fp8_decode_kernel_matches_dequantized_reference_compiled():
    from noesis.kernels import paged_decode
    from noesis.kv.fp8 import FP8, FP8LayerCache, scales_from_amax
    from noesis.runner.fp8_attention import FP8TorchAttention
    from noesis.runner.inputs import AttentionMetadata

    gen = torch.Generator(device="cuda").manual_seed(0)
    ctx = torch.tensor([1, 17, 300, 1030, 8200], device="cuda")
    pages = [-(-int(n) // 16) for n in ctx]
    values = torch.randn(2, sum(pages) + 1, 16, 8, 128, device="cuda", generator=gen) * 3
    scales = scales_from_amax(values.abs().amax((1, 2, 4)))
    cache = FP8LayerCache((values / scales[:, None, None]).to(FP8), scales)
    perm = torch.randperm(sum(pages), device="cuda", generator=gen).tolist()
    tables, start = [], 0
    for n in pages:
        tables.append(perm[start : start + n] + [0] * (max(pages) - n))
        start += n
    tables = torch.tensor(tables, device="cuda")
    q = torch.randn(len(pages), 32, 128, device="cuda", generator=gen).bfloat16()
    meta = AttentionMetadata(16, ctx[:0], [], torch.arange(len(pages), device="cuda"), tables,
                             ctx, int(ctx.max()))
    want = FP8TorchAttention(torch.float32).decode(q.float(), cache, meta, 128**-0.5, None)
    for fused in (False, True):  # the splits merged by a second kernel, or in the same launch
        got = paged_decode.paged_decode_attention(
            q, cache.data[0], cache.data[1], tables, ctx, 128**-0.5, 8704,
            tuning={"fused_reduce": fused}, kv_scales=cache.scales)
        assert rel_err(got, want) < 2e-2


@pytest.mark.skipif(not BUNDLED.is_dir(), reason="models/noesis-tiny not present")
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_fp8_kv_greedy_tokens_equal_bf16_kv(graphs):
    from noesis import LLM

    options = dict(device="cuda", dtype="bfloat16", progress=False, cuda_graphs=graphs,
                   max_model_len=1024, max_num_batched_tokens=16)
    reference = LLM(str(BUNDLED), **options)
    prompt = reference.engine.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France? Tell me about the weather "
                                     "in Paris."}])
    want_ids, want_lps = noesis_greedy(reference, prompt, 40)
    del reference
    fp8 = LLM(str(BUNDLED), kv_cache_dtype="fp8", **options)
    assert fp8.engine.runner.attention.name == "triton-paged-fp8"
    ids, lps = noesis_greedy(fp8, prompt, 40)
    assert ids == want_ids
    assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < 0.05
    assert (fp8.engine.runner.step_counts["graph"] > 0) == graphs
