"""Tool-call and reasoning dialects of the model families: detected from the chat template and
vocabulary (or named), each with a streaming parser and a turn grammar. TurnFormat is the one
entry point the LLM, Session and the server use."""

from noesis.dialects.grammar import TurnOptions
from noesis.dialects.spec import DIALECTS, HARMONY, NAMES, Dialect, detect, dialect_named
from noesis.dialects.turn import NO_TOOL_SYNTAX, TurnFormat

__all__ = [
    "DIALECTS",
    "HARMONY",
    "NAMES",
    "NO_TOOL_SYNTAX",
    "Dialect",
    "TurnFormat",
    "TurnOptions",
    "detect",
    "dialect_named",
]
