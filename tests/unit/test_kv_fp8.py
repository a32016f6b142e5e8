"""fp8 (e4m3) KV cache: greedy tokens of the bundled model with fp8 KV equal those with float32
KV, half of bf16's bytes per page, and the Triton write and decode kernels (Triton's interpreter
on a CPU) against the portable fp8 backend.

Tolerance, stated: on 40 greedy tokens after a 67-token chat prompt, prefilled in 16-token
chunks so that later chunks attend over fp8 pages, every token equals float32 KV's, and each
chosen token's logprob differs by at most 0.02 (measured: 1.2e-3 at most). The decode kernel
reads the same quantized pages as the reference, so it holds to float rounding (1e-5). The
writes (the RoPE + store kernel, the fused one-row qkv kernel) round to e4m3 themselves
(noesis.kernels.e4m3), so their bytes equal noesis.kv.fp8.quantize's of the same rotated keys
and values bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import noesis_greedy  # noqa: E402

from noesis import LLM  # noqa: E402
from noesis.engine.config import EngineConfig  # noqa: E402
from noesis.errors import ConfigError  # noqa: E402
from noesis.kv.cache import page_bytes  # noqa: E402
from noesis.kv.fp8 import FP8, FP8LayerCache, read_slots, scales_from_amax  # noqa: E402
from noesis.runner.inputs import AttentionMetadata, PrefillSpan  # noqa: E402

BUNDLED = Path(__file__).resolve().parents[2] / "models" / "noesis-tiny"
KV_BYTES = 8 << 20
NEW_TOKENS = 40


def engine_options(**extra) -> dict:
    return dict(device="cpu", dtype="float32", progress=False, kv_cache_memory=KV_BYTES,
                max_model_len=512, max_num_batched_tokens=16, **extra)


@pytest.fixture(scope="module")
def bundled_runs():
    """(prompt, float32-KV run, fp8-KV run, fp8 engine) on the bundled model."""
    if not BUNDLED.is_dir():
        pytest.skip("models/noesis-tiny not present")
    reference = LLM(str(BUNDLED), **engine_options())
    prompt = reference.engine.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France? Tell me about the weather "
                                     "in Paris."}])
    expected = noesis_greedy(reference, prompt, NEW_TOKENS)
    del reference
    fp8 = LLM(str(BUNDLED), **engine_options(kv_cache_dtype="fp8"))
    return prompt, expected, noesis_greedy(fp8, prompt, NEW_TOKENS), fp8.engine


def test_fp8_kv_greedy_tokens_equal_float_kv(bundled_runs):
    prompt, (want_ids, want_lps), (ids, lps), engine = bundled_runs
    assert len(prompt) > 3 * 16  # prefill chunks read fp8 pages
    assert engine.runner.attention.name == "torch-sdpa-fp8"
    assert ids == want_ids
    assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < 0.02


def test_fp8_pool_holds_twice_the_pages_of_bf16(bundled_runs):
    engine = bundled_runs[3]
    config = engine.loaded.config
    assert page_bytes(config, 16, FP8) * 2 == page_bytes(config, 16, torch.bfloat16)
    assert engine.kv.num_pages == KV_BYTES // page_bytes(config, 16, FP8)
    assert engine.kv.num_pages == 2 * (KV_BYTES // page_bytes(config, 16, torch.bfloat16))
    layer = engine.kv.layers[0]
    assert isinstance(layer, FP8LayerCache) and layer.data.dtype == FP8
    # calibrated: a scale per K/V and KV head, none left at the placeholder 1.0
    assert layer.scales.shape == (2, config.num_kv_heads, 1)
    assert bool((layer.scales != 1.0).all()) and bool((layer.scales > 0).all())


def test_fp8_refuses_what_it_does_not_cover():
    with pytest.raises(ConfigError, match="fp8"):
        EngineConfig(kv_cache_dtype="fp8", batch_invariant=True)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int8")


# ---- the Triton kernels against the portable fp8 backend -------------------------------------


def fp8_cache(kv_heads, head_dim, page_size, num_pages, seed=0):
    """A cache of random quantized pages and its scales."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(2, num_pages, page_size, kv_heads, head_dim, generator=gen)
    values *= torch.rand(1, 1, 1, kv_heads, 1, generator=gen) * 4  # heads of different ranges
    scales = scales_from_amax(values.abs().amax((1, 2, 4)))
    data = (values / scales[:, None, None]).clamp(-448, 448).to(FP8)
    return FP8LayerCache(data, scales)


def decode_meta(page_size, tables, ctx_lens):
    return AttentionMetadata(page_size, torch.empty(0, dtype=torch.long), [],
                             torch.arange(len(ctx_lens)), tables, ctx_lens, int(ctx_lens.max()))


@pytest.mark.parametrize("fused", [False, True], ids=["two-launches", "one-launch"])
def test_triton_decode_reads_fp8_pages(fused):
    pytest.importorskip("triton")
    from noesis.kernels import paged_decode
    from noesis.runner.fp8_attention import FP8TorchAttention

    heads, kv_heads, head_dim, page_size = 4, 2, 16, 4
    ctx_lens = torch.tensor([5, 70])
    cache = fp8_cache(kv_heads, head_dim, page_size, num_pages=24)
    tables = torch.stack([torch.randperm(24)[:18] for _ in ctx_lens])
    q = torch.randn(len(ctx_lens), heads, head_dim, generator=torch.Generator().manual_seed(1))
    meta = decode_meta(page_size, tables, ctx_lens)
    expected = FP8TorchAttention(torch.float32).decode(q, cache, meta, 0.25, None)
    out = paged_decode.paged_decode_attention(
        q, cache.data[0], cache.data[1], tables, ctx_lens, 0.25, 80, None,
        {"fused_reduce": fused}, kv_scales=cache.scales,
    )
    assert float((out - expected).norm() / expected.norm()) < 1e-5


@pytest.mark.parametrize("rotary_dim", [16, 8])  # full and partial rotary
def test_triton_fp8_write_matches_portable_write(rotary_dim):
    """Bit for bit: the kernel rotates in the model dtype, then divides and rounds, as the
    portable backend's apply_rotary then quantize do; keys past 448 clamp, tiny values land on
    e4m3's subnormals."""
    pytest.importorskip("triton")
    from noesis.runner.fp8_attention import FP8TorchAttention, FP8TritonAttention

    gen = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, head_dim, page_size = 5, 4, 2, 16, 4
    q, k, v = (torch.randn(tokens, n, head_dim, generator=gen) * 3
               for n in (heads, kv_heads, kv_heads))
    k[0, 1, 3], v[2, 0] = 1e4, v[2, 0] * 5e-5  # past the range; under e4m3's normals
    angles = torch.randn(tokens, rotary_dim // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = torch.tensor([9, 2, 14, 0, 7])
    meta = AttentionMetadata(page_size, slots, [PrefillSpan(0, tokens, tokens, slots[:2])],
                             slots[:0], slots[:0].view(0, 0), slots[:0], 0)
    scales = scales_from_amax(torch.tensor([[5.0, 2.0], [4.0, 3.0]]))
    caches = [FP8LayerCache(torch.zeros(2, 4, page_size, kv_heads, head_dim, dtype=FP8),
                            scales) for _ in range(2)]
    backends = [FP8TorchAttention(torch.float32), FP8TritonAttention(64, torch.float32)]
    results = [backend.rope_and_store(q.clone(), k.clone(), v.clone(), cos, sin, cache, meta)
               for backend, cache in zip(backends, caches, strict=True)]
    (ref_q, ref_k), (out_q, out_k) = results
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)  # rotated, not scaled
    ref, out = (cache.data.view(torch.uint8) for cache in caches)
    assert torch.equal(out, ref)
    stored = read_slots(caches[1], slots, torch.float32)
    assert stored[0, 0, 1].abs().max() == 448 * scales[0, 1]  # the clamp reached
    assert 0 < stored[1, 2, 0].abs().max() < 2**-6 * scales[1, 0]  # subnormals kept
    untouched = [s for s in range(16) if s not in slots.tolist()]
    assert read_slots(caches[1], torch.tensor(untouched), torch.float32).abs().sum() == 0


def test_fused_one_row_qkv_writes_fp8_with_the_scales():
    """The fused one-row block's qkv kernel into an fp8 cache: qkv as the unfused steps give it,
    and at the slot exactly quantize() of the kernel's own rotated k and its v (against the
    unfused path's k, within one e4m3 step: the GEMV sums in another order)."""
    pytest.importorskip("triton")
    from noesis.kernels import ops, row_gemv
    from noesis.kv.fp8 import quantize
    from noesis.models.rope import apply_rotary

    gen = torch.Generator().manual_seed(6)
    heads, kv_heads, head_dim, width, slot = 4, 2, 16, 96, 13
    x = torch.randn(1, width, generator=gen) * 3
    norm_weight = torch.rand(width, generator=gen) + 0.5
    qkv_weight = torch.randn((heads + 2 * kv_heads) * head_dim, width, generator=gen) / 10
    angles = torch.randn(1, head_dim // 2, generator=gen)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    normed, _ = ops.add_rms_norm(x, None, norm_weight, 1e-5)  # CPU: the torch reference
    q, k, v = torch.nn.functional.linear(normed, qkv_weight).view(-1, head_dim).split(
        [heads, kv_heads, kv_heads])
    q, k = apply_rotary(q[None], cos, sin)[0], apply_rotary(k[None], cos, sin)[0]
    cache = FP8LayerCache.empty((2, 5, 4, kv_heads, head_dim), torch.device("cpu"))
    cache.scales.copy_(scales_from_amax(torch.tensor([[0.5, 1.0], [0.25, 2.0]])))
    config = (8, *row_gemv.ROW_GEMV_CONFIGS[row_gemv.QKV][1:])
    got = row_gemv.norm_qkv_rope_store(x, norm_weight, 1e-5, qkv_weight, heads, kv_heads, cos,
                                       sin, torch.tensor([slot]), cache.data[0], cache.data[1],
                                       config=config, kv_scales=cache.scales)
    expected = torch.cat([q, k, v])
    got = got.view(-1, head_dim)
    assert float((got - expected).norm() / expected.norm()) < 1e-5  # unscaled
    got_k, got_v = got[heads:heads + kv_heads], got[heads + kv_heads:]
    stored = cache.data.view(torch.uint8).view(2, -1, kv_heads, head_dim)
    assert torch.equal(stored[0, slot], quantize(got_k, cache.scales[0]).view(torch.uint8))
    assert torch.equal(stored[1, slot], quantize(got_v, cache.scales[1]).view(torch.uint8))
    steps = (stored[0, slot].view(FP8).float() - quantize(k, cache.scales[0]).float()).abs()
    assert bool((steps <= quantize(k, cache.scales[0]).float().abs() / 8 + 2**-9).all())
    stored[:, slot] = 0
    assert not stored.any()  # nothing else written


def test_fp8_engine_with_the_fused_one_row_block_generates_what_the_unfused_one_does(
    checkpoints, monkeypatch
):
    """The whole model with the fused one-row block writing the fp8 cache (its qkv kernel
    quantizing under Triton's interpreter) against the portable write: same greedy tokens,
    logprobs within fp8 rounding of a flipped e4m3 step."""
    pytest.importorskip("triton")
    from noesis.kernels import ops, row_gemv

    prompt, new_tokens = [0, 5, 9, 77, 31], 3  # the interpreter: about a second a token

    def run():
        llm = checkpoints.new_llm("llama", kv_cache_dtype="fp8", max_model_len=64)
        return llm, noesis_greedy(llm, prompt, new_tokens)

    _, (want_ids, want_lps) = run()
    launches = []
    monkeypatch.setattr(ops, "one_row_fusion", lambda x: x.shape[0] == 1)  # on the CPU too
    # 128 rows per program: few interpreted programs per projection (the tiny N are 64 to 256)
    wide = (128, 512, 8, 1)
    monkeypatch.setattr(row_gemv, "ROW_GEMV_CONFIGS", {
        row_gemv.PLAIN: wide, row_gemv.GLU: wide,
        row_gemv.QKV: row_gemv.ROW_GEMV_CONFIGS[row_gemv.QKV]})
    fused_qkv = row_gemv.norm_qkv_rope_store
    monkeypatch.setattr(row_gemv, "norm_qkv_rope_store",
                        lambda *a, **kw: launches.append(kw["kv_scales"]) or fused_qkv(*a, **kw))
    llm, (ids, lps) = run()
    assert llm.engine.runner.model.fuse_one_row
    assert len(launches) == 2 * (new_tokens - 1)  # 2 layers, every decode step
    layers = llm.engine.kv.layers
    assert all(s is layers[i % 2].scales for i, s in enumerate(launches))  # each its layer's
    assert ids == want_ids
    assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < 1e-3
