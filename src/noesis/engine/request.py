"""RequestState: the host-side half of a request: detokenized text, stop strings, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from noesis.engine.outputs import RequestOutput
from noesis.planner.sequence import Sequence
from noesis.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from noesis.sampling.metrics import TokenMetrics
    from noesis.telemetry.recorder import RequestMetrics


@dataclass(slots=True)
class RequestState:
    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    stream: bool = True  # report progress every step, not only at the end
    delta: bool = False  # each output carries only what is new since the last one
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    # SamplingParams.prompt_logprobs: per prompt token (None for the first), as prefill scores them
    prompt_logprobs: list[dict[int, float] | None] | None = None
    hold_back: int = field(init=False)  # chars kept from streams: a stop string may be forming
    prompt_token_ids: list[int] = field(init=False)  # copied once; outputs share it
    sent_chars: int = 0  # delta mode: text and tokens already handed out
    sent_tokens: int = 0
    error: str | None = None  # set when a failure of this request alone ended it
    filter_reason: str | None = None  # set when a sidecar's "block" ended it
    metrics: RequestMetrics | None = None  # telemetry on: updated as its steps are read back
    token_metrics: list[TokenMetrics | None] | None = None  # SamplingParams.metrics: per token

    def __post_init__(self) -> None:
        stops = self.seq.params.stop
        self.hold_back = max((len(s) for s in stops), default=1) - 1
        self.prompt_token_ids = self.seq.token_ids[: self.seq.prompt_len]

    @property
    def incremental(self) -> bool:
        """Whether text must be decoded token by token: streamed, or watched for stop strings."""
        return self.stream or bool(self.seq.params.stop)

    def append_text(self, delta: str) -> bool:
        """Add decoded text; returns True when a stop string ended the request (text trimmed)."""
        if not delta:
            return False
        start = max(0, len(self.text) - self.hold_back)
        self.text += delta
        hit = _find_stop(self.text, self.seq.params.stop, start)
        if hit is None:
            return False
        index, stop = hit
        keep = index + len(stop) if self.seq.params.include_stop_str_in_output else index
        self.text = self.text[:keep]
        return True

    def visible_len(self) -> int:
        """Chars safe to show now: all once finished, else minus a possible stop prefix."""
        if self.seq.finished or self.hold_back == 0:
            return len(self.text)
        return max(0, len(self.text) - self.hold_back)

    def output(self) -> RequestOutput:
        """Everything so far, or (delta mode) what is new since the last output: no output
        copies the prompt, and a delta copies only its own tokens."""
        seq = self.seq
        chars, tokens = self.visible_len(), len(seq.token_ids) - seq.prompt_len  # pending ones not
        start_chars, start_tokens = (self.sent_chars, self.sent_tokens) if self.delta else (0, 0)
        self.sent_chars, self.sent_tokens = max(self.sent_chars, chars), tokens
        return RequestOutput(
            request_id=seq.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            text=self.text[start_chars:chars],
            token_ids=seq.token_ids[seq.prompt_len + start_tokens :],
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            logprobs=self.logprobs[start_tokens:] if self.logprobs is not None else None,
            finished=seq.finished,
            num_preemptions=seq.num_preemptions,
            error=self.error,
            num_cached_tokens=seq.num_cached_tokens,
            spec_proposed=seq.spec_proposed,
            spec_accepted=seq.spec_accepted,
            metrics=self.metrics.copy() if self.metrics is not None else None,
            token_metrics=(
                self.token_metrics[start_tokens:] if self.token_metrics is not None else None
            ),
            delta=self.delta,
            filter_reason=self.filter_reason,
            # shared, not copied: complete before the first token; a delta carries it once
            prompt_logprobs=self.prompt_logprobs if start_tokens == 0 else None,
        )


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    best = None
    for stop in stops:
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
