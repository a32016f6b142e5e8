"""Page allocator: hands out fixed-size KV pages and counts references. No tensors here."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable


class PageAllocator:
    """A free list over `num_pages` page indices with reference counts.

    Pages are shared (refcount > 1) by prefix caching; `free` only releases a page when its last
    reference goes. A released page marked with `keep` (it holds a cached prefix) is parked in an
    LRU instead of the free list: it still counts as free, and `allocate` evicts the least recently
    released one (telling `on_evict`) only once the free list is empty.
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
        self._keep = [False] * num_pages
        self._parked: OrderedDict[int, None] = OrderedDict()  # unreferenced kept pages, LRU first
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        """Pages `allocate` can hand out: the free list plus parked (evictable) cached pages."""
        return len(self._free) + len(self._parked)

    @property
    def num_used(self) -> int:
        """Pages some sequence references."""
        return self.num_pages - self.num_free

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.page_size)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= self.num_free

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > self.num_free:
            raise MemoryError(f"asked for {num_pages} KV pages, {self.num_free} free")
        pages = [self._take() for _ in range(num_pages)]
        for page in pages:
            self._refcount[page] = 1
        return pages

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        page, _ = self._parked.popitem(last=False)
        self._keep[page] = False
        if self.on_evict is not None:
            self.on_evict(page)
        return page

    def keep(self, page: int) -> None:
        """Park `page` instead of freeing it when its last reference goes (it holds a prefix)."""
        assert self._refcount[page] > 0, f"keep of unreferenced page {page}"
        self._keep[page] = True

    def share(self, page: int) -> None:
        """Add a reference to a kept page, taking it back from the parked LRU if it was there."""
        assert self._keep[page], f"share of page {page}, which holds no cached prefix"
        if self._refcount[page] == 0:
            del self._parked[page]
        self._refcount[page] += 1

    def free(self, pages: Iterable[int]) -> None:
        for page in pages:
            assert self._refcount[page] > 0, f"double free of page {page}"
            self._refcount[page] -= 1
            if self._refcount[page] > 0:
                continue
            if self._keep[page]:
                self._parked[page] = None
            else:
                self._free.append(page)
