"""RequestOutput: what a caller gets back for one request: complete, so far, or (for a request
added with delta=True) only what is new since its previous output."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    logprobs: list[dict[int, float]] | None  # one dict per generated token when asked
    finished: bool
    num_preemptions: int = 0
    error: str | None = None  # why it ended, when finish_reason is "error"


def merge_deltas(deltas: list[RequestOutput]) -> RequestOutput:
    """Consecutive delta outputs of one request, oldest first -> one delta covering them all."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    logprobs = None
    if last.logprobs is not None:
        logprobs = [entry for delta in deltas for entry in delta.logprobs or ()]
    return RequestOutput(
        request_id=last.request_id,
        prompt=last.prompt,
        prompt_token_ids=last.prompt_token_ids,
        text="".join(delta.text for delta in deltas),
        token_ids=[token for delta in deltas for token in delta.token_ids],
        finish_reason=last.finish_reason,
        logprobs=logprobs,
        finished=last.finished,
        num_preemptions=last.num_preemptions,
        error=last.error,
    )
