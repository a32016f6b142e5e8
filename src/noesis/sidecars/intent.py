"""The intent sidecar: guesses the tool a turn will call from the conversation's last user message
and, when the turn ends, scores the guess against the call the model made.

The classifier is the voice router's (noesis.voice.router: hashed n-grams and an MLP over the
built-in tools' tasks; models/noesis-router is bundled). It reads a "turn" window (the request's
last user message and declared tools, shown as the request is admitted). A guess that names a
declared tool with p >= threshold becomes the decision "predict:NAME". The request's final output
window then yields "hit" (the predicted tool was called), "miss" (it was not) or "unpredicted" (a
tool was called with nothing predicted).

A confident guess is also handed to the turn's `on_intent` (the Session's ToolExecutor.warm):
an isolated tool gets its worker process started and its module imported while the turn is
still decoding, so that its call does not wait for them. The tool's argument grammar is not
prefetched: a call's arguments are constrained by the whole turn's grammar, compiled before the
request starts with every declared schema inline, so no decode path would use a grammar compiled
for one call. That waits for a per-call grammar swapped in at the tool header.
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path

from noesis.errors import ConfigError
from noesis.sidecars.runtime import Cadence, Placement, Window
from noesis.structured.harmony_grammar import tool_schemas
from noesis.voice.router import Router

log = logging.getLogger(__name__)

PREDICT = "predict:"  # a decision "predict:NAME": the turn is expected to call NAME
# A call as an output's text shows it: Harmony's `to=functions.NAME` header, or the text
# dialects' `{"name": "NAME", ...}` (Hermes, Llama 3 JSON, Mistral).
CALL = re.compile(r'(?:to=functions\.|"name"\s*:\s*")([A-Za-z0-9_-]{1,64})')
MAX_PENDING = 1024  # turns awaiting their outcome; older ones (aborted, dropped) are forgotten


@dataclass(frozen=True, slots=True)
class Intent:
    """The router's guess for one turn; `confident`: a declared tool at p >= threshold."""

    tool: str
    p: float
    confident: bool

    def __str__(self) -> str:
        return f"{self.tool} (p={self.p:.2f}){'' if self.confident else ', not predicted'}"


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the turn did against what was predicted for it."""

    predicted: str | None
    called: str | None

    def __str__(self) -> str:
        return f"predicted {self.predicted}, called {self.called}"


class IntentSidecar:
    """Turn windows in, Intents out ("predict:NAME" at p >= threshold for a declared tool);
    final windows in, Outcomes out ("hit", "miss", "unpredicted")."""

    name = "intent"

    def __init__(self, router: Router, threshold: float = 0.5, policy: str = "open",
                 cadence: Cadence | None = None, placement: Placement | None = None) -> None:
        if not 0.0 < threshold <= 1.0:
            raise ConfigError(f"intent threshold must be in (0, 1], got {threshold!r}")
        self.cadence = cadence or Cadence("turn")
        if self.cadence.kind != "turn":
            raise ConfigError(f"the intent sidecar reads turns: its cadence must be 'turn', "
                              f"got {self.cadence.kind!r}")
        self.router = router
        self.threshold = threshold
        self.policy = policy
        self.placement = placement or Placement()
        # request id -> (the predicted tool or None, the declared tool names)
        self._pending: dict[str, tuple[str | None, frozenset[str]]] = {}
        self._lock = threading.Lock()  # workers > 1 share `_pending`

    @classmethod
    def load(cls, path: str | Path, **options) -> IntentSidecar:
        return cls(Router.load(path), **options)

    def run(self, window: Window) -> Intent | Outcome | None:
        return self._outcome(window) if window.final else self.predict(window)

    def predict(self, window: Window) -> Intent:
        """The router's tool for the window's user message, confident when it is declared and
        likely enough; remembered for the turn's outcome, and told to the window's `on_intent`
        when confident."""
        tool, p = self.router.predict(window.text)
        schemas = tool_schemas(list(window.tools))  # name -> parameters; GrammarError if bad
        confident = tool in schemas and p >= self.threshold
        with self._lock:
            self._pending[window.request_id] = (tool if confident else None, frozenset(schemas))
            while len(self._pending) > MAX_PENDING:
                del self._pending[next(iter(self._pending))]
        if confident and window.on_intent is not None:
            try:
                window.on_intent(tool)
            except Exception:  # the caller's hook: its failure is not the prediction's
                log.warning("the on_intent hook of %s failed", window.request_id, exc_info=True)
        return Intent(tool, p, confident)

    def _outcome(self, window: Window) -> Outcome | None:
        """The first declared tool the output calls, against the prediction (None: the request
        had no turn window, or its guess was forgotten)."""
        with self._lock:
            pending = self._pending.pop(window.request_id, None)
        if pending is None:
            return None
        predicted, declared = pending
        calls = (m.group(1) for m in CALL.finditer(window.context))
        return Outcome(predicted, next((name for name in calls if name in declared), None))

    def decide(self, value: Intent | Outcome | None) -> str | None:
        if isinstance(value, Intent):
            return PREDICT + value.tool if value.confident else None
        if value is None or (value.predicted is None and value.called is None):
            return None
        if value.predicted is None:
            return "unpredicted"
        return "hit" if value.predicted == value.called else "miss"
