"""LLM: the offline Python API (generate, chat, stream) over one Engine."""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable, Generator, Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from noesis.dialects import TurnFormat, TurnOptions
from noesis.engine.engine import Engine, EngineConfig
from noesis.engine.outputs import RequestOutput
from noesis.errors import InvalidRequest
from noesis.harmony.parser import ParsedTurn
from noesis.models.capabilities import check_messages
from noesis.sampling.defaults import generation_defaults
from noesis.sampling.params import SamplingParams
from noesis.session import AssistantTurn, Session, Tokens, TurnRequest
from noesis.session import ToolCall as SessionToolCall
from noesis.tools import ToolExecutor
from noesis.turns import harmony_encoding, new_call_id

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """Load a checkpoint once and generate from it.

    >>> llm = LLM("path/to/checkpoint", device="cpu", dtype="float32")
    >>> llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].text
    """

    def __init__(
        self,
        model: str,
        device: str = "auto",
        dtype: str = "auto",
        *,
        tool_dialect: str | None = None,
        chat_template: str | None = None,
        **options: Any,
    ):
        """`tool_dialect` names the tool-call format (noesis.dialects.NAMES) where the template
        does not show it; `chat_template` (Jinja text) replaces the checkpoint's template.
        `control="default"` (or a noesis.control.ControlPolicy) moves every sampled request's
        temperature and top_p per token, and steers this LLM's sessions (tool_choice too);
        SamplingParams(control=False) opts a request out. `capabilities=("text",)` (the
        default) loads a vision-language checkpoint's text model alone; a conversation holding
        an image or audio part is then an InvalidRequest. Other options: EngineConfig's."""
        try:
            config = EngineConfig(device=device, dtype=dtype, **options)
        except TypeError as exc:
            raise InvalidRequest(f"unknown LLM option: {exc}") from exc
        self.engine = Engine(model, config)
        self.tokenizer = self.engine.tokenizer
        if chat_template is not None:
            self.tokenizer.set_chat_template(chat_template)
        self.tool_dialect = tool_dialect
        if tool_dialect is not None:
            self.turn_format  # noqa: B018 - an unknown name fails here, not at the first turn

    @property
    def model_config(self):
        return self.engine.loaded.config

    def get_default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams with the checkpoint's recommended temperature, top_p, top_k and
        repetition_penalty (generation_config.json), then `overrides`. A plain SamplingParams()
        keeps noesis's own defaults whatever the checkpoint says, as it always did."""
        return SamplingParams(**{**generation_defaults(self.engine.loaded.model_dir), **overrides})

    @property
    def control(self):
        """The control policy (LLM(control=...)): a name, a ControlPolicy, or None (off)."""
        control = self.engine.config.control
        return None if control == "none" else control

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

    def embed(self, texts: Prompt | Sequence[Prompt], pooling: str = "last") -> list[list[float]]:
        """Unit-length embeddings of texts (or token-id lists): the model's final hidden state
        at the last token ("last") or averaged over the tokens ("mean")."""
        prompts = _as_prompt_list(texts)
        return self.engine.embed(prompts, pooling).tolist()

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
        grounded: bool = True,
        parallel_tool_calls: bool = True,
        thinking_budget: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        control: bool = True,
        on_intent: Callable[[str], Any] | None = None,
    ) -> AssistantTurn:
        """One assistant turn, parsed: analysis (reasoning), tool calls or a final answer, in
        the model's own format (Harmony, or a text dialect: noesis.dialects).

        With `constrained` (the default) the sampler can only produce a well-formed turn: tool
        arguments valid for the tool's JSON schema, the final free of tool syntax, the final in
        `response_format` when given; `grounded` arguments copy the user's words (off: their
        plain schema). `parallel_tool_calls=False` allows one call per turn; `thinking_budget`
        bounds a text dialect's `<think>` reasoning in tokens. `chat_template_kwargs` go to the
        template (enable_thinking, documents, ...). `deterministic` means greedy with seed 0.
        `control=False` keeps this LLM's control plane off the turn (SamplingParams.control).
        `on_intent` is called (on a sidecar thread, while the turn decodes) with the tool the
        intent sidecar predicts the turn will call, if one runs (`predicts_tools`): Session
        passes its ToolExecutor.warm. Setting `cancel` aborts the generation (finish_reason
        "cancelled")."""
        prompt, turn = self._turn_inputs(
            messages, tools, tool_choice, deterministic, params, response_format, constrained,
            grounded, parallel_tool_calls, thinking_budget, chat_template_kwargs, control,
        )  # fmt: skip
        ids = self._add_all([prompt], [turn])
        self.engine.show_turn(ids[0], messages, tools, on_intent)  # the intent sidecar's guess
        (out,) = self._run_to_completion(ids, False, cancel)
        parsed = self._turn_format_for_turns().parse(out.token_ids, prompt)
        return _assistant_turn(parsed, prompt, out.token_ids, out.finish_reason, out.token_metrics)

    @property
    def predicts_tools(self) -> bool:
        """Whether an intent sidecar runs (a `[sidecars.intent]` table): the turn methods'
        `on_intent` is then called with the tool it predicts."""
        sidecars = self.engine.sidecars
        return sidecars is not None and "intent" in sidecars.lanes

    def generate_turns(
        self, requests: Sequence[TurnRequest], cancel: threading.Event | None = None
    ) -> list[AssistantTurn]:
        """generate_turn for many conversations at once, batched (noesis.session.TurnRequest:
        its options are generate_turn's keyword options)."""
        inputs = [
            self._turn_inputs(r.messages, r.tools, r.tool_choice, r.deterministic, **r.options)
            for r in requests
        ]
        ids = self._add_all([prompt for prompt, _ in inputs], [turn for _, turn in inputs])
        for request_id, r in zip(ids, requests, strict=True):
            self.engine.show_turn(request_id, r.messages, r.tools, r.on_intent)
        outputs = self._run_to_completion(ids, False, cancel)
        fmt = self._turn_format_for_turns()
        return [
            _assistant_turn(
                fmt.parse(out.token_ids, prompt), prompt, out.token_ids, out.finish_reason,
                out.token_metrics,
            )
            for (prompt, _), out in zip(inputs, outputs, strict=True)
        ]

    def stream_turn(
        self,
        messages: list[Message],
        tools: list[dict] | None = None,
        *,
        tool_choice: str | dict = "auto",
        deterministic: bool = False,
        cancel: threading.Event | None = None,
        on_intent: Callable[[str], Any] | None = None,
        **options: Any,
    ) -> Generator[Any, None, AssistantTurn]:
        """generate_turn, streamed: yields Tokens and the parser events they complete (Harmony's
        event types, for every dialect), and returns the AssistantTurn. A Harmony turn ends once
        its final answer closes (what a model runs on to is not part of it). Closing the
        generator aborts the request."""
        prompt, turn = self._turn_inputs(messages, tools, tool_choice, deterministic, **options)
        fmt = self._turn_format_for_turns()
        parser, parsed = fmt.stream_parser(prompt), ParsedTurn()
        request_id = self.engine.add_request(prompt, turn, delta=True)
        self.engine.show_turn(request_id, messages, tools, on_intent)
        token_ids: list[int] = []
        token_metrics: list = []
        reason, finished = None, False
        try:
            while reason is None:
                if cancel is not None and cancel.is_set():
                    reason = "abort"
                    break
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    token_ids += out.token_ids
                    token_metrics += out.token_metrics or ()
                    yield Tokens(list(out.token_ids))
                    for event in parser.feed_all(out.token_ids):
                        parsed.add(event)
                        yield event
                    finished = out.finished
                    if finished:
                        reason = out.finish_reason
                    elif fmt.ends_at_final:
                        reason = _final_closed(parsed)
        finally:
            if not finished:  # closed, cancelled, or the final answer ended the turn
                self.engine.abort(request_id)
        for event in parser.finish():
            parsed.add(event)
            yield event
        return _assistant_turn(parsed, prompt, token_ids, reason, token_metrics)

    def _turn_inputs(
        self,
        messages: list[Message],
        tools: list[dict] | None,
        tool_choice: str | dict,
        deterministic: bool,
        params: SamplingParams | None = None,
        response_format: dict | None = None,
        constrained: bool = True,
        grounded: bool = True,
        parallel_tool_calls: bool = True,
        thinking_budget: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        control: bool = True,
    ) -> tuple[list[int], SamplingParams]:
        """The prompt ids and SamplingParams of one assistant turn."""
        check_messages(messages, self.engine.config.capabilities)  # the caller's indices
        fmt = self._turn_format_for_turns()
        base = params or SamplingParams(max_tokens=1024)
        if not control:
            base = dataclasses.replace(base, control=False)
        if deterministic:
            base = dataclasses.replace(base, temperature=0.0, seed=0)
        template_messages = fmt.template_messages(messages)
        prompt = self.render_chat(template_messages, tools, **(chat_template_kwargs or {}))
        options = TurnOptions(
            tool_choice, response_format, messages if grounded else None,
            thinking_budget=thinking_budget, parallel_tool_calls=parallel_tool_calls,
        )  # fmt: skip
        return prompt, fmt.params(base, prompt, tools, options, constrained)

    def session(self, **options: Any) -> Session:
        """A Session over this model: `session.generate(messages, tools=[...])` runs the tool
        loop to a final answer. Options go to Session (max_tool_rounds; control, by default this
        LLM's: LLM(control=...)) and to its ToolExecutor (max_concurrency, timeout_s, retry)."""
        executor_options = {k: options.pop(k) for k in ("max_concurrency", "timeout_s", "retry")
                            if k in options}
        options.setdefault("control", self.control)
        return Session(self, executor=ToolExecutor(**executor_options), **options)

    @functools.cached_property
    def harmony(self):
        """The tokenizer's Harmony encoding (None: the model has no Harmony tokens)."""
        return harmony_encoding(self.tokenizer)

    @functools.cached_property
    def turn_format(self) -> TurnFormat | None:
        """How this model writes tool calls and reasoning (None: no syntax noesis knows)."""
        return TurnFormat.of(self.tokenizer, self.tool_dialect)

    def _turn_format_for_turns(self) -> TurnFormat:
        return self.turn_format or TurnFormat.plain(self.tokenizer)

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
        # A part the loaded model cannot read (an image on a text-only load) is refused, not
        # left for the template to drop or to spell out as text.
        check_messages(messages, self.engine.config.capabilities)
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


def _assistant_turn(
    parsed: ParsedTurn,
    prompt: list[int],
    token_ids: list[int],
    reason: str | None,
    token_metrics: list | None = None,
) -> AssistantTurn:
    calls = [SessionToolCall(new_call_id(), c.name, c.arguments) for c in parsed.tool_calls]
    finish = "tool_calls" if calls and reason == "stop" else reason or "stop"
    return AssistantTurn(
        parsed.analysis, calls, parsed.final, len(prompt), len(token_ids),
        "cancelled" if finish == "abort" else finish, list(prompt), list(token_ids),
        list(token_metrics or ()),
    )  # fmt: skip


def _final_closed(parsed: ParsedTurn) -> str | None:
    """'stop' once the turn's final answer (a final-channel message to nobody) has closed."""
    last = parsed.messages[-1] if parsed.messages else None
    closed = last is not None and last.stop is not None
    return "stop" if closed and last.channel == "final" and not last.recipient else None


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
