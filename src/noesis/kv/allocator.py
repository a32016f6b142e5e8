"""Page allocator: hands out fixed-size KV pages and counts references. No tensors here."""

from __future__ import annotations

from collections import deque


class PageAllocator:
    """A free list over `num_pages` page indices with reference counts.

    Pages are shared (refcount > 1) once prefix caching lands; `free` only returns a page to the
    free list when its last reference goes.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(
                f"num_pages and page_size must be positive, got {num_pages}, {page_size}"
            )
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._refcount = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            raise MemoryError(f"asked for {num_pages} KV pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(num_pages)]
        for page in pages:
            self._refcount[page] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        for page in pages:
            assert self._refcount[page] > 0, f"double free of page {page}"
            self._refcount[page] -= 1
            if self._refcount[page] == 0:
                self._free.append(page)
