"""LLM: the offline Python API (generate, chat, stream) over one Engine."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from noesis.engine.engine import Engine, EngineConfig
from noesis.engine.outputs import RequestOutput
from noesis.errors import InvalidRequest
from noesis.harmony.parser import parse_completion
from noesis.sampling.params import SamplingParams
from noesis.session import AssistantTurn, Session
from noesis.session import ToolCall as SessionToolCall
from noesis.tools import ToolExecutor
from noesis.turns import harmony_encoding, new_call_id, turn_params

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """Load a checkpoint once and generate from it.

    >>> llm = LLM("path/to/checkpoint", device="cpu", dtype="float32")
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].text
    """

    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", **options: Any):
        try:
            config = EngineConfig(device=device, dtype=dtype, **options)
        except TypeError as exc:
            raise InvalidRequest(f"unknown LLM option: {exc}") from exc
        self.engine = Engine(model, config)
        self.tokenizer = self.engine.tokenizer

    @property
    def model_config(self):
        return self.engine.loaded.config

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run all prompts batched through the scheduler; outputs come back in prompt order."""
        prompts = _as_prompt_list(prompts)
        params_list = _as_params_list(params, len(prompts))
        ids = self._add_all(prompts, params_list)
        return self._run_to_completion(ids, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        params: SamplingParams | None = None,
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ):
        """Apply the checkpoint's chat template; one conversation in, one output out (or lists)."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        prompts = [
            self.render_chat(c, tools, add_generation_prompt, **template_kwargs)
            for c in conversations
        ]
        outputs = self.generate(prompts, params)
        return outputs[0] if single else outputs

    def generate_turn(
        self,
        messages: list[Message],
        tools: list[dict] | None = None,
        *,
        tool_choice: str | dict = "auto",
        deterministic: bool = False,
        cancel: threading.Event | None = None,
        params: SamplingParams | None = None,
        response_format: dict | None = None,
        constrained: bool = True,
    ) -> AssistantTurn:
        """One assistant turn of a Harmony model, parsed: analysis, tool calls or a final answer.

        With `constrained` (the default) the sampler can only produce a well-formed turn: tool
        arguments valid for the tool's JSON schema, the final free of tool syntax, the final in
        `response_format` when given. `deterministic` means greedy with seed 0. Setting `cancel`
        aborts the generation (finish_reason "cancelled")."""
        encoding = self.harmony
        if encoding is None:
            raise InvalidRequest("generate_turn needs a Harmony model (this tokenizer has no "
                                 "<|start|>/<|channel|>/<|message|> tokens); use chat() instead")
        base = params or SamplingParams(max_tokens=1024)
        if deterministic:
            base = dataclasses.replace(base, temperature=0.0, seed=0)
        prompt = self.render_chat(messages, tools)
        turn = turn_params(base, encoding, tools, tool_choice, response_format, constrained,
                           messages)
        (out,) = self._run_to_completion(self._add_all([prompt], [turn]), False, cancel)
        parsed = parse_completion(encoding, out.token_ids)
        calls = [SessionToolCall(new_call_id(), c.name, c.arguments) for c in parsed.tool_calls]
        finish = "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason
        return AssistantTurn(parsed.analysis, calls, parsed.final, len(prompt),
                             len(out.token_ids), "cancelled" if finish == "abort" else finish)

    def session(self, **options: Any) -> Session:
        """A Session over this model: `session.generate(messages, tools=[...])` runs the tool
        loop to a final answer. Options go to Session (max_tool_rounds) and to its ToolExecutor
        (max_concurrency, timeout_s, retry)."""
        executor_options = {k: options.pop(k) for k in ("max_concurrency", "timeout_s", "retry")
                            if k in options}
        return Session(self, executor=ToolExecutor(**executor_options), **options)

    @functools.cached_property
    def harmony(self):
        """The tokenizer's Harmony encoding (None: the model has no Harmony tokens)."""
        return harmony_encoding(self.tokenizer)

    def render_chat(
        self,
        messages: list[Message],
        tools: list[dict] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> list[int]:
        """Prompt ids of a conversation through the chat template, with any BOS it writes. Only
        the template writes control tokens: the messages' strings are text (encode_chat)."""
        if not messages:
            raise InvalidRequest("messages is empty")
        return self.tokenizer.encode_chat(messages, tools, add_generation_prompt, **template_kwargs)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas as they are decoded; closing the iterator aborts the request."""
        request_id = self.engine.add_request(prompt, params)
        sent = 0
        finished = False
        try:
            while not finished:
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    if len(out.text) > sent:
                        yield out.text[sent:]
                        sent = len(out.text)
                    finished = out.finished
        finally:
            if not finished:
                self.engine.abort(request_id)

    def _add_all(self, prompts: list[Prompt], params_list: list[SamplingParams]) -> list[str]:
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list, strict=True):
                ids.append(self.engine.add_request(prompt, params, stream=False))
        except Exception:
            for request_id in ids:  # all or nothing: leave no half-added batch behind
                self.engine.abort(request_id)
            raise
        return ids

    def _run_to_completion(
        self, ids: list[str], use_tqdm: bool, cancel: threading.Event | None = None
    ) -> list[RequestOutput]:
        """Step until every request finishes; once `cancel` is set, the rest are aborted (their
        outputs say "abort")."""
        results: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Generating", disable=not use_tqdm)
        try:
            while len(results) < len(ids):
                if cancel is not None and cancel.is_set():
                    for request_id in wanted - results.keys():
                        results[request_id] = self.engine.abort(request_id)
                    break
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for request_id in wanted - results.keys():
                self.engine.abort(request_id)
            raise
        finally:
            bar.close()
        return [results[request_id] for request_id in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidRequest("prompts must be a string, a list of token ids, or a non-empty list")
    return list(prompts)


def _as_params_list(params, count: int) -> list[SamplingParams]:
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    params = list(params)
    if len(params) != count:
        raise InvalidRequest(f"got {len(params)} SamplingParams for {count} prompts")
    return params
