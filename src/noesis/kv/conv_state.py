"""Short-convolution state (LFM2): each conv layer's last kernel - 1 inputs per running sequence.

The state is fixed-size and lives beside the paged KV, allocated once: one slot per sequence that
can run, plus a scratch slot that padded rows of captured batches write. A sequence takes a slot
when its prefill starts at position 0 and keeps it until it finishes or is preempted (a resumed
sequence recomputes from position 0 into a fresh slot). Layers find a sequence's slot through its
first KV page, `slot_of_page[pages[0]]`, so the step inputs (and the captured graphs' page
tables) need nothing new. A sequence that starts from cached pages would have no state for them:
prefix caching is off for these models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ConvLayerState:
    """What one conv layer reads and writes: its slots and the shared page -> slot map."""

    inputs: torch.Tensor  # [slots + 1, kernel - 1, D]: the last inputs, oldest first
    slot_of_page: torch.Tensor  # [num_pages + 1] int64


class ConvStatePool:
    def __init__(
        self,
        num_layers: int,
        kernel: int,
        hidden: int,
        num_slots: int,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.device = torch.device(device)
        # Pages not (yet) first of a running sequence map to the scratch slot: the captured
        # graphs' padded rows use the scratch page.
        self.slot_of_page = torch.full(
            (num_pages + 1,), num_slots, dtype=torch.int64, device=device
        )
        self.layers = [
            ConvLayerState(
                torch.zeros(num_slots + 1, kernel - 1, hidden, dtype=dtype, device=device),
                self.slot_of_page,
            )
            for _ in range(num_layers)
        ]
        self._free = list(range(num_slots - 1, -1, -1))
        self._owners: dict[int, tuple[object, int]] = {}  # seq_id -> (sequence, slot)

    @property
    def nbytes(self) -> int:
        return sum(s.inputs.numel() * s.inputs.element_size() for s in self.layers)

    def assign(self, scheduled) -> None:
        """Before a step's inputs are built: free the slots of sequences that finished or were
        preempted, and give one to each sequence whose prefill starts at position 0 this step
        (its first page then points at it)."""
        for seq_id, (seq, slot) in list(self._owners.items()):
            if seq.finished or not seq.pages:
                del self._owners[seq_id]
                self._free.append(slot)
        pages, slots = [], []
        for item in scheduled:
            seq = item.seq
            if seq.num_computed:
                continue
            owned = self._owners.get(seq.seq_id)
            if owned is None:
                if not self._free:
                    raise RuntimeError(f"no conv state slot is free ({self.num_slots} in all)")
                owned = self._owners[seq.seq_id] = (seq, self._free.pop())
            pages.append(seq.pages[0])
            slots.append(owned[1])
        if pages:
            pinned = self.device.type == "cuda"  # copied without waiting for the queued step
            both = torch.tensor([pages, slots], dtype=torch.int64, pin_memory=pinned)
            both = both.to(self.device, non_blocking=pinned)
            self.slot_of_page.index_copy_(0, both[0], both[1])
