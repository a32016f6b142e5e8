"""RequestOutput: what a caller gets back for one request, complete or so far."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    logprobs: list[dict[int, float]] | None  # one dict per generated token when asked
    finished: bool
    num_preemptions: int = 0
