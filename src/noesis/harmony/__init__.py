"""Harmony, gpt-oss's chat format: render conversations to token ids over the bundled tokenizer or
o200k_harmony, and parse a model's Harmony output leniently, one token at a time."""

from noesis.harmony.encoding import HarmonyEncoding, UnsupportedTokenizer
from noesis.harmony.layout import GPT_OSS, NOESIS_TINY, FunctionTool, Layout, SystemConfig
from noesis.harmony.messages import Message, from_openai
from noesis.harmony.parser import (
    ContentDelta,
    HarmonyStreamParser,
    MessageEnd,
    MessageStart,
    ParsedMessage,
    ParsedTurn,
    ParseIssue,
    ToolCall,
    parse_completion,
    parse_text,
)
from noesis.harmony.vocab import VocabularyMissing, prepare_offline

__all__ = [
    "GPT_OSS",
    "NOESIS_TINY",
    "ContentDelta",
    "FunctionTool",
    "HarmonyEncoding",
    "HarmonyStreamParser",
    "Layout",
    "Message",
    "MessageEnd",
    "MessageStart",
    "ParseIssue",
    "ParsedMessage",
    "ParsedTurn",
    "SystemConfig",
    "ToolCall",
    "UnsupportedTokenizer",
    "VocabularyMissing",
    "from_openai",
    "parse_completion",
    "parse_text",
    "prepare_offline",
]
