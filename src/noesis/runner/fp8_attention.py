"""Attention over an fp8 KV cache (noesis.kv.fp8): the backends that quantize on write and read
the pages as stored, and the calibration forward that fixes the per-head scales at load.

- FP8TorchAttention (CPU, MPS): writes quantized keys/values; every read (prefill context,
  decode) dequantizes only the gathered slots.
- FP8TritonAttention (CUDA): the decode kernel loads e4m3 and applies the scales in-kernel
  (k's folded into the score scale, v's into each split's output); the fused RoPE + store
  kernel, and the fused one-row decoder block's qkv kernel (noesis.kernels.row_gemv), take the
  scales and quantize as they store. Both rotate first, in the model dtype, then divide: the
  order of the portable backend, so the stored bytes equal noesis.kv.fp8.quantize's exactly.

A fresh prefill attends over its own keys and values before rounding, as the bf16 path does.
"""

from __future__ import annotations

import torch

from noesis.kv.fp8 import FP8LayerCache, read_slots, scales_from_amax, write_slots
from noesis.models.rope import apply_rotary
from noesis.runner.attention import TorchPagedAttention, TritonPagedAttention
from noesis.runner.inputs import AttentionMetadata, PrefillSpan
from noesis.runner.pooling import CacheFreeAttention

# The calibration text: ordinary prose, code and numbers, repeated to CALIBRATION_TOKENS.
CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the budget for 2031. Revenue rose 4.7% while costs "
    "fell, so the surplus reached $12,400. def mean(xs): return sum(xs) / len(xs)  # average\n"
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen. Quelle heure "
    "est-il ? Es ist halb neun. 東京は日本の首都です。 Q: What is 17 * 23? A: 391.\n"
)
CALIBRATION_TOKENS = 256


class FP8TorchAttention(TorchPagedAttention):
    name = "torch-sdpa-fp8"

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype  # what reads dequantize to: the model's activations

    def rope_and_store(self, q, k, v, cos, sin, cache: FP8LayerCache, meta: AttentionMetadata):
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        write_slots(cache, meta.slot_mapping, k, v)
        return q, k

    def read(self, cache: FP8LayerCache, slots: torch.Tensor):
        return read_slots(cache, slots, self.dtype)


class FP8TritonAttention(TritonPagedAttention):
    name = "triton-paged-fp8"

    def __init__(self, max_model_len: int, dtype: torch.dtype) -> None:
        super().__init__(max_model_len)
        self.dtype = dtype

    def rope_and_store(self, q, k, v, cos, sin, cache: FP8LayerCache, meta: AttentionMetadata):
        """One launch: q and k rotated in place (unscaled: fresh prefills attend over them),
        k and v quantized into their slots."""
        self.rope.rope_write_kv(q, k, v, cos, sin, meta.slot_mapping, cache.data[0],
                                cache.data[1], kv_scales=cache.scales)
        return q, k

    def decode(self, q, cache: FP8LayerCache, meta: AttentionMetadata, scale: float,
               window: int | None, sinks: torch.Tensor | None = None,
               softcap: float | None = None):
        return self.paged_decode.paged_decode_attention(
            q, cache.data[0], cache.data[1], meta.decode_pages, meta.decode_ctx_lens, scale,
            self.max_model_len, window, sinks=sinks, softcap=softcap, kv_scales=cache.scales,
        )

    def read(self, cache: FP8LayerCache, slots: torch.Tensor):
        return read_slots(cache, slots, self.dtype)


def enable(runner, tokenizer, dtype: torch.dtype) -> None:
    """Fix the fp8 pool's scales by a calibration forward and switch `runner` to the fp8
    backend, which dequantizes to `dtype` (the model's). Before graph capture: the graphs
    record the backend's kernels. The fused one-row decoder block stays on: its qkv kernel
    quantizes with the same scales (noesis.kernels.ops.norm_qkv_rope_store)."""
    kv = runner.kv
    caches = [layer for layer in kv.layers if isinstance(layer, FP8LayerCache)]
    ids = calibration_ids(tokenizer, runner.vocab_size)[:runner.max_model_len]  # RoPE's table
    amax = calibration_amax(runner, ids)
    for cache, layer_amax in zip(caches, amax, strict=True):
        cache.scales.copy_(scales_from_amax(layer_amax))
    if runner.attention.name.startswith("triton"):
        runner.attention = FP8TritonAttention(runner.max_model_len, dtype)
    else:
        runner.attention = FP8TorchAttention(dtype)


def calibration_ids(tokenizer, vocab_size: int) -> list[int]:
    """CALIBRATION_TOKENS ids of the calibration text, repeated (ids past the model's vocab,
    which a random checkpoint's small tokenizer never makes, are wrapped)."""
    ids = [i % vocab_size for i in tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=False)]
    return (ids * (CALIBRATION_TOKENS // max(1, len(ids)) + 1))[:CALIBRATION_TOKENS]


class _RecordingAttention(CacheFreeAttention):
    """Causal attention over the calibration prompt that keeps each layer's largest |k| (after
    RoPE) and |v| per KV head, in layer order."""

    name = "fp8-calibration"

    def __init__(self) -> None:
        self.amax: list[torch.Tensor] = []

    def rope_and_store(self, q, k, v, cos, sin, kv_cache, meta: AttentionMetadata):
        q, k = super().rope_and_store(q, k, v, cos, sin, kv_cache, meta)
        self.amax.append(torch.stack([k.abs().amax((0, 2)), v.abs().amax((0, 2))]))  # [2, Hkv]
        return q, k


@torch.inference_mode()
def calibration_amax(runner, ids: list[int]) -> list[torch.Tensor]:
    """Largest |k| and |v| [2, Hkv] of every attention layer over one prefill of `ids`."""
    device, kv = runner.device, runner.kv
    count = len(ids)
    no_pages = torch.empty(0, dtype=torch.int64, device=device)
    meta = AttentionMetadata(
        page_size=kv.page_size,
        slot_mapping=kv.scratch_page * kv.page_size + torch.arange(count, device=device)
        % kv.page_size,
        prefills=[PrefillSpan(0, count, count, no_pages)],
        decode_rows=no_pages,
        decode_pages=no_pages.view(0, 0),
        decode_ctx_lens=no_pages,
        max_decode_ctx=0,
    )
    cos, sin = runner.rope.cos_sin(torch.arange(count, device=device), [(count, count, count)])
    recorder = _RecordingAttention()
    runner.model(torch.tensor(ids, device=device), cos, sin, kv.layers, meta, recorder)
    return recorder.amax
