"""The cold load's read bucket: checkpoint bytes brought into memory, timed apart from placing them.

Checkpoints are memory-mapped (safetensors and GGUF alike), so a tensor's bytes leave the disk (or
the page cache) only when something first touches them: left alone, that happens inside the copy
that converts and places the tensor, and the two costs cannot be told apart. `ReadClock` touches
one byte of every page first and times it; the copy that follows finds the pages mapped. The work
moves, it is not repeated: the page faults are taken here instead of in the copy.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

PAGE_BYTES = 4096  # the smallest page: one touch per page faults every page of a mapping in
Named = tuple[str, torch.Tensor]


class ReadClock:
    """Seconds spent reading checkpoint tensors into memory (`seconds`), over one load."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def read(self, tensor: torch.Tensor) -> None:
        """Read `tensor`'s pages (it views a mapped file) into memory, booking the time here."""
        start = time.perf_counter()
        _touch(tensor)
        self.seconds += time.perf_counter() - start

    def tensors(self, named: Iterator[Named]) -> Iterator[Named]:
        """`named`'s (name, tensor) pairs, each read into memory as it comes; the reader's own
        next() is booked too (a reader that copies out of the mapping reads there)."""
        while True:
            start = time.perf_counter()
            pair = next(named, None)
            if pair is not None:
                _touch(pair[1])
            self.seconds += time.perf_counter() - start
            if pair is None:
                return
            yield pair


def _touch(tensor: torch.Tensor) -> None:
    if not tensor.numel():
        return
    data = tensor.reshape(-1).view(torch.uint8)  # a view: a mapped tensor is contiguous
    data[::PAGE_BYTES].max()
    data[-1].item()  # the last page, which a stride from the first byte can miss
