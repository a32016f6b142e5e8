"""RequestOutput: what a caller gets back for one request: complete, so far, or (for a request
added with delta=True) only what is new since its previous output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from noesis.sampling.metrics import TokenMetrics
    from noesis.telemetry.recorder import RequestMetrics


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | "content_filter" | "pruned"
    logprobs: list[dict[int, float]] | None  # one dict per generated token when asked
    finished: bool
    num_preemptions: int = 0
    error: str | None = None  # why it ended, when finish_reason is "error"
    # Prompt tokens whose KV came from the prefix cache (their prefill skipped), as OpenAI's
    # usage.prompt_tokens_details.cached_tokens; 0 without prefix caching.
    num_cached_tokens: int = 0
    # Speculative decoding, totals so far (delta outputs too): proposed tokens verified, and
    # those the target accepted. 0 when speculation is off or never ran for this request.
    spec_proposed: int = 0
    spec_accepted: int = 0
    # Telemetry (EngineConfig.telemetry): times, steps, device time, verify rate and the
    # control plane's per-token signals so far; None when telemetry is off.
    metrics: RequestMetrics | None = None
    # SamplingParams(metrics=True): per generated token, the uncertainty of the distribution it
    # was sampled from (noesis.sampling.metrics.TokenMetrics); None for tokens accepted from
    # speculative proposals. None when not asked.
    token_metrics: list[TokenMetrics | None] | None = None
    delta: bool = False  # text and token_ids are what is new since the request's last output
    filter_reason: str | None = None  # why a sidecar blocked it (finish_reason "content_filter")
    # SamplingParams(prompt_logprobs=k): per prompt token, its top-k and its own logprob under
    # the model's distribution at the position before it; None for the first token. A delta
    # output carries it only in the request's first output.
    prompt_logprobs: list[dict[int, float] | None] | None = None


def merge_deltas(deltas: list[RequestOutput]) -> RequestOutput:
    """Consecutive delta outputs of one request, oldest first -> one delta covering them all."""
    if len(deltas) == 1:
        return deltas[0]
    last = deltas[-1]
    logprobs = None
    if last.logprobs is not None:
        logprobs = [entry for delta in deltas for entry in delta.logprobs or ()]
    token_metrics = None
    if last.token_metrics is not None:
        token_metrics = [entry for delta in deltas for entry in delta.token_metrics or ()]
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
        num_cached_tokens=last.num_cached_tokens,
        spec_proposed=last.spec_proposed,
        spec_accepted=last.spec_accepted,
        metrics=last.metrics,
        token_metrics=token_metrics,
        delta=last.delta,
        filter_reason=last.filter_reason,
        prompt_logprobs=deltas[0].prompt_logprobs,
    )


def best_of(outputs: list[RequestOutput], choices: int, n: int) -> list[RequestOutput]:
    """Of each prompt's `choices` generations (consecutive in `outputs`), the n with the
    highest cumulative logprob, best first; branches the binding gate pruned never count."""
    kept = []
    for start in range(0, len(outputs), choices):
        # The gate prunes at most choices - n of them: n always remain
        group = [out for out in outputs[start : start + choices] if out.finish_reason != "pruned"]
        group.sort(key=lambda out: -sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs,
                                                               strict=True)))
        kept += group[:n]
    return kept
