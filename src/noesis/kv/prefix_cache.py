"""Prefix cache: finds KV pages by chained hashes of full pages so requests reuse a shared prefix.

A page's hash covers its own tokens and, through its parent's hash, every token before it: equal
hashes mean equal prefixes, so a match never needs the tokens again. Pages are refcounted by the
allocator; a cached page nobody references stays parked there (evictable, least recently released
first) until the pool runs dry. Pure Python: no tensors, no torch.
"""

from __future__ import annotations

import hashlib
from array import array
from typing import TYPE_CHECKING

from noesis.kv.allocator import PageAllocator

if TYPE_CHECKING:
    from noesis.planner.sequence import Sequence

ROOT_HASH = b""


def chain_hashes(token_ids: list[int], page_size: int, hashes: list[bytes], num_pages: int):
    """Extend `hashes` (of the first full pages of `token_ids`) to `num_pages` pages, in place."""
    while len(hashes) < num_pages:
        start = len(hashes) * page_size
        parent = hashes[-1] if hashes else ROOT_HASH
        tokens = array("q", token_ids[start : start + page_size]).tobytes()
        hashes.append(hashlib.blake2b(parent + tokens, digest_size=16).digest())
    return hashes


class PrefixCache:
    def __init__(self, allocator: PageAllocator) -> None:
        self.allocator = allocator
        self.page_size = allocator.page_size
        self._page_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        allocator.on_evict = self._forget
        self.query_tokens = 0  # tokens of admitted sequences looked up
        self.hit_tokens = 0  # of those, tokens found cached (their prefill skipped)

    @property
    def num_pages(self) -> int:
        """Pages holding a cached prefix, referenced or parked."""
        return len(self._hash_of)

    def attach(self, seq: Sequence) -> None:
        """Start a page-less `seq` on the cached pages of its longest cached prefix.

        The last token is never taken from the cache: computing it yields the logits to sample.
        """
        assert not seq.pages and seq.num_computed == 0, "attach needs a sequence without pages"
        usable = (len(seq.token_ids) - 1) // self.page_size
        hashes = chain_hashes(seq.token_ids, self.page_size, seq.page_hashes, usable)
        for page_hash in hashes[:usable]:
            page = self._page_of.get(page_hash)
            if page is None:
                break
            self.allocator.share(page)
            seq.pages.append(page)
        seq.num_cached_pages = len(seq.pages)
        seq.num_computed = len(seq.pages) * self.page_size

    def record_admission(self, seq: Sequence) -> None:
        self.query_tokens += len(seq.token_ids)
        self.hit_tokens += seq.num_computed
        if not seq.num_preemptions:  # a re-admission finds the pages it cached itself
            seq.num_cached_tokens = seq.num_computed

    def commit(self, seq: Sequence) -> None:
        """Cache the pages `seq` has filled and computed since the last call."""
        full = seq.num_computed // self.page_size
        if full <= seq.num_cached_pages:
            return
        hashes = chain_hashes(seq.token_ids, self.page_size, seq.page_hashes, full)
        for index in range(seq.num_cached_pages, full):
            self._insert(hashes[index], seq.pages[index])
        seq.num_cached_pages = full

    def _insert(self, page_hash: bytes, page: int) -> None:
        if page_hash in self._page_of or page in self._hash_of:
            return  # an equal prefix computed concurrently is cached already: keep that one
        self._page_of[page_hash] = page
        self._hash_of[page] = page_hash
        self.allocator.keep(page)

    def _forget(self, page: int) -> None:
        del self._page_of[self._hash_of.pop(page)]
