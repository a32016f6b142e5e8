"""The MoE, Gemma and LFM2 families on the lent GPU: the paged decode kernel's sinks and
soft-capping compiled, and greedy parity of each tiny family on CUDA (fp32, CUDA graphs on, so the
capture paths of the experts and of the conv state run) against transformers on the CPU (eager
attention where SDPA would drop Gemma 2's soft-capping: `checkpoints.load_reference`); then a
timing of the gpt-oss-20b and Qwen3-30B-A3B layer shapes (4 layers, random weights) at batch 1
and 64 against transformers.
`pytest -m gpu tests/gpu/test_families_cuda.py -s`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checkpoints import (  # noqa: E402
    SPECS,
    assert_same_half_precision_greedy,
    build_checkpoint,
    hf_generate,
    load_reference,
)

FAMILIES = ["qwen3-moe", "mixtral", "gpt-oss", "gemma2", "gemma3", "lfm2"]
PROMPTS = [[0, 5, 9, 77, 100, 21], list(range(30, 50))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "extras", [{"sinks": True}, {"softcap": 30.0}, {"sinks": True, "softcap": 30.0}]
)
@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("split_grid", [None, 1], ids=["grid", "capped-grid"])
def test_paged_decode_extras_compiled(dtype, extras, batch, split_grid, monkeypatch):
    """capped-grid: eight programs per (sequence, KV head), each looping over every eighth
    split (batch 1's 64-token splits of 999 tokens: 16)."""
    from noesis.kernels import paged_decode
    from noesis.runner.attention import TorchPagedAttention
    from noesis.runner.inputs import AttentionMetadata

    if split_grid is not None:
        monkeypatch.setattr(paged_decode, "SPLIT_GRID", split_grid)
    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, page = 64, 8, 64, 16
    lens = torch.randint(1, 700, (batch,), generator=gen) + (600 if split_grid else 0)
    pages = -(-lens.max().item() // page)
    kv = torch.randn(2, batch * pages + 1, page, kv_heads, dim, generator=gen)
    tables = torch.arange(1, batch * pages + 1).view(batch, pages)
    q = torch.randn(batch, heads, dim, generator=gen)
    sinks = torch.randn(heads, generator=gen) if extras.get("sinks") else None
    kwargs = {"sinks": sinks, "softcap": extras.get("softcap")}
    meta = AttentionMetadata(
        page,
        torch.empty(0, dtype=torch.long),
        [],
        torch.arange(batch),
        tables,
        lens,
        int(lens.max()),
    )
    expected = TorchPagedAttention().decode(q, kv, meta, dim**-0.5, 128, **kwargs)
    cuda = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    kv_gpu = kv.to("cuda", dtype)
    out = paged_decode.paged_decode_attention(
        q.to("cuda", dtype),
        kv_gpu[0],
        kv_gpu[1],
        tables.cuda(),
        lens.cuda(),
        dim**-0.5,
        int(lens.max()),
        128,
        **cuda,
    )
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(out.float().cpu(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("name", FAMILIES)
def test_family_greedy_on_cuda_matches_transformers(tmp_path, name):
    from noesis import LLM, SamplingParams

    spec = SPECS[name]
    path = build_checkpoint(tmp_path / name, spec.family, **spec.config)
    llm = LLM(str(path), device="cuda", dtype="float32", progress=False, max_num_seqs=8)
    assert llm.engine.runner.graphs is not None
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    ref = load_reference(path)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        tokens, rows = hf_generate(ref, prompt, 32)
        assert out.token_ids == tokens
        worst = max(
            abs(row[t] - rows[i, t].item())
            for i, (row, t) in enumerate(zip(out.logprobs, tokens, strict=True))
        )
        assert worst < 1e-3, worst


# Families whose blocks joined the fused one-row path: q/k/v biases (qwen2), per-head q/k
# norms at a real head size (qwen3), routed experts (qwen3-moe), sinks, biases and MXFP4-free
# experts (gpt-oss).
ONE_ROW = {
    "qwen2-tied": {},
    "qwen3": {"head_dim": 128},
    "qwen3-moe": {},
    "gpt-oss": {},
}


@pytest.mark.parametrize("name", list(ONE_ROW))
def test_one_row_blocks_of_more_families_match_the_unfused_ones(tmp_path, monkeypatch, name):
    """Batch-1 bf16 decode with graphs through DecoderLayer.forward_one_row against the unfused
    blocks: same greedy tokens while the top two are apart, logprobs within bf16 rounding."""
    from noesis import LLM, SamplingParams
    from noesis.kernels import ops

    spec = SPECS[name]
    path = build_checkpoint(tmp_path / name, spec.family, **{**spec.config, **ONE_ROW[name]})
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)

    def run(fused):  # the engine sets ops.ONE_ROW_FUSION from its option
        llm = LLM(str(path), device="cuda", dtype="bfloat16", progress=False, max_num_seqs=8,
                  one_row_fusion=fused)  # fmt: skip
        return llm, llm.generate([PROMPTS[1]], params)[0]

    _, want = run(False)
    assert not ops.ONE_ROW_FUSION
    launches = []
    fused_qkv = ops.norm_qkv_rope_store  # with q/k norms: a projection, then the RoPE kernel
    monkeypatch.setattr(ops, "norm_qkv_rope_store",
                        lambda *a, **k: launches.append(1) or fused_qkv(*a, **k))  # fmt: skip
    llm, got = run(True)
    assert llm.engine.runner.model.fuse_one_row and launches, "the fused path did not run"
    assert_same_half_precision_greedy(got, want)


SHAPES = {  # the real models' layer shapes, 4 layers, small vocabulary
    "gpt-oss-20b": (
        "gpt_oss",
        dict(
            hidden_size=2880,
            intermediate_size=2880,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            layer_types=["sliding_attention", "full_attention"] * 2,
        ),
    ),
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
        ),
    ),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_moe_decode_speed(tmp_path, shape):
    """Prints decode ms/step for noesis and transformers (bf16, same weights). No assertion on
    speed: the fused grouped-GEMM kernel is still to come; this is the baseline."""
    from noesis import LLM, SamplingParams

    family, config = SHAPES[shape]
    path = build_checkpoint(
        tmp_path / shape,
        family,
        dtype=torch.bfloat16,
        std=0.02,
        num_hidden_layers=4,
        vocab_size=4096,
        max_position_embeddings=4096,
        **config,
    )
    llm = LLM(str(path), device="cuda", dtype="bfloat16", progress=False, max_num_seqs=64)
    ref = load_reference(path, torch.bfloat16).cuda()
    for batch in (1, 64):
        prompts = [[1 + i, 2, 3, 4] for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        llm.generate(prompts, params)  # warm-up
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompts, params)
        ours = (time.perf_counter() - start) / 64 * 1e3
        ids = torch.tensor(prompts, device="cuda")
        ref.generation_config.eos_token_id = None
        with torch.no_grad():
            ref.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            start = time.perf_counter()
            ref.generate(ids, max_new_tokens=64, do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
        theirs = (time.perf_counter() - start) / 64 * 1e3
        print(
            f"{shape} batch {batch}: noesis {ours:.2f} ms/step, transformers {theirs:.2f} "
            f"ms/step ({theirs / ours:.2f}x)"
        )
