"""Speculative decoding: proposers guess the next tokens, one target forward verifies them.

What each module owns:
- `config`: SpeculativeConfig, the user-facing switch (method, depth, n-gram sizes, adaptive knobs).
- `proposer`: the Proposer protocol, Proposals, and NgramProposer (prompt lookup, no model).
- `verify`: the verification math on the device (greedy match, modified rejection sampling).
- `adaptive`: DepthController, the per-request depth and back-off state (pure Python).
- `draft`: DraftProposer, a draft checkpoint with its own paged KV pool and page allocator.
- `channels`: ChannelTracker, each sequence's Harmony channel, for the per-channel counters.
- `speculator`: Speculator, the engine's seam: who speculates, proposals in, outcomes booked.

Importing this package needs no torch; `proposer` and `verify` import it themselves.
"""

from __future__ import annotations

from noesis.speculative.adaptive import DepthController
from noesis.speculative.config import SpeculativeConfig

__all__ = ["DepthController", "SpeculativeConfig"]
