"""The paged decode kernel's attention sinks (gpt-oss) and soft-capping (Gemma 2) against the
PyTorch backend, under Triton's interpreter on the CPU (tiny shapes), in both merge modes."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from noesis.kernels import paged_decode  # noqa: E402
from noesis.runner.attention import TorchPagedAttention  # noqa: E402
from noesis.runner.inputs import AttentionMetadata  # noqa: E402


def _setup(heads, kv_heads, head_dim, page_size, ctx_lens):
    gen = torch.Generator().manual_seed(5)
    pages_per = [-(-n // page_size) for n in ctx_lens]
    kv = torch.randn(2, sum(pages_per) + 1, page_size, kv_heads, head_dim, generator=gen) * 2
    tables, start = [], 1
    for n in pages_per:
        tables.append(list(range(start, start + n)) + [0] * (max(pages_per) - n))
        start += n
    q = torch.randn(len(ctx_lens), heads, head_dim, generator=gen) * 2
    sinks = torch.randn(heads, generator=gen) * 2
    return q, kv, torch.tensor(tables), torch.tensor(ctx_lens), sinks


@pytest.mark.parametrize("fused", [True, False], ids=["one-launch", "two-launches"])
@pytest.mark.parametrize(
    ("extras", "window"),
    [  # sinks without a window run in "both"
        ({"sinks": True}, 5),
        ({"softcap": 3.0}, 5),
        ({"sinks": True, "softcap": 3.0}, None),
    ],
    ids=["sinks-window", "softcap-window", "both"],
)
def test_paged_decode_sinks_and_softcap(extras, window, fused):
    ctx_lens = [1, 9, 150]  # 150: three 64-token splits merged with the sink
    q, kv, tables, lens, sinks = _setup(4, 2, 16, 4, ctx_lens)
    kwargs = {"sinks": sinks if extras.get("sinks") else None, "softcap": extras.get("softcap")}
    meta = AttentionMetadata(
        4, torch.empty(0, dtype=torch.long), [], torch.arange(3), tables, lens, max(ctx_lens)
    )
    scale = 16**-0.5
    expected = TorchPagedAttention().decode(q, kv, meta, scale, window, **kwargs)
    plain = TorchPagedAttention().decode(q, kv, meta, scale, window)
    assert (expected - plain).abs().max() > 1e-2  # the extras change the result
    out = paged_decode.paged_decode_attention(
        q,
        kv[0],
        kv[1],
        tables,
        lens,
        scale,
        max(ctx_lens),
        window,
        {"fused_reduce": fused},
        **kwargs,
    )
    assert torch.allclose(out, expected, atol=1e-5, rtol=1e-5)
    if fused:
        assert not paged_decode._split_counters(q.device).any()


def test_torch_sinks_match_transformers_eager():
    """The backend's sink math against transformers' gpt-oss eager attention."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from noesis.runner.attention import _attention_math

    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 7, h, 8, generator=gen) for h in (4, 2, 2))
    sinks = torch.randn(4, generator=gen)
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    ours = _attention_math(q, k, v, mask, 0.3, sinks=sinks)
    module = SimpleNamespace(num_key_value_groups=2, sinks=sinks, training=False)
    additive = torch.zeros(7, 7).masked_fill(~mask, float("-inf"))[None, None]
    theirs, _ = eager_attention_forward(
        module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), additive, 0.3
    )
    assert torch.allclose(ours, theirs, atol=1e-6)
