"""Constrained decoding: grammar specs compiled once per tokenizer, per-request matchers, and the
token bitmask applied to the logits on the device before sampling.

The names load lazily: the scheduler imports `noesis.structured.matcher` (specs and the protocol)
and must not pull in torch or llguidance with it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "MaskFiller": "bitmask",
    "allocate_token_bitmask": "bitmask",
    "apply_token_bitmask_": "bitmask",
    "bitmask_width": "bitmask",
    "CompiledGrammar": "llguidance_backend",
    "GrammarCompiler": "llguidance_backend",
    "GrammarLimits": "llguidance_backend",
    "LLGuidanceMatcher": "llguidance_backend",
    "GrammarError": "matcher",
    "GrammarMatcher": "matcher",
    "GrammarSpec": "matcher",
    "GrammarTooComplex": "matcher",
    "UnsatisfiableSchema": "matcher",
    "UnsupportedSchema": "matcher",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'noesis.structured' has no attribute {name!r}")
    return getattr(importlib.import_module(f"noesis.structured.{module}"), name)
