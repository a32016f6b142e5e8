"""Token bitmasks: filling them for a batch on a CPU worker while the forward runs, and applying
them to the logits on the device without a host sync.

Layout (llguidance's): int32 [B, ceil(V / 32)]; token t is allowed when bit t % 32 of word t // 32
is set. A row of all ones (-1) allows everything.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import torch

from noesis.kernels import ops
from noesis.structured.llguidance_backend import LLGuidanceMatcher, check_bitmask
from noesis.structured.matcher import GrammarMatcher

ALL_ALLOWED = -1


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allocate_token_bitmask(batch_size: int, vocab_size: int, pin_memory: bool = False):
    """An all-allowed host bitmask [B, W]."""
    shape = (batch_size, bitmask_width(vocab_size))
    return torch.full(shape, ALL_ALLOWED, dtype=torch.int32, pin_memory=pin_memory)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set disallowed logits to -inf in place: logits [B, V] float, bitmask [B, W] int32.

    Pure tensor ops on the logits' device (no .item(), no host sync); returns `logits`.
    """
    batch, vocab = logits.shape
    width = bitmask_width(vocab)
    if bitmask.dtype != torch.int32 or bitmask.shape != (batch, width):
        raise ValueError(
            f"bitmask must be int32 [{batch}, {width}] for logits {tuple(logits.shape)}, "
            f"got {bitmask.dtype} {tuple(bitmask.shape)}"
        )
    if ops.use_triton(logits):  # one kernel instead of unpacking [B, V] in four passes
        return ops.apply_token_bitmask_(logits, bitmask)
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    # Arithmetic shift keeps bit 31 (the sign) readable like the others.
    forbidden = ((bitmask[:, :, None] >> bits) & 1).eq(0)  # [B, W, 32]
    return logits.masked_fill_(forbidden.view(batch, -1)[:, :vocab], float("-inf"))  # [B, V]


class MaskFiller:
    """Fills the bitmask of a batch on a worker thread, into pinned host memory, while the forward
    runs; then one non-blocking copy to the device.

    `start(rows)` before the forward (one matcher or None per batch row), `result(device)` after;
    the matchers must not be advanced in between (the worker reads them). Two host buffers
    alternate so a step's copy can still be in flight when the next fill starts.
    """

    def __init__(self, vocab_size: int, max_batch_size: int, num_threads: int | None = None):
        pin = torch.cuda.is_available()
        self.vocab_size = vocab_size
        self.width = bitmask_width(vocab_size)
        self._buffers = [allocate_token_bitmask(max_batch_size, vocab_size, pin) for _ in "ab"]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self._executor = llguidance.LLExecutor(num_threads)  # fills rows in parallel, GIL released
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="noesis-mask")
        self._pending: Future[torch.Tensor | None] | None = None

    def start(self, rows: Sequence[GrammarMatcher | None]) -> None:
        if self._pending is not None:
            raise RuntimeError("MaskFiller.start called twice without result()")
        buffer = self._next_buffer(len(rows))
        self._pending = self._worker.submit(self._fill, buffer, list(rows))

    def result(self, device: torch.device | str) -> torch.Tensor | None:
        """The batch's bitmask [B, W] int32 on `device`, or None when no row has a grammar.

        On the CPU the result is the host buffer itself, valid until the next-but-one `start`.
        """
        if self._pending is None:
            raise RuntimeError("MaskFiller.result called without start()")
        pending, self._pending = self._pending, None  # reset first: a failed fill raises here
        turn, self._turn = self._turn, self._turn ^ 1
        return self._upload(pending.result(), turn, device)

    def fill(
        self, rows: Sequence[GrammarMatcher | None], device: torch.device | str
    ) -> torch.Tensor | None:
        """`start(rows)` and `result(device)` on the calling thread, with no hand-off: for a
        caller with nothing to do meanwhile (llguidance's filler still fills rows in parallel,
        the GIL released)."""
        if self._pending is not None:
            raise RuntimeError("MaskFiller.fill called between start() and result()")
        buffer = self._next_buffer(len(rows))
        turn, self._turn = self._turn, self._turn ^ 1
        return self._upload(self._fill(buffer, list(rows)), turn, device)

    def _next_buffer(self, batch: int) -> torch.Tensor:
        if batch > self._buffers[0].shape[0]:
            raise ValueError(f"batch of {batch} exceeds the filler's {self._buffers[0].shape[0]}")
        copied = self._copied[self._turn]
        if copied is not None:
            copied.synchronize()  # this buffer's copy was issued two steps ago; long done
        return self._buffers[self._turn][:batch]

    def _upload(self, mask: torch.Tensor | None, turn: int, device: torch.device | str):
        device = torch.device(device)
        if mask is None or device.type == "cpu":
            return mask
        on_device = mask.to(device, non_blocking=True)
        if device.type == "cuda":
            self._copied[turn] = torch.cuda.Event()
            self._copied[turn].record()
        return on_device

    def close(self) -> None:
        self._worker.shutdown(wait=True)

    def _fill(self, buffer: torch.Tensor, rows: list[GrammarMatcher | None]):
        if all(row is None for row in rows):
            return None
        buffer.fill_(ALL_ALLOWED)
        native = [(m.ll_matcher, i) for i, m in enumerate(rows) if isinstance(m, LLGuidanceMatcher)]
        if native:
            check_bitmask(buffer, self.width)
            self._executor.unsafe_compute_mask_ptr(
                native, buffer.data_ptr(), self.width * 4, buffer.shape[0]
            )
        for i, matcher in enumerate(rows):
            if matcher is not None and not isinstance(matcher, LLGuidanceMatcher):
                matcher.fill_next_token_bitmask(buffer, i)
        return buffer
