"""Incremental sentence/clause chunking of streamed text, so speech can start at the first clause.

A boundary is decided only once the character after the punctuation has arrived: it must be
whitespace (closing quotes and brackets may come between). That alone keeps "3.14" and "1,000"
whole; abbreviations ("e.g.", "Dr.") and single-letter initials are listed. Sentence ends split
always, clause punctuation only once the chunk has `min_clause_chars`, a newline always, and a
chunk with no punctuation at all is cut at a space past `max_chars`.
"""

from __future__ import annotations

from noesis.errors import InvalidRequest

SENTENCE_ENDS = ".!?…"
CLAUSE_ENDS = ",;:"
CLOSERS = "\"')]}”’»"
OPENERS = "\"'([{“‘«"
ABBREVIATIONS = frozenset(
    "e.g i.e etc vs mr mrs ms dr prof sr jr st mt no fig approx cf al inc ltd co corp dept est "
    "jan feb mar apr jun jul aug sep sept oct nov dec a.m p.m u.s u.k".split()
)


class TextChunker:
    """feed(delta) returns the chunks completed by `delta`; flush() returns the rest."""

    def __init__(self, min_clause_chars: int = 24, max_chars: int = 240) -> None:
        if min_clause_chars < 0 or max_chars < 1:
            raise InvalidRequest(
                f"TextChunker needs min_clause_chars >= 0 and max_chars >= 1, "
                f"got {min_clause_chars} and {max_chars}"
            )
        self.min_clause_chars = min_clause_chars
        self.max_chars = max_chars
        self._text = ""
        self._scanned = 0  # characters of _text already known not to end a chunk

    def feed(self, delta: str) -> list[str]:
        self._text += delta
        chunks = []
        while (end := self._next_boundary()) is not None:
            chunk, self._text, self._scanned = self._text[:end].strip(), self._text[end:], 0
            if chunk:
                chunks.append(chunk)
        return chunks

    def flush(self) -> list[str]:
        rest, self._text, self._scanned = self._text.strip(), "", 0
        return [rest] if rest else []

    def _next_boundary(self) -> int | None:
        """End index (exclusive) of the first complete chunk in _text, or None if none yet."""
        text = self._text
        for i in range(self._scanned, len(text)):
            char = text[i]
            if char == "\n" and text[:i].strip():
                return i + 1
            if char in SENTENCE_ENDS or char in CLAUSE_ENDS:
                end = _after_closers(text, i + 1)
                if end == len(text):
                    self._scanned = i  # the next character decides
                    return None
                if text[end].isspace() and self._splits_at(text, i, end):
                    return end
            if i >= self.max_chars and char.isspace() and text[:i].strip():
                return i
        self._scanned = len(text)
        return None

    def _splits_at(self, text: str, index: int, end: int) -> bool:
        chunk, word = text[:end].strip(), _word_before(text, index)
        if text[index] in CLAUSE_ENDS:
            return len(chunk) >= self.min_clause_chars
        if text[index] == "." and _is_abbreviation(word):
            return False
        return not (word.isdigit() and chunk == word + ".")  # "2." alone is a list marker


def split_clauses(text: str) -> list[str]:
    """Every clause of a whole text, each with its punctuation (no minimum length)."""
    chunker = TextChunker(min_clause_chars=0, max_chars=10**9)
    return chunker.feed(text) + chunker.flush()


def _after_closers(text: str, index: int) -> int:
    while index < len(text) and (text[index] in CLOSERS or text[index] in SENTENCE_ENDS):
        index += 1
    return index


def _word_before(text: str, index: int) -> str:
    start = index
    while start > 0 and not text[start - 1].isspace():
        start -= 1
    return text[start:index].lstrip(OPENERS)


def _is_abbreviation(word: str) -> bool:
    lowered = word.lower()
    return lowered in ABBREVIATIONS or (len(word) == 1 and word.isalpha())
