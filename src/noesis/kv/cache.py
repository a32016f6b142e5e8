"""KV pool: one [2, pages, page_size, kv_heads, head_dim] tensor per attention layer, allocated
once (e4m3 with per-head scales for an fp8 cache, kv/fp8); short-convolution layers (LFM2) hold
their fixed-size state there instead (kv/conv_state)."""

from __future__ import annotations

import torch

from noesis.kv.conv_state import ConvStatePool
from noesis.kv.fp8 import FP8, FP8LayerCache
from noesis.models.config import ModelConfig


def page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page takes across all attention layers (keys and values)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * len(config.attention_layers) * page_size * config.kv_size * elem


class KVPool:
    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int | None = None,  # sizes the conv state (default: one slot per page)
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        # One page past the allocator's range: padded rows of captured batches write here.
        self.scratch_page = num_pages
        shape = (2, num_pages + 1, page_size, config.num_kv_heads, config.head_dim)
        self.conv: ConvStatePool | None = None
        conv_layers = config.conv_layers
        if conv_layers:
            slots = min(max_num_seqs or num_pages, num_pages)
            self.conv = ConvStatePool(
                len(conv_layers),
                config.conv_kernel,
                config.hidden_size,
                slots,
                num_pages,
                dtype,
                device,
            )
        conv_states = iter(self.conv.layers if self.conv is not None else ())
        self.layers = [
            next(conv_states)
            if i in conv_layers
            else FP8LayerCache.empty(shape, device) if dtype == FP8  # scales: noesis.kv.fp8
            else torch.zeros(shape, dtype=dtype, device=device)
            for i in range(config.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        tensors = [t for t in self.layers if isinstance(t, torch.Tensor)]
        conv = self.conv.nbytes if self.conv is not None else 0
        fp8 = sum(t.nbytes for t in self.layers if isinstance(t, FP8LayerCache))
        return sum(t.numel() * t.element_size() for t in tensors) + conv + fp8
