"""KV cache: the page allocator (pure Python) and the per-layer page tensors."""
