"""RequestState: the host-side half of a request: detokenized text, stop strings, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from noesis.engine.outputs import RequestOutput
from noesis.engine.sequence import Sequence
from noesis.tokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class RequestState:
    seq: Sequence
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    stream: bool = True  # report progress every step, not only at the end
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    hold_back: int = field(init=False)  # chars kept from streams: a stop string may be forming

    def __post_init__(self) -> None:
        stops = self.seq.params.stop
        self.hold_back = max((len(s) for s in stops), default=1) - 1

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

    def visible_text(self) -> str:
        """Text safe to show now: all of it once finished, else minus a possible stop prefix."""
        if self.seq.finished or self.hold_back == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.hold_back)]

    def output(self) -> RequestOutput:
        seq = self.seq
        return RequestOutput(
            request_id=seq.request_id,
            prompt=self.prompt,
            prompt_token_ids=seq.token_ids[: seq.prompt_len],
            text=self.visible_text(),
            token_ids=seq.output_ids,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            logprobs=self.logprobs,
            finished=seq.finished,
            num_preemptions=seq.num_preemptions,
        )


def _find_stop(text: str, stops: tuple[str, ...], start: int) -> tuple[int, str] | None:
    best = None
    for stop in stops:
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    return best
