"""KV pool: one [2, pages, page_size, kv_heads, head_dim] tensor per layer, allocated once."""

from __future__ import annotations

import torch

from noesis.models.config import ModelConfig


def page_bytes(config: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes one page takes across all layers (keys and values)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_layers * page_size * config.kv_size * elem


class KVPool:
    def __init__(
        self,
        config: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        # One page past the allocator's range: padded rows of captured batches write here.
        self.scratch_page = num_pages
        shape = (2, num_pages + 1, page_size, config.num_kv_heads, config.head_dim)
        self.layers = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)
