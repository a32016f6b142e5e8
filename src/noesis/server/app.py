"""The FastAPI app: routes, API key, the engine's lifespan, and `serve()` under uvicorn.

A generation request goes: API key (every route but /health) -> body bytes, held to the size
limit -> validated wire type within the request limits (protocol.py) -> token ids and one
SamplingParams per choice -> Generation (engine requests) -> JSON or SSE (responses.py). The
engine runs in its own process (EngineProcess), so this one only does HTTP and formatting.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import hmac
import logging
import signal
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from noesis.dialects import NO_TOOL_SYNTAX, TurnFormat, TurnOptions
from noesis.engine.async_engine import AsyncEngine
from noesis.engine.engine import Engine
from noesis.engine.loop import setup_logging, warm_up
from noesis.engine.messages import EngineDead
from noesis.engine.outputs import best_of
from noesis.engine.transport import EngineProcess, EngineThread
from noesis.errors import PromptTooLong
from noesis.sampling.params import SamplingParams
from noesis.server.bodies import INLINE_BYTES, BodyParser
from noesis.server.config import RequestLimits, ServeConfig
from noesis.server.embeddings import Embeddings, load_encoders
from noesis.server.errors import APIError, install_handlers
from noesis.server.generation import Generation
from noesis.server.metrics import CONTENT_TYPE, Metrics
from noesis.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
    template_messages,
)
from noesis.server.responses import (
    ChatFormat,
    CompletionFormat,
    Format,
    HarmonyChatFormat,
    Reply,
    TokenTexts,
    full_response,
    sse_stream,
)
from noesis.server.responses_api import ResponseReply, ResponsesRequest
from noesis.server.stats_log import StatsLog
from noesis.structured.grounding import user_texts
from noesis.turns import response_format_spec

log = logging.getLogger("noesis.server")
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings",
          "/v1/models", "/tokenize", "/detokenize", "/health", "/metrics")
# A "deterministic" request's engine request ids, one per choice, as its trace records them
TRACE_IDS_HEADER = "X-Noesis-Request-Ids"


class ServerState:
    """What the routes share: the engine, tokenizer, limits, metrics, draining flag."""

    def __init__(self, config: ServeConfig, backend: EngineThread | EngineProcess) -> None:
        info = backend.info
        self.config = config
        self.model_name = config.model_name
        self.tokenizer = info.tokenizer
        self.max_model_len = info.max_model_len
        self.max_tokens_limit = config.max_tokens_limit or info.max_model_len
        self.engine = AsyncEngine(backend, info.max_num_seqs + config.max_queue)
        self.metrics = Metrics(self.engine)
        self.token_text = TokenTexts(info.tokenizer)
        if config.chat_template is not None:
            self.tokenizer.set_chat_template(config.chat_template)
        # How the model writes calls and reasoning; None: plain text, no tool syntax.
        self.turns = TurnFormat.of(info.tokenizer, config.tool_dialect)
        self.tool_calls = self.turns is not None and self.turns.has_calls
        self.created = int(time.time())
        self.draining = False
        self.bodies = BodyParser()
        self.limits = _request_limits(config.limits, info)
        # What a request leaves unset samples with: the checkpoint's generation_config.json
        self.sampling_defaults = SamplingParams(**info.sampling_defaults)
        self.embeddings = Embeddings(self.model_name, self.engine, info.tokenizer,
                                     info.max_model_len, load_encoders(config))

    def begin_drain(self) -> None:
        """Refuse new work now; end what still runs once the shutdown deadline has passed."""
        if self.draining:
            return
        self.draining = True
        error = EngineDead(f"the server shut down ({self.config.shutdown_timeout:g} s deadline)")
        loop = asyncio.get_running_loop()
        loop.call_later(self.config.shutdown_timeout, self.engine.fail_all, error)

    # ---- checks ------------------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name not in (self.model_name, self.config.model):
            shown = name if len(name) <= 100 else f"{name[:100]}..."
            raise APIError(
                404,
                f"the model {shown!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )

    def check_n(self, n: int, prompts: int = 1) -> None:
        """n within --max-n, and prompts x n within what the engine can ever hold (checked
        before tokenizing a batch of prompts that could never run)."""
        if n > self.config.max_n:
            raise APIError(
                400,
                f"n={n} is over this server's limit of {self.config.max_n} choices per request "
                "(noesis serve --max-n)",
                "n",
                "invalid_value",
            )
        slots = self.engine.max_in_flight
        if prompts * n > slots:
            raise APIError(
                400,
                f"{prompts} prompts x n={n} generations can never fit this server's {slots} "
                "slots (--max-num-seqs + --max-queue)",
                "n" if prompts == 1 else "prompt",
                "invalid_value",
            )

    def max_tokens(self, requested: int | None, prompt_len: int) -> int:
        """The per-choice token budget: capped by config, and never past the context."""
        limit = self.max_tokens_limit
        if requested is not None and requested > limit:
            raise APIError(
                400,
                f"max_tokens={requested} is over this server's limit of {limit} tokens per "
                "choice (noesis serve --max-tokens-limit)",
                "max_tokens",
                "invalid_value",
            )
        if prompt_len >= self.max_model_len:
            raise PromptTooLong(prompt_len, self.max_model_len)
        room = self.max_model_len - prompt_len
        if requested is None:
            return min(limit, room)
        if requested > room:
            raise APIError(
                400,
                f"this model's context holds {self.max_model_len} tokens, but the prompt has "
                f"{prompt_len} and max_tokens asks for {requested} more "
                f"({prompt_len + requested} in all): lower max_tokens or shorten the prompt",
                "max_tokens",
                "context_length_exceeded",
            )
        return requested

    def check_deterministic(self, deterministic: bool) -> None:
        """A deterministic request is one this server can replay: refused unless every step is
        recorded (serve --trace PATH, which the request's trace lines go to)."""
        if deterministic and self.config.engine.trace is None:
            raise APIError(
                400,
                "deterministic: this server records no trace to replay the request from; "
                "start it with --trace PATH (noesis serve --deterministic --trace PATH)",
                "deterministic",
                "unsupported_parameter",
            )

    # ---- generation --------------------------------------------------------------------------

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        tools = body.tools if self.tool_calls and body.effective_tool_choice != "none" else None
        # Only the template writes control tokens (and BOS): a message's spellings stay text.
        kwargs = body.template_kwargs(self.template_reads)
        return self.tokenizer.encode_chat(self._messages(body), tools, **kwargs)

    def template_reads(self, name: str) -> bool:
        """Whether the chat template reads the variable `name` (Harmony's renderer reads only
        reasoning_effort); a template that never names it would ignore it."""
        if self.tokenizer.harmony is not None:
            return name == "reasoning_effort"
        return name in (self.tokenizer.chat_template or "")

    def chat_turn(self, body: ChatCompletionRequest, prompt: list[int]):
        """How the reply to `prompt` is constrained and read: the turn's SamplingParams
        adjustment and the response format. GrammarError (a 400) for bad tools / tool_choice /
        schemas; InvalidRequest naming --tool-dialect for tools on a model without tool syntax."""
        choice = body.effective_tool_choice
        tools = body.tools if choice != "none" else None
        if self.turns is None:
            if tools or choice not in ("none", "auto"):  # a forced call cannot be enforced either
                param = "tools" if tools else "tool_choice"
                raise APIError(400, NO_TOOL_SYNTAX, param, "unsupported_parameter")
            if body.thinking_budget is not None:
                raise APIError(400, "thinking_budget needs a model with a reasoning format "
                               "(Harmony or a dialect: noesis serve --tool-dialect)",
                               "thinking_budget", "unsupported_parameter")
            spec = response_format_spec(body.response_format)
            return (lambda params: dataclasses.replace(params, grammar=spec)), ChatFormat
        options = TurnOptions(
            choice, body.response_format, body.template_messages(self.tool_calls),
            thinking_budget=body.thinking_budget, parallel_tool_calls=body.parallel_tool_calls,
        )  # fmt: skip

        def adjust(params):
            return self.turns.params(params, prompt, tools, options)

        adjust(SamplingParams())  # validate here, before anything is queued
        return adjust, HarmonyChatFormat(self.turns, body.n, prompt)

    def _messages(self, body: ChatCompletionRequest) -> list[dict]:
        messages = body.template_messages(self.tool_calls)
        return messages if self.turns is None else self.turns.template_messages(messages)

    def tokenize(self, body: TokenizeRequest) -> list[int]:
        if body.prompt is not None:
            return self.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        messages = template_messages(body.messages, self.tool_calls)
        if self.turns is not None:
            messages = self.turns.template_messages(messages)
        return self.tokenizer.encode_chat(messages, None, body.add_generation_prompt)

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        return [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]

    async def start(
        self, body: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]], adjust=None
    ) -> Generation:
        """Queue every choice of every prompt (SamplingParams from the body over the server's
        defaults, then `adjust`ed for the turn): the Generation that reads them."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        self.check_deterministic(body.deterministic)
        # best_of > n ranks its generations by their tokens' logprobs: ask for those
        ranked = body.choices > body.n
        logprobs = body.logprobs_k if body.logprobs_k is not None or not ranked else 0
        params = [
            body.sampling_params(
                self.max_tokens(body.requested_max_tokens, len(p)), logprobs,
                self.sampling_defaults,
            )
            for p in prompts
        ]
        if adjust is not None:
            params = [[adjust(choice) for choice in choices] for choices in params]
        gated = ranked and self.gates_branches(body)
        if gated:  # the binding gate scores the branches by their entropy
            params = [[dataclasses.replace(p, metrics=True) for p in choices]
                      for choices in params]
        generation = Generation(self.engine, self.metrics, keep_outputs=not body.stream)
        await generation.start(prompts, params)
        if gated:
            self.gate_branches(body, generation, body.choices)
        self.show_turns(body, generation)
        return generation

    def show_turns(self, body: ChatCompletionRequest | CompletionRequest,
                   generation: Generation) -> None:
        """A chat request with tools, under a server whose sidecars read turns (intent): each
        generation's last user message and tools go to them (predictions and hit / miss in
        /metrics; the client runs its tools, so nothing is warmed)."""
        sidecars = self.config.engine.sidecars
        if sidecars is None or not sidecars.reads_turns:
            return
        if not isinstance(body, ChatCompletionRequest) or not body.tools \
                or body.effective_tool_choice == "none":  # fmt: skip
            return
        texts = user_texts(body.template_messages())
        if not texts:
            return
        last = [{"role": "user", "content": texts[0]}]
        for stream in generation.streams:
            self.engine.show_turn(stream.request_id, last, body.tools)

    def gates_branches(self, body: ChatCompletionRequest | CompletionRequest) -> bool:
        """Whether best_of's extra generations run under the binding gate: the server's control
        policy is on (serve --control default) and the request did not opt out."""
        return self.config.engine.control not in (None, "none") and body.control

    def gate_branches(self, body: ChatCompletionRequest | CompletionRequest,
                      generation: Generation, choices: int) -> None:
        """Each prompt's generations are branches of one request, n of which must finish: the
        engine's binding gate may stop the rest early (finish_reason "pruned", never returned)."""
        chat = isinstance(body, ChatCompletionRequest)
        texts = user_texts(body.template_messages()) if chat else []
        tools = body.tools if chat and body.effective_tool_choice != "none" else None
        for start in range(0, len(generation.streams), choices):
            ids = [s.request_id for s in generation.streams[start : start + choices]]
            self.engine.branches(ids, body.n, tools, texts[0] if texts else None)

    async def generate(
        self,
        request: Request,
        body: ChatCompletionRequest | CompletionRequest,
        prompts: list[list[int]],
        fmt: Format,
        echo: list[str] | None = None,
        adjust=None,
    ) -> Response:
        generation = await self.start(body, prompts, adjust)
        ranked = body.choices > body.n
        n = body.n
        reply = Reply(
            model=self.model_name,
            token_text=self.token_text,
            logprobs_k=body.logprobs_k,
            prompt_lens=[len(p) for p in prompts for _ in range(n)],
            echo=[e for e in echo for _ in range(n)] if echo else None,
        )
        if body.stream:
            events = sse_stream(fmt, reply, generation, n, body.include_usage)
            headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
            if body.deterministic:
                headers[TRACE_IDS_HEADER] = ",".join(s.request_id for s in generation.streams)
            return StreamingResponse(events, media_type="text/event-stream", headers=headers)
        outputs = await _unless_disconnected(request, generation.results())
        if outputs is None:
            return Response(status_code=499)  # nobody is listening
        if ranked:
            outputs = best_of(outputs, body.choices, n)
        response = full_response(fmt, reply, outputs, n, generation)
        if not body.deterministic:
            return JSONResponse(response)
        ids = [out.request_id for out in outputs]
        response["noesis"] = {"request_ids": ids}
        return JSONResponse(response, headers={TRACE_IDS_HEADER: ",".join(ids)})


async def _unless_disconnected(request: Request, work):
    """Await `work`, cancelling it (which aborts its engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        return task.result() if task.done() else None
    finally:
        watch.cancel()
        task.cancel()  # a no-op once done; otherwise (client gone, or we were cancelled) aborts


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _body(request: Request, model, state: ServerState):
    """The validated body, within the server's limits, and its size in bytes."""
    limit = state.config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _body_too_large(limit)
    # Filled chunk by chunk into one buffer of the declared size (no copy of a large body on
    # the event loop, no regrowth); reading stops at the limit, whatever was declared.
    body = bytearray(int(declared) if declared is not None and declared.isdigit() else 0)
    size = 0
    async for chunk in request.stream():
        if size + len(chunk) > limit:
            raise _body_too_large(limit)
        body[size : size + len(chunk)] = chunk
        size += len(chunk)
    del body[size:]  # a body shorter than declared
    return await state.bodies.parse(body, model, state.limits), size


def _body_too_large(limit: int) -> APIError:
    return APIError(
        413, f"the body is over {limit} bytes (noesis serve --max-body-bytes)",
        code="body_too_large",
    )


async def _off_loop_if_long(size: int, work, body):
    """Tokenize (and template) a small body right here; a long one on a worker thread, so that
    it cannot stall the streams in flight. A thread hop costs more than a short prompt."""
    if size <= INLINE_BYTES:
        return work(body)
    return await asyncio.to_thread(work, body)


def _request_limits(limits: RequestLimits, info) -> RequestLimits:
    """The configured request limits; without --max-prompt-chars, the most characters a prompt
    can have and still fit: the context times the tokenizer's longest token."""
    if limits.max_prompt_chars is not None:
        return limits
    chars = info.max_model_len * longest_token_chars(info.tokenizer)
    return dataclasses.replace(limits, max_prompt_chars=chars)


def longest_token_chars(tokenizer) -> int:
    """Characters of the tokenizer's longest vocabulary entry: no token covers more text (a
    byte-level entry spells each byte with one character, so it counts bytes: more, if not
    fewer). Added tokens count too: a completion prompt may spell them."""
    return max(map(len, tokenizer.backend.get_vocab(with_added_tokens=True)), default=1)


# ---- routes ----------------------------------------------------------------------------------


def _state(request: Request) -> ServerState:
    return request.app.state.server


v1 = APIRouter(prefix="/v1")  # behind the API key, as every route but /health is (APIKeyGate)


@v1.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = _state(request)
    body, size = await _body(request, ChatCompletionRequest, state)
    state.check_model(body.model)
    body.refuse_unsupported()
    state.check_n(body.n)
    prompt = await _off_loop_if_long(size, state.chat_prompt, body)
    adjust, fmt = state.chat_turn(body, prompt)
    return await state.generate(request, body, [prompt], fmt, adjust=adjust)


@v1.post("/completions")
async def completions(request: Request) -> Response:
    state = _state(request)
    body, size = await _body(request, CompletionRequest, state)
    state.check_model(body.model)
    body.refuse_unsupported()
    state.check_n(body.choices, len(body.prompts()))  # best_of generations run, not only n
    has_text = any(isinstance(p, str) for p in body.prompts())
    prompts = await _off_loop_if_long(size if has_text else 0, state.completion_prompts, body)
    echo = None
    if body.echo:
        echo = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in body.prompts()]
    return await state.generate(request, body, prompts, CompletionFormat, echo)


@v1.post("/responses")
async def responses(request: Request) -> Response:
    """OpenAI's Responses API: the body becomes a chat request and runs as the chat route's
    does (template, turn format, grammar); its reply becomes output items (responses_api.py)."""
    state = _state(request)
    body, size = await _body(request, ResponsesRequest, state)
    state.check_model(body.model)
    chat = body.chat_request()  # a 400 naming what it cannot honour
    prompt = await _off_loop_if_long(size, state.chat_prompt, chat)
    adjust, fmt = state.chat_turn(chat, prompt)
    generation = await state.start(chat, [prompt], adjust)
    defaults = state.sampling_defaults
    reply = Reply(model=state.model_name, token_text=state.token_text, logprobs_k=None,
                  prompt_lens=[len(prompt)])
    answer = ResponseReply(body, fmt, reply, generation,
                           defaults.temperature if chat.temperature is None else chat.temperature,
                           defaults.top_p if chat.top_p is None else chat.top_p)
    if body.stream:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(answer.events(), media_type="text/event-stream", headers=headers)
    outputs = await _unless_disconnected(request, generation.results())
    if outputs is None:
        return Response(status_code=499)  # nobody is listening
    return JSONResponse(answer.whole(outputs[0]))


@v1.post("/embeddings")
async def embeddings(request: Request) -> JSONResponse:
    state = _state(request)
    body, _ = await _body(request, EmbeddingRequest, state)
    if body.model not in state.embeddings.names:
        state.check_model(body.model)
        body.model = state.model_name
    return JSONResponse(await state.embeddings.respond(body))


@v1.get("/models")
async def list_models(request: Request) -> dict:
    state = _state(request)
    cards = [_model_card(state)] + [_encoder_card(state, n) for n in state.embeddings.names]
    return {"object": "list", "data": cards}


@v1.get("/models/{model_id:path}")
async def get_model(request: Request, model_id: str) -> dict:
    state = _state(request)
    state.check_model(model_id)
    return _model_card(state)


async def tokenize(request: Request) -> JSONResponse:
    """vLLM's /tokenize: the ids a prompt (or chat messages, as the chat endpoint renders them)
    becomes, the count and the context length."""
    state = _state(request)
    body, size = await _body(request, TokenizeRequest, state)
    if body.model is not None:
        state.check_model(body.model)
    ids = await _off_loop_if_long(size, state.tokenize, body)
    result = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
    if body.return_token_strs:
        result["token_strs"] = [state.token_text(token) for token in ids]
    return JSONResponse(result)


async def detokenize(request: Request) -> JSONResponse:
    """vLLM's /detokenize: token ids back to text (special tokens included)."""
    state = _state(request)
    body, _ = await _body(request, DetokenizeRequest, state)
    if body.model is not None:
        state.check_model(body.model)
    vocab = state.tokenizer.vocab_size
    bad = [token for token in body.tokens if not 0 <= token < vocab]
    if bad:
        message = f"tokens: ids out of the vocabulary [0, {vocab}): {bad[:10]}"
        raise APIError(400, message, "tokens", "invalid_value")
    return JSONResponse({"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)})


def _encoder_card(state: ServerState, name: str) -> dict:
    return {"id": name, "object": "model", "created": state.created, "owned_by": "noesis"}


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "noesis",
        "max_model_len": state.max_model_len,
    }


async def health(request: Request) -> JSONResponse:
    state = _state(request)
    if state.draining or not state.engine.alive:
        return JSONResponse({"status": "unavailable"}, status_code=503)
    return JSONResponse({"status": "ok"})


async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.exposition(), media_type=CONTENT_TYPE)


async def openapi_json(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


async def swagger_ui(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="noesis")


async def redoc(request: Request) -> HTMLResponse:
    return get_redoc_html(openapi_url="/openapi.json", title="noesis")


DOCS_ROUTES = {"/openapi.json": openapi_json, "/docs": swagger_ui, "/redoc": redoc}


# ---- middleware (outermost first) --------------------------------------------------------------


class CanonicalPaths:
    """Pure ASGI middleware: a path with trailing slashes is its canonical self, so that
    /v1/chat/completions/ reaches the same handler through the same key check (no redirect
    that could answer before the key is checked)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and len(path) > 1 and path.endswith("/"):
            raw = scope.get("raw_path") or path.encode()
            scope = {**scope, "path": path.rstrip("/") or "/", "raw_path": raw.rstrip(b"/") or b"/"}
        await self.app(scope, receive, send)


class APIKeyGate:
    """Pure ASGI middleware: with an API key, every request needs it as a Bearer token but
    /health (for probes) and, with --metrics-public, /metrics. One gate for all routes, so that
    no route (docs, unknown paths, future ones) can be left open by forgetting it."""

    def __init__(self, app, config: ServeConfig) -> None:
        self.app = app
        self.key = None if config.api_key is None else config.api_key.encode()
        self.open_paths = {"/health"} | ({"/metrics"} if config.metrics_public else set())

    async def __call__(self, scope, receive, send) -> None:
        if self.key is None or scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            error = APIError(
                401,
                "missing or wrong API key: send it as 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, token = header.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)


class HTTPMetrics:
    """Pure ASGI middleware counting responses by route and status (streams stay untouched)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_status(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.http_requests.labels(route, str(status)).inc()


def create_app(config: ServeConfig, backend: EngineThread | EngineProcess) -> FastAPI:
    state = ServerState(config, backend)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # What is loaded so far (libraries, tokenizer; the model too with EngineThread: ~300k
        # objects) lives as long as the server. Frozen, a full collection scans only what
        # requests allocate: ~1 ms, not a 100+ ms pause of every stream.
        gc.collect()
        gc.freeze()
        state.bodies.warm()
        state.engine.start()
        stats = StatsLog(state.engine, config.stats_interval).run() \
            if config.stats_interval else None
        stats_task = asyncio.create_task(stats) if stats is not None else None
        yield
        if stats_task is not None:
            stats_task.cancel()
        state.draining = True
        await state.engine.shutdown()
        state.bodies.close()

    # FastAPI's own docs routes are off: when asked for, ours serve them behind the key.
    app = FastAPI(
        title="noesis", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None,
        redirect_slashes=False,
    )
    app.state.server = state
    install_handlers(app)
    app.include_router(v1)
    app.add_api_route("/tokenize", tokenize, methods=["POST"])
    app.add_api_route("/detokenize", detokenize, methods=["POST"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    if config.enable_docs:
        for path, route in DOCS_ROUTES.items():
            app.add_api_route(path, route, methods=["GET"], include_in_schema=False)
    app.add_middleware(APIKeyGate, config=config)
    if config.cors_origins:  # outside the key gate: a browser's preflight carries no key
        app.add_middleware(
            CORSMiddleware, allow_origins=list(config.cors_origins), allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"], max_age=600,
        )
    app.add_middleware(HTTPMetrics, metrics=state.metrics)
    app.add_middleware(CanonicalPaths)  # added last: runs first, so every layer sees one path
    return app


# ---- running it ------------------------------------------------------------------------------


def serve(config: ServeConfig) -> int:
    """Load the model, serve until SIGTERM/SIGINT, drain within the deadline, return 0."""
    setup_logging(config.log_level)
    if config.engine_process:
        backend = EngineProcess.spawn(config.model, config.engine, config.log_level)
    else:
        engine = Engine(config.model, config.engine)
        warm_up(engine)  # on CUDA; logs the start-up timing buckets
        backend = EngineThread(engine)
    try:
        app = create_app(config, backend)
    except BaseException:
        backend.close()
        raise
    try:
        return _run(config, app)
    finally:
        app.state.server.engine.backend.close()  # the current one: a fault may have replaced it


def _run(config: ServeConfig, app: FastAPI) -> int:
    server = _Uvicorn(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            # a backstop: begin_drain ends streams at the deadline, this cancels what lingers
            timeout_graceful_shutdown=config.shutdown_timeout + 5,
            access_log=config.log_level == "debug",
        ),
        app.state.server,
    )
    # uvicorn re-raises the signal it caught once it has shut down; a no-op handler for SIGTERM
    # turns that into a normal return, so a graceful stop exits 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


class _Uvicorn(uvicorn.Server):
    """uvicorn.Server that marks the app draining (503 for new work) as soon as a signal lands."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        with contextlib.suppress(RuntimeError):  # no loop yet: nothing runs, nothing to drain
            loop = asyncio.get_running_loop()
            log.info("signal %s: draining (deadline %g s)", sig, self.state.config.shutdown_timeout)
            loop.call_soon_threadsafe(self.state.begin_drain)
        super().handle_exit(sig, frame)
