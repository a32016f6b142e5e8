"""Triton kernels vs their PyTorch references, run by Triton's interpreter on the CPU.

On the lent GPU the same comparisons run compiled (tests/gpu/test_cuda.py).
"""

from __future__ import annotations

import dataclasses
from functools import partial

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from noesis.kernels import bitmask, ops, paged_decode, pointwise, rope, row_gemv  # noqa: E402
from noesis.kernels.e4m3 import quantize_e4m3  # noqa: E402
from noesis.kv.fp8 import FP8, quantize  # noqa: E402
from noesis.models.rope import apply_rotary  # noqa: E402
from noesis.runner.attention import TorchPagedAttention  # noqa: E402
from noesis.runner.inputs import AttentionMetadata  # noqa: E402
from noesis.sampling import race_kernel  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def paged_setup(batch, heads, kv_heads, head_dim, page_size, ctx_lens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page_size) for n in ctx_lens]
    num_pages = sum(pages_per) + 3
    kv = torch.randn(2, num_pages, page_size, kv_heads, head_dim, generator=gen)
    order = torch.randperm(num_pages, generator=gen).tolist()  # scattered pages
    tables, start = [], 0
    for n in pages_per:
        tables.append(order[start : start + n] + [0] * (max(pages_per) - n))
        start += n
    q = torch.randn(batch, heads, head_dim, generator=gen)
    return q, kv, torch.tensor(tables), torch.tensor(ctx_lens)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "page_size", "ctx_lens", "window"),
    [
        (4, 2, 16, 4, [1, 7, 16, 300], None),
        (8, 1, 32, 16, [520, 3], None),  # MQA, several splits
        (4, 4, 24, 8, [33, 64], None),  # MHA, head_dim not a power of two
        (6, 2, 16, 4, [40, 300], 17),  # sliding window
        # a window over two splits (200..299 of 64-token splits 3 and 4), and one longer than
        # its context: the splits before the window are skipped, not masked
        (6, 2, 16, 4, [300, 10], 100),
        # batch > 8: 256-token splits, a five-split context among short ones (each program
        # costs the interpreter milliseconds: nine sequences are enough to pass batch 8)
        (2, 1, 16, 4, [3 + 7 * i for i in range(8)] + [1100], None),
    ],
)
@pytest.mark.parametrize("fused", [True, False], ids=["one-launch", "two-launches"])
def test_paged_decode_attention_matches_reference(
    heads, kv_heads, head_dim, page_size, ctx_lens, window, fused
):
    batch = len(ctx_lens)
    q, kv, tables, lens = paged_setup(batch, heads, kv_heads, head_dim, page_size, ctx_lens)
    meta = AttentionMetadata(
        page_size,
        torch.empty(0, dtype=torch.long),
        [],
        torch.arange(batch),
        tables,
        lens,
        max(ctx_lens),
    )
    scale = head_dim**-0.5
    expected = TorchPagedAttention().decode(q, kv, meta, scale, window)
    out = paged_decode.paged_decode_attention(
        q, kv[0], kv[1], tables, lens, scale, max(ctx_lens), window, {"fused_reduce": fused}
    )
    assert not out.isnan().any()
    assert rel_err(out, expected) < 1e-5
    if fused:  # the split counters are left zero for the next launch
        assert not paged_decode._split_counters(q.device).any()


@pytest.mark.parametrize("sinks", [False, True])
def test_the_split_merge_takes_many_splits_in_chunks(sinks):
    """A context of 38 eight-token splits merges in two chunks of 32 (the merge's work follows
    the context, not max_model_len), with gpt-oss's sinks joining it or not."""
    heads, kv_heads, head_dim, page_size, ctx_lens = 4, 2, 16, 4, [300, 5]
    q, kv, tables, lens = paged_setup(2, heads, kv_heads, head_dim, page_size, ctx_lens)
    meta = AttentionMetadata(page_size, torch.empty(0, dtype=torch.long), [], torch.arange(2),
                             tables, lens, 300)  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    extras = {"sinks": torch.randn(heads, generator=gen)} if sinks else {}
    expected = TorchPagedAttention().decode(q, kv, meta, 0.25, None, **extras)
    out = paged_decode.paged_decode_attention(
        q, kv[0], kv[1], tables, lens, 0.25, 300, None,
        {"fused_reduce": False, "partition": 8}, **extras,
    )  # fmt: skip
    assert rel_err(out, expected) < 1e-5


@pytest.mark.parametrize("window", [None, 50])  # a window leaves some programs nothing
@pytest.mark.parametrize("fused", [True, False], ids=["one-launch", "two-launches"])
def test_a_capped_grid_takes_several_splits_a_program(monkeypatch, fused, window):
    """Eight programs per (sequence, KV head) over 38 and 1 eight-token splits: each program
    carries one online softmax over every eighth split and writes one partial (a grid of every
    split of max_model_len cost more to launch than the attention at short contexts); both
    merges take the eight partials, or the one."""
    assert paged_decode.split_programs(4, 2048) == 1024  # batch 1, 4 KV heads, 131k tokens
    assert paged_decode.split_programs(512, 512) == 8  # batch 64, 8 KV heads
    assert paged_decode.split_programs(4, 32) == 32  # max_model_len 2,048: one split each
    monkeypatch.setattr(paged_decode, "SPLIT_GRID", 1)
    heads, kv_heads, head_dim, page_size, ctx_lens = 4, 2, 16, 4, [300, 5]
    q, kv, tables, lens = paged_setup(2, heads, kv_heads, head_dim, page_size, ctx_lens)
    meta = AttentionMetadata(page_size, torch.empty(0, dtype=torch.long), [], torch.arange(2),
                             tables, lens, 300)  # fmt: skip
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(5))
    expected = TorchPagedAttention().decode(q, kv, meta, 0.25, window, sinks=sinks)
    out = paged_decode.paged_decode_attention(
        q, kv[0], kv[1], tables, lens, 0.25, 300, window,
        {"fused_reduce": fused, "partition": 8}, sinks=sinks,
    )  # fmt: skip
    assert rel_err(out, expected) < 1e-5
    assert not paged_decode._split_counters(q.device).any()


@pytest.mark.parametrize("sinks", [False, True])
def test_the_merge_kernel_weighs_every_chunk_of_splits_by_its_log_sum_exp(sinks):
    """The merge alone on crafted splits: 70 of them (three chunks), the largest log-sum-exp in
    the last chunk, so that every earlier chunk's running sum must be rescaled."""
    gen = torch.Generator().manual_seed(6)
    heads, splits, dim, part = 3, 70, 16, 4
    part_out = torch.randn(1, heads, splits, dim, generator=gen)
    part_lse = torch.randn(1, heads, splits, generator=gen)
    part_lse[..., 66] += 6.0
    lens = torch.tensor([splits * part - 1])
    sink = torch.randn(heads, generator=gen)
    out = torch.empty(1, heads, dim)
    paged_decode._paged_decode_reduce[(1, heads)](
        part_out, part_lse, lens, out, sink if sinks else part_lse, splits, 0,
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0),
        part_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=dim, DIM_PAD=dim, CHUNK=32, PART=part, PDL=False, HAS_SINKS=sinks,
        HAS_WINDOW=False,
    )  # fmt: skip
    logits = torch.cat([part_lse[0], sink[:, None]], 1) if sinks else part_lse[0]
    weights = torch.softmax(logits, dim=1)[:, :splits]  # a sink's share carries no value
    assert rel_err(out[0], (weights[:, :, None] * part_out[0]).sum(1)) < 1e-5


def test_add_rms_norm_matches_reference():
    gen = torch.Generator().manual_seed(1)
    x, res = torch.randn(5, 96, generator=gen), torch.randn(5, 96, generator=gen)
    w = torch.randn(96, generator=gen)
    out, new_res = pointwise.add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_res = ops.add_rms_norm(x.clone(), res.clone(), w, 1e-6)  # CPU: torch path
    assert torch.allclose(new_res, ref_res) and rel_err(out, ref_out) < 1e-6
    out_alone, _ = pointwise.add_rms_norm(x, None, w, 1e-6)
    assert rel_err(out_alone, ops.add_rms_norm(x, None, w, 1e-6)[0]) < 1e-6


def test_silu_mul_matches_reference():
    x = torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(2))
    assert rel_err(pointwise.silu_mul(x), ops.silu_mul(x)) < 1e-6


@pytest.mark.parametrize("rotary_dim", [16, 8])  # full and partial rotary
def test_rope_write_kv_matches_reference(rotary_dim):
    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, head_dim, page_size = 5, 4, 2, 16, 4
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    angles = torch.randn(tokens, rotary_dim // 2, generator=gen)
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    slots = torch.tensor([9, 2, 14, 0, 7])
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    ref_q, ref_k, ref_v = (
        t.reshape(tokens, -1, head_dim) for t in qkv.clone().split([q_size, kv_size, kv_size], -1)
    )
    ref_q, ref_k = apply_rotary(ref_q, cos, sin), apply_rotary(ref_k, cos, sin)
    kv = torch.zeros(2, 4, page_size, kv_heads, head_dim)
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split([q_size, kv_size, kv_size], -1))
    rope.rope_write_kv(q, k, v, cos, sin, slots, kv[0], kv[1])
    assert rel_err(q, ref_q) < 1e-6 and rel_err(k, ref_k) < 1e-6
    flat = kv.view(2, -1, kv_heads, head_dim)
    assert torch.allclose(flat[0][slots], ref_k) and torch.allclose(flat[1][slots], ref_v)
    untouched = [s for s in range(16) if s not in slots.tolist()]
    assert flat[:, untouched].abs().sum() == 0


def test_rope_write_kv_normalizes_each_q_and_k_head_first():
    """Qwen3's per-head q/k RMSNorm in the RoPE kernel (one program per head): normalized, then
    rotated, k and v stored; v untouched by the norm."""
    gen = torch.Generator().manual_seed(5)
    tokens, heads, kv_heads, head_dim = 3, 4, 2, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3
    q_norm, k_norm = torch.rand(head_dim, generator=gen) + 0.5, torch.rand(head_dim, generator=gen)
    angles = torch.randn(tokens, head_dim // 2, generator=gen)
    cos, sin = (torch.cat([f(angles), f(angles)], -1) for f in (torch.cos, torch.sin))
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    ref_q, ref_k, ref_v = (t.reshape(tokens, -1, head_dim) for t in qkv.clone().split(sizes, -1))
    ref_q = apply_rotary(ops.add_rms_norm(ref_q, None, q_norm, 1e-6)[0], cos, sin)
    ref_k = apply_rotary(ops.add_rms_norm(ref_k, None, k_norm, 1e-6)[0], cos, sin)
    kv = torch.zeros(2, 2, 4, kv_heads, head_dim)
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split(sizes, -1))
    rope.rope_write_kv(q, k, v, cos, sin, torch.tensor([5, 1, 6]), kv[0], kv[1],
                       qk_norm=(q_norm, k_norm, 1e-6))  # fmt: skip
    assert rel_err(q, ref_q) < 1e-5 and rel_err(k, ref_k) < 1e-5
    flat = kv.view(2, -1, kv_heads, head_dim)
    assert rel_err(flat[0][[5, 1, 6]], ref_k) < 1e-5 and torch.equal(flat[1][[5, 1, 6]], ref_v)


@triton.jit
def _quantize_e4m3(x_ptr, scale_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, quantize_e4m3(tl.load(x_ptr + i), tl.load(scale_ptr)))


def test_e4m3_rounding_stores_the_bits_torchs_cast_stores():
    """The fp8 KV writes' rounding (noesis.kernels.e4m3) against noesis.kv.fp8.quantize on
    every finite e4m3 value, every midpoint between neighbours (ties go to the even one, some
    carrying into the next binade), values past the range and under the subnormals, and both
    zeros: the same bits."""
    finite = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = finite[~finite.isnan()].sort().values
    ties = (finite[1:] + finite[:-1]) / 2
    edges = torch.tensor([-0.0, 0.0, 500.0, -1e9, 1e-30, -1e-30, 2**-10, 3 * 2**-11])
    x = torch.cat([finite, ties, edges])
    x = torch.cat([x, torch.zeros(1024 - len(x))]).to(DEVICE)
    for scale in (1.0, 0.37):
        scale = torch.tensor([scale], device=DEVICE)
        out = torch.empty(1024, dtype=FP8, device=DEVICE)
        _quantize_e4m3[(1,)](x, scale, out, N=1024)
        want = quantize(x[:, None], scale.view(1, 1)).view(-1)
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))


def test_exponential_race_kernel_samples_what_the_torch_sampler_samples():
    """Same noise hash, same race: the fused kernel picks the torch path's token in every row,
    greedy rows (T = 0) and -inf (grammar-masked) entries included, across vocabulary chunks."""
    from noesis.sampling.sampler import SamplingTensors, sample

    gen = torch.Generator().manual_seed(3)
    rows, vocab = 6, 9000  # three 4096-wide chunks, the last one partial
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[2, ::3] = float("-inf")
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.0, 2.0, 1.0])
    seeds = torch.tensor([1, 2**40 + 5, 77, 9, 2**62 + 11, 123456789])
    steps = torch.tensor([0, 3, 17, 5, 1000, 2**33])
    expected = sample(
        logits.clone(),
        SamplingTensors(
            temperature=temperature,
            top_k=None,
            top_p=None,
            min_p=None,
            seeds=seeds,
            steps=steps,
            all_greedy=False,
        ),
    ).token_ids
    got = race_kernel.exponential_race(
        logits.to(DEVICE), temperature.to(DEVICE), seeds.to(DEVICE), steps.to(DEVICE)
    )
    assert got.cpu().tolist() == expected.tolist()
    assert got[3].item() == logits[3].argmax().item()
    # The runner hands the knobs over as columns of [B, 3] tensors (one copy per dtype): the
    # kernel must follow their strides, not read row i's temperature at element i.
    floats = torch.stack([temperature, torch.full_like(temperature, 0.5), temperature * 0], 1)
    ints = torch.stack([torch.zeros_like(seeds), seeds, steps], 1)
    strided = race_kernel.exponential_race(
        logits.to(DEVICE), floats[:, 0].to(DEVICE), ints[:, 1].to(DEVICE), ints[:, 2].to(DEVICE)
    )
    assert strided.cpu().tolist() == expected.tolist()


def argmax_cases(rows: int = 5, vocab: int = 3000) -> torch.Tensor:
    """Logits over three 1,024-wide chunks (the last partial) with the ties and -inf that the
    argmax must resolve as torch does."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(4))
    logits[0, [700, 2500]] = 9.0  # the maximum in two chunks: the first one's index wins
    logits[1, [1030, 1031, 2999]] = 9.0  # twice in one chunk and in the last, partial one
    logits[2, :2990] = float("-inf")  # grammar-masked but for the partial chunk's tail
    logits[2, 2993] = 9.0
    logits[3, 2999] = 50.0  # the very last entry
    logits[4] = float("-inf")  # nothing allowed at all: torch answers 0
    return logits


def test_greedy_argmax_kernel_matches_torch_argmax():
    logits = argmax_cases()
    got = race_kernel.greedy_argmax(logits.to(DEVICE))
    assert got.dtype == torch.int64
    assert got.cpu().tolist() == logits.argmax(dim=-1).tolist() == [700, 1030, 2993, 2999, 0]


def test_race_kernels_report_rows_that_cannot_give_a_token():
    """With `report`, both kernels also return the ids with -1 where a row holds NaN or +inf
    (in any chunk) or no finite logit at all; the ids themselves stay valid indices."""
    logits = argmax_cases(rows=7)
    logits[5, 1500] = float("nan")  # in the middle chunk only
    logits[6, 2999] = float("inf")  # in the last, partial chunk
    usable = [True, True, True, True, False, False, False]
    for kernel in (
        race_kernel.greedy_argmax,
        partial(
            race_kernel.exponential_race,
            temperature=torch.full((7,), 0.8, device=DEVICE),
            seeds=torch.arange(7, device=DEVICE),
            steps=torch.zeros(7, dtype=torch.int64, device=DEVICE),
        ),
    ):
        ids, reported = kernel(logits.to(DEVICE), report=True)
        assert ids.cpu().tolist() == kernel(logits.to(DEVICE)).cpu().tolist()
        assert ((0 <= ids) & (ids < 3000)).all()
        assert [r != -1 for r in reported.cpu().tolist()] == usable
        assert [r for r, ok in zip(reported.tolist(), usable, strict=True) if ok] == [
            i for i, ok in zip(ids.tolist(), usable, strict=True) if ok
        ]


def test_the_sampler_reports_unusable_rows_on_every_path(monkeypatch):
    """SamplerOutput.reported_ids: the torch paths (CPU) and the kernels (interpreted) agree,
    greedy, sampled and filtered alike."""
    from noesis.sampling import sampler

    logits = argmax_cases(rows=7)
    logits[5, 1500] = float("nan")
    logits[6, 2999] = float("inf")
    expected_bad = [False, False, False, False, True, True, True]
    settings = [
        sampler.SamplingTensors.greedy(),
        sampler.SamplingTensors(
            temperature=torch.tensor([0.8, 0.0, 1.0, 0.5, 1.0, 0.7, 0.9]),
            top_k=None,
            top_p=None,
            min_p=None,
            seeds=torch.arange(7),
            steps=torch.zeros(7, dtype=torch.int64),
            all_greedy=False,
        ),
    ]
    settings.append(dataclasses.replace(settings[1], top_k=torch.full((7,), 5)))
    for kernels in (False, True):
        if kernels:
            monkeypatch.setattr(sampler.ops, "use_triton", lambda x: True)
        for tensors in settings:
            out = sampler.sample(logits.clone(), tensors)
            assert [r == -1 for r in out.reported_ids.tolist()] == expected_bad
            assert ((0 <= out.token_ids) & (out.token_ids < 3000)).all()
    monkeypatch.setattr(sampler, "CHECK_ROWS", False)
    assert sampler.sample(logits.clone(), settings[0]).reported_ids is None


def test_take_pending_kernel_gathers_only_rows_with_a_source():
    previous = torch.tensor([11, 12, 13, 14], device=DEVICE)
    ids = torch.tensor([1, 2, 3, 4, 5, 6], device=DEVICE)
    sources = torch.tensor([-1, 3, 0, -1, 3, 2], device=DEVICE)
    want = [1, 14, 11, 4, 14, 13]
    fallback = ids.cpu().clone()  # ops' PyTorch path (CPU, or NOESIS_DISABLE_TRITON=1)
    ops.take_pending(fallback, sources.cpu(), previous.cpu())
    assert fallback.tolist() == want
    pointwise.take_pending(ids, sources, previous)
    assert ids.cpu().tolist() == want


def test_bitmask_kernel_matches_the_torch_unpacking():
    from noesis.structured.bitmask import bitmask_width

    gen = torch.Generator().manual_seed(4)
    rows, vocab = 3, 5000
    words = torch.randint(
        -(2**31), 2**31 - 1, (rows, bitmask_width(vocab)), generator=gen, dtype=torch.int64
    ).to(torch.int32)
    words[1] = -1  # a row with no grammar: all allowed
    logits = torch.randn(rows, vocab, generator=gen)
    bits = ((words[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).view(rows, -1)
    expected = logits.masked_fill(bits[:, :vocab] == 0, float("-inf"))
    got = bitmask.apply_token_bitmask_(logits.clone().to(DEVICE), words.to(DEVICE))
    assert torch.equal(got.cpu(), expected)
    # Views as well: the words transposed in memory, the logits every other column of a wider
    # buffer; the kernel follows their strides.
    words_t = words.t().contiguous().t().to(DEVICE)
    wide = torch.zeros(rows, 2 * vocab, device=DEVICE)
    wide[:, ::2] = logits.to(DEVICE)
    assert not words_t.is_contiguous() and wide[:, ::2].stride(1) == 2
    bitmask.apply_token_bitmask_(wide[:, ::2], words_t)
    assert torch.equal(wide[:, ::2].cpu(), expected) and not wide[:, 1::2].any()


@pytest.mark.parametrize(("out_features", "in_features"), [(40, 96), (8, 512), (3, 1030)])
def test_one_row_gemv_matches_linear(out_features, in_features):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    expected = torch.nn.functional.linear(x, weight)
    assert rel_err(row_gemv.gemv(x, weight), expected) < 1e-6
    residual = torch.randn(1, out_features, generator=gen)
    with_residual = row_gemv.gemv(x, weight, residual)
    assert rel_err(with_residual, expected + residual) < 1e-6


def test_one_row_gemv_adds_the_bias_before_rounding():
    """float16: numpy's own half type, which the interpreter computes exactly (its bfloat16
    arithmetic is emulated and loses the residual add)."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(1, 96, generator=gen).half()
    weight = (torch.randn(40, 96, generator=gen) / 10).half()
    bias, residual = torch.randn(40, generator=gen).half(), torch.randn(1, 40).half()
    exact = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    got = row_gemv.gemv(x, weight, residual, bias=bias)
    assert rel_err(got.float(), (exact.half() + residual).float()) < 1e-3


def one_row_inputs(width, rows, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, width, generator=gen) * 3
    norm_weight = torch.rand(width, generator=gen) + 0.5
    weight = torch.randn(rows, width, generator=gen) / width**0.5
    normed, _ = ops.add_rms_norm(x, None, norm_weight, 1e-5)  # CPU: the torch reference
    return x, norm_weight, weight, normed


@pytest.mark.parametrize("width", [96, 1030])  # K ragged against the 512-wide tiles
def test_norm_glu_matches_norm_linear_silu_mul(width):
    x, norm_weight, gate_up, normed = one_row_inputs(width, 2 * 72, seed=5)
    expected = ops.silu_mul(torch.nn.functional.linear(normed, gate_up))
    got = row_gemv.norm_glu(x, norm_weight, 1e-5, gate_up)
    assert got.shape == (1, 72) and rel_err(got, expected) < 1e-5


def test_norm_logits_matches_norm_and_lm_head():
    x, norm_weight, head, normed = one_row_inputs(96, 300, seed=8)
    got = row_gemv.norm_logits(x, norm_weight, 1e-5, head)
    assert got.dtype == torch.float32 and got.shape == (1, 300)
    assert rel_err(got, torch.nn.functional.linear(normed, head)) < 1e-5


def test_norm_glu_adds_both_halves_biases():
    x, norm_weight, gate_up, normed = one_row_inputs(96, 2 * 72, seed=5)
    bias = torch.randn(2 * 72, generator=torch.Generator().manual_seed(1))
    expected = ops.silu_mul(torch.nn.functional.linear(normed, gate_up, bias))
    got = row_gemv.norm_glu(x, norm_weight, 1e-5, gate_up, bias=bias)
    assert rel_err(got, expected) < 1e-5


def test_norm_router_stores_the_norm_and_biased_logits_in_the_model_dtype():
    """A MoE block's one-row router: rms_norm(x) (stored for the experts) through the router
    and its bias, logits rounded to and kept in the model dtype, as nn.Linear gives them."""
    x, norm_weight, router, normed = one_row_inputs(1030, 12, seed=2)  # K past two tiles
    x, norm_weight, router = x.half(), norm_weight.half(), router.half()
    bias = torch.randn(12, generator=torch.Generator().manual_seed(2)).half()
    want_normed, _ = ops.add_rms_norm(x, None, norm_weight, 1e-5)
    out = torch.zeros_like(x)
    logits = row_gemv.norm_logits(x, norm_weight, 1e-5, router, bias=bias, normed=out,
                                  dtype=x.dtype)  # fmt: skip
    assert rel_err(out.float(), want_normed.float()) < 1e-3
    exact = torch.nn.functional.linear(want_normed.float(), router.float(), bias.float())
    assert logits.dtype == torch.float16 and rel_err(logits.float(), exact) < 2e-3


# rows None: the default config, whose 8 rows per program shrink to fit a 4-wide half head
@pytest.mark.parametrize(("head_dim", "rows"), [(16, 8), (64, 8), (8, 4), (8, None), (24, 8)])
def test_norm_qkv_rope_store_matches_the_unfused_steps(head_dim, rows):
    heads, kv_heads, page_size, slot = 4, 2, 4, 13
    x, norm_weight, qkv_weight, normed = one_row_inputs(
        96, (heads + 2 * kv_heads) * head_dim, seed=6
    )
    angles = torch.randn(1, head_dim // 2, generator=torch.Generator().manual_seed(7))
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    q, k, v = torch.nn.functional.linear(normed, qkv_weight).split([q_size, kv_size, kv_size], -1)
    q = apply_rotary(q.view(1, heads, head_dim), cos, sin)
    k = apply_rotary(k.view(1, kv_heads, head_dim), cos, sin)
    kv = torch.zeros(2, 5, page_size, kv_heads, head_dim)
    config = rows and (rows, *row_gemv.ROW_GEMV_CONFIGS[row_gemv.QKV][1:])
    got = row_gemv.norm_qkv_rope_store(
        x,
        norm_weight,
        1e-5,
        qkv_weight,
        heads,
        kv_heads,
        cos,
        sin,
        torch.tensor([slot]),
        kv[0],
        kv[1],
        config=config,
    )
    expected = torch.cat([q.flatten(), k.flatten(), v.flatten()])[None]
    assert rel_err(got, expected) < 1e-5
    flat = kv.view(2, -1, kv_heads, head_dim)
    assert rel_err(flat[0, slot], k[0]) < 1e-5
    assert rel_err(flat[1, slot], v.view(kv_heads, -1)) < 1e-5
    flat[:, slot] = 0
    assert flat.abs().sum() == 0  # nothing else written


def test_norm_qkv_rope_store_adds_the_biases_before_the_rotation():
    """Qwen2's q/k/v biases, added to the row sums before they are rounded and rotated."""
    heads, kv_heads, head_dim, slot = 4, 2, 16, 6
    x, norm_weight, qkv_weight, normed = one_row_inputs(96, (heads + 2 * kv_heads) * head_dim,
                                                        seed=11)  # fmt: skip
    gen = torch.Generator().manual_seed(12)
    bias = torch.randn(qkv_weight.shape[0], generator=gen)
    angles = torch.randn(1, head_dim // 2, generator=gen)
    cos, sin = (torch.cat([f(angles), f(angles)], -1) for f in (torch.cos, torch.sin))
    q, k, v = torch.nn.functional.linear(normed, qkv_weight, bias).split(
        [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = apply_rotary(q.view(1, heads, head_dim), cos, sin)
    k = apply_rotary(k.view(1, kv_heads, head_dim), cos, sin)
    kv = torch.zeros(2, 3, 4, kv_heads, head_dim)
    got = row_gemv.norm_qkv_rope_store(
        x, norm_weight, 1e-5, qkv_weight, heads, kv_heads, cos, sin, torch.tensor([slot]),
        kv[0], kv[1], config=(4, 32, 4, 1), bias=bias,
    )  # fmt: skip
    assert rel_err(got, torch.cat([q.flatten(), k.flatten(), v.flatten()])[None]) < 1e-5
    flat = kv.view(2, -1, kv_heads, head_dim)
    assert rel_err(flat[0, slot], k[0]) < 1e-5
    assert rel_err(flat[1, slot], v.view(kv_heads, -1)) < 1e-5


PREFIX = [0, 5, 9, 77, 31, 8, 2, 40, 13]  # two 4-token pages and one token
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
       "norm_topk_prob": True, "mlp_only_layers": [1]}  # fmt: skip
GPT_OSS = {"num_local_experts": 8, "num_experts_per_tok": 4, "intermediate_size": 32,
           "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}  # fmt: skip


@pytest.mark.parametrize(
    ("family", "config", "engine", "prompts"),
    [
        ("mistral", {"sliding_window": 6, "tie_word_embeddings": True}, {}, [PREFIX[:5], [3]]),
        # untied; the second run prefills one token after 8 cached ones
        ("llama", {}, {"enable_prefix_caching": True, "page_size": 4}, [PREFIX, PREFIX]),
        ("qwen2", {}, {}, [PREFIX[:5], [3]]),  # q/k/v biases
        ("llama", {"attention_bias": True, "mlp_bias": True}, {}, [PREFIX[:5]]),  # every bias
        ("qwen3", {"head_dim": 128}, {}, [PREFIX[:5], [3]]),  # per-head q/k norms
        ("qwen3", {}, {}, [PREFIX[:5]]),  # head_dim 24: a half head of 12, masked lanes
        ("qwen3_moe", dict(MOE, head_dim=16), {}, [PREFIX[:5], [3]]),  # a dense layer too
        # sinks, biases everywhere, a sliding layer shorter than the sequence, routed experts
        ("gpt_oss", GPT_OSS, {}, [PREFIX, [3]]),
    ],
    ids=["sliding-window-tied", "prefix-cached", "qwen2-bias", "llama-all-biases", "qwen3-qk-norm",
         "qwen3-head-24", "qwen3-moe", "gpt-oss"],
)
def test_fused_one_row_decoder_generates_what_the_unfused_one_does(
    tmp_path, monkeypatch, family, config, engine, prompts
):
    """The whole model with DecoderLayer.forward_one_row on every one-row step (decode at batch
    1, and the prefill of a one-token prompt or of the one token after a cached prefix): same
    greedy tokens and logprobs as the unfused blocks, the LM head tied to the embeddings or
    not, with a sliding window shorter than the sequence, projection biases, per-head q/k
    norms, attention sinks and routed experts (router and norm in one kernel, the residual
    added by the experts' last; with q/k norms the projection is a plain one and the RoPE
    kernel normalizes each head)."""
    from checkpoints import build_checkpoint

    from noesis import LLM, SamplingParams

    path = build_checkpoint(tmp_path / family, family, **config)
    new_tokens = 6  # under Triton's interpreter every token costs seconds; 5 decodes suffice
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=3)

    def run():
        llm = LLM(str(path), device="cpu", dtype="float32", progress=False, **engine)
        return llm, [llm.generate([p], params)[0] for p in prompts]

    _, want = run()
    launches = []
    monkeypatch.setattr(ops, "one_row_fusion", lambda x: x.shape[0] == 1)  # on the CPU too
    # The interpreter's cost is per program: with 128 rows per program (the tiny model's N are
    # 64 to 384) a step takes 25 programs instead of 160. Several programs per projection and
    # their row tails are the kernel tests' above.
    monkeypatch.setattr(
        row_gemv,
        "ROW_GEMV_CONFIGS",
        {
            row_gemv.PLAIN: (128, 512, 8, 1),
            row_gemv.GLU: (128, 512, 8, 1),
            row_gemv.QKV: row_gemv.ROW_GEMV_CONFIGS[row_gemv.QKV],
        },
    )
    for module, name in ((row_gemv, "norm_qkv_rope_store"), (row_gemv, "norm_logits"),
                         (rope, "rope_write_kv")):  # fmt: skip
        kernel = getattr(module, name)
        monkeypatch.setattr(
            module,
            name,
            lambda *a, k=kernel, n=name, **kw: launches.append(n) or k(*a, **kw),
        )
    llm, got = run()
    model = llm.engine.runner.model
    assert model.fuse_one_row
    assert (model.lm_head is None) == config.get("tie_word_embeddings", False)
    assert model.model.layers[0].self_attn.sliding_window == config.get("sliding_window")
    if engine:
        assert llm.engine.prefix_cache.hit_tokens == 8
    # per one-row step (every decode, and a one-token prefill: of a one-token prompt or after
    # the cached prefix): 2 layers' qkv, 1 LM head and the routers of the layers with experts;
    # with q/k norms each layer's qkv is a plain projection (norm_logits) and the RoPE kernel
    one_token_prefills = sum(len(p) == 1 for p in prompts) + bool(engine)
    steps = len(prompts) * (new_tokens - 1) + one_token_prefills
    routed = sum(hasattr(layer.mlp, "router") for layer in model.model.layers)
    split_qkv = model.config.qk_norm
    assert launches.count("norm_qkv_rope_store") == (0 if split_qkv else 2 * steps)
    assert launches.count("rope_write_kv") == (2 * steps if split_qkv else 0)
    assert launches.count("norm_logits") == (1 + routed + 2 * split_qkv) * steps
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys() and all(abs(la[t] - lb[t]) < 1e-4 for t in la)


def test_row_gemv_configs_come_from_the_per_gpu_table(tmp_path, monkeypatch):
    table = tmp_path / "row_gemv_configs.json"
    table.write_text(
        '{"cpu": {"0,40,96": [2, 32, 4, 1]}, "NVIDIA H200": {"0,40,96": [8, 64, 8, 3]}}'
    )
    monkeypatch.setattr(row_gemv, "CONFIG_FILE", table)
    row_gemv._device_configs.cache_clear()
    try:
        weight = torch.randn(40, 96)
        assert row_gemv.row_gemv_config(row_gemv.PLAIN, weight) == (2, 32, 4, 1)
        other = torch.randn(48, 96)  # a shape the table does not hold: the mode's default
        default = row_gemv.ROW_GEMV_CONFIGS[row_gemv.PLAIN]
        assert row_gemv.row_gemv_config(row_gemv.PLAIN, other) == default
        monkeypatch.setitem(row_gemv.ROW_GEMV_TUNED, (0, 40, 96), (4, 64, 4, 1))
        assert row_gemv.row_gemv_config(row_gemv.PLAIN, weight) == (4, 64, 4, 1)
        x = torch.randn(1, 96)
        assert rel_err(row_gemv.gemv(x, weight), x @ weight.T) < 1e-6
    finally:
        row_gemv._device_configs.cache_clear()


def test_the_shipped_row_gemv_config_table_is_well_formed():
    """The table ships empty until a GPU sweep fills it; whatever it holds must be usable."""
    import json

    table = json.loads(row_gemv.CONFIG_FILE.read_text())
    assert isinstance(table, dict)
    assert all(isinstance(configs, dict) for configs in table.values())
    row_gemv._device_configs.cache_clear()
    assert isinstance(row_gemv._device_configs(torch.device("cpu")), dict)  # reads it
    for gpu, configs in table.items():
        for key, config in configs.items():
            mode, n, k = map(int, key.split(","))
            rows, block_k, warps, stages = config
            assert mode in (row_gemv.PLAIN, row_gemv.GLU, row_gemv.QKV), gpu
            assert n > 0 and k > 0 and warps in (1, 2, 4, 8, 16) and stages >= 1, (gpu, key)
            assert rows & (rows - 1) == 0 and block_k & (block_k - 1) == 0, (gpu, key)


def test_a_triton_without_pdl_still_runs_the_kernels():
    """Triton before 3.4 has no gdc_wait: the modules import with PDL off and its kernels run
    (checked in a child process, whose triton is patched to lack the instructions)."""
    import subprocess
    import sys

    code = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import sys, types
import torch
import triton.language.extra as extra
from triton.language.extra import cuda
old = types.ModuleType(cuda.__name__)
old.__dict__.update({k: v for k, v in vars(cuda).items() if not k.startswith("gdc")})
sys.modules[cuda.__name__] = extra.cuda = old
from noesis.kernels import pdl, row_gemv
assert not pdl.PDL and not pdl.GDC
x, w = torch.randn(1, 64), torch.randn(32, 64)
assert torch.allclose(row_gemv.gemv(x, w, None, config=(4, 32, 4, 1)), x @ w.T, atol=1e-4)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_missing_triton_kernels_warn_once_and_fall_back(monkeypatch):
    import sys

    import noesis.kernels

    monkeypatch.setitem(sys.modules, "noesis.kernels.pdl", None)  # import fails
    monkeypatch.delattr(noesis.kernels, "pdl")
    ops._triton.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="Triton kernels unavailable"):
            assert ops._triton() is None
        assert ops._triton() is None  # cached: no second warning, no second import
    finally:
        ops._triton.cache_clear()


@pytest.mark.parametrize(
    "filters",
    [
        {"top_p": [0.9, 0.5, 1.0, 0.95, 0.3, 0.99]},
        {"top_k": [5, 1, 0, 40, 2, 3000]},
        {"min_p": [0.05, 0.0, 0.2, 0.01, 0.5, 0.1]},
        {
            "top_k": [50, 0, 7, 3, 0, 20],
            "top_p": [0.8, 0.9, 1.0, 0.6, 0.95, 0.7],
            "min_p": [0.0, 0.02, 0.1, 0.0, 0.05, 0.0],
        },
    ],
)
def test_filtered_sampling_through_the_race_kernel_picks_the_torch_paths_tokens(
    monkeypatch, filters
):
    """With top-k / top-p / min-p the sampler filters in torch, then races the filtered logits
    in the fused kernel (at T = 1, as they are already scaled); that must be the token its
    elementwise noise path picks, greedy rows included, over a vocabulary of several chunks."""
    from noesis.sampling import sampler

    gen = torch.Generator().manual_seed(8)
    rows, vocab = 6, 9000
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[2, ::3] = float("-inf")
    knobs = {"top_k": None, "top_p": None, "min_p": None}
    for name, values in filters.items():
        knobs[name] = torch.tensor(values, dtype=torch.int64 if name == "top_k" else torch.float32)
    tensors = sampler.SamplingTensors(
        temperature=torch.tensor([1.0, 0.7, 1.3, 0.0, 2.0, 1.0]),
        **knobs,
        seeds=torch.tensor([1, 2**40 + 5, 77, 9, 2**62 + 11, 123456789]),
        steps=torch.tensor([0, 3, 17, 5, 1000, 2**33]),
        all_greedy=False,
    )
    expected = sampler.sample(logits.clone(), tensors).token_ids
    raced = []
    real_race = race_kernel.exponential_race

    def race(*args):
        raced.append(args[1])
        return real_race(*args)

    monkeypatch.setattr(sampler.ops, "use_triton", lambda x: True)  # the CUDA path, interpreted
    monkeypatch.setattr(sampler.ops, "exponential_race", race)
    got = sampler.sample(logits.clone(), tensors).token_ids
    assert len(raced) == 1 and raced[0].tolist() == [1.0] * rows  # filtered, then raced at T = 1
    assert got.tolist() == expected.tolist()
    assert got[3].item() == logits[3].argmax().item()  # the T = 0 row stays greedy
    # the filters held: a top-k row never samples outside its k best
    if filters.get("top_k"):
        for row, k in enumerate(filters["top_k"]):
            if k:
                assert logits[row, got[row]] >= logits[row].topk(k).values[-1]


def test_seeded_sampling_through_the_race_kernels_ignores_the_batch(checkpoints, monkeypatch):
    """The engine's CUDA sampling path (the race kernel, with and without top-k / top-p
    filters) run on the CPU under Triton's interpreter: a seeded request samples the same tokens
    alone and in batches of others, with the knobs handed over as the runner builds them."""
    from types import SimpleNamespace

    from noesis import SamplingParams
    from noesis.sampling import sampler

    raced = []

    def race(*args, **kwargs):
        raced.append(args[0].shape[0])
        return race_kernel.exponential_race(*args, **kwargs)

    monkeypatch.setattr(
        sampler,
        "ops",
        SimpleNamespace(
            use_triton=lambda x: True,
            exponential_race=race,
            greedy_argmax=race_kernel.greedy_argmax,
        ),
    )
    llm = checkpoints.llm("llama")
    prompts = [[0, 5, 9, 77, 100, 21], list(range(40, 60)), [3, 14, 15, 92, 65]]
    # Every row of every step costs the interpreter ~0.1 s: six tokens, and both targets in
    # each batch, at other places, among others that finish before them or with them.
    others = [
        SamplingParams(temperature=1.3, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.5, top_k=5, max_tokens=6, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=2),
    ]
    targets = (
        SamplingParams(temperature=0.8, seed=77, max_tokens=6, ignore_eos=True),
        SamplingParams(
            temperature=0.8, top_p=0.9, top_k=50, seed=77, max_tokens=6, ignore_eos=True
        ),
    )
    alone = [llm.generate([prompts[0]], target)[0].token_ids for target in targets]
    for mix, places in (
        ([others[0], targets[0], others[1], targets[1]], (1, 3)),
        ([targets[1], others[2], targets[0]], (2, 0)),
    ):
        batch = [prompts[0] if i in places else prompts[1 + i % 2] for i in range(len(mix))]
        outputs = llm.generate(batch, mix)
        assert [outputs[i].token_ids for i in places] == alone
    assert max(raced) > 1  # the batches did go through the kernel together
