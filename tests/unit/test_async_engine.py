"""AsyncEngine over a fake engine (streaming, merging, abort on close, admission, step failures)
and over a real tiny engine in a child process."""

from __future__ import annotations

import asyncio
import time

import pytest

from noesis import SamplingParams
from noesis.engine.async_engine import AsyncEngine, Outbox, QueueFull
from noesis.engine.engine import EngineConfig
from noesis.engine.messages import EngineStepError
from noesis.engine.outputs import RequestOutput
from noesis.engine.stats import EngineStats
from noesis.engine.transport import EngineProcess, EngineThread
from noesis.errors import InvalidRequest, ModelNotFound, PromptTooLong

BAD_PROMPT = [666]


class FakeEngine:
    """Emits token i at step i for each request until max_tokens, as delta outputs (what
    AsyncEngine asks for); can fail one step on demand."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[list[int], int, list[int]]] = {}
        self.aborted: list[str] = []
        self.fail_next_step = False

    num_compiling = 0  # no grammars here

    def add_request(self, token_ids, params: SamplingParams, request_id: str, delta: bool,
                    wait_for_grammar: bool = True) -> str:
        assert delta and not wait_for_grammar
        if token_ids == BAD_PROMPT:
            raise InvalidRequest("bad prompt")
        self.requests[request_id] = (list(token_ids), params.max_tokens, [])
        return request_id

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def is_compiling(self, request_id: str) -> bool:
        return False

    def step(self) -> list[RequestOutput]:
        time.sleep(0.001)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("boom")
        outputs = []
        for request_id, (prompt, max_tokens, tokens) in list(self.requests.items()):
            tokens.append(len(tokens))
            done = len(tokens) == max_tokens
            reason = "length" if done else None
            outputs.append(self._output(request_id, prompt, tokens[-1:], reason))
            if done:
                del self.requests[request_id]
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        if request_id not in self.requests:
            return None
        prompt, _, _ = self.requests.pop(request_id)
        self.aborted.append(request_id)
        return self._output(request_id, prompt, [], "abort")

    def abort_all(self) -> list[RequestOutput]:
        return [out for out in map(self.abort, list(self.requests)) if out is not None]

    @staticmethod
    def _output(request_id, prompt, tokens, reason) -> RequestOutput:
        text = "".join(map(str, tokens))  # only the new tokens: a delta
        return RequestOutput(
            request_id, None, prompt, text, list(tokens), reason, None, reason is not None
        )


def run(test, max_in_flight: int = 8):
    """Run `test(async_engine, fake)` on a fresh loop with the engine thread started."""

    async def main():
        fake = FakeEngine()
        engine = AsyncEngine(EngineThread(fake, stats=lambda _: EngineStats()), max_in_flight)
        engine.start()
        try:
            return await asyncio.wait_for(test(engine, fake), 10)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


def params(max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=max_tokens)]


def test_outputs_stream_until_finished():
    async def test(engine, fake):
        (stream,) = engine.add([1, 2], params(5))
        deltas = [out async for out in stream]
        assert [t for out in deltas for t in out.token_ids] == [0, 1, 2, 3, 4]
        assert "".join(out.text for out in deltas) == "01234"
        assert deltas[-1].finished and not any(out.finished for out in deltas[:-1])
        assert engine.num_in_flight == 0
        assert stream.times.first_token is not None and stream.times.finished is not None

    run(test)


def test_a_consumer_that_falls_behind_gets_the_pending_deltas_merged():
    async def test(engine, fake):
        (stream,) = engine.add([1], params(6))
        await stream.started()
        await asyncio.sleep(0.05)  # several steps pass unread
        deltas = [out async for out in stream]
        assert len(deltas) < 6
        assert [t for out in deltas for t in out.token_ids] == [0, 1, 2, 3, 4, 5]
        assert "".join(out.text for out in deltas) == "012345"

    run(test)


def test_requests_sharing_an_outbox_arrive_together_by_index():
    async def test(engine, fake):
        outbox = Outbox()
        streams = engine.add([1], params(3) * 2, outbox, first_index=5)
        assert [s.index for s in streams] == [5, 6]
        tokens: dict[int, list[int]] = {5: [], 6: []}
        finished = 0
        while finished < 2:
            for index, out in await outbox.take():
                tokens[index] += out.token_ids
                finished += out.finished
        assert tokens == {5: [0, 1, 2], 6: [0, 1, 2]} and engine.num_in_flight == 0

    run(test)


def test_rejected_request_raises_and_leaves_nothing_behind():
    async def test(engine, fake):
        (stream,) = engine.add(BAD_PROMPT, params(3))
        with pytest.raises(InvalidRequest, match="bad prompt"):
            await stream.started()
        assert engine.num_in_flight == 0

    run(test)


def test_closing_a_stream_aborts_its_request():
    async def test(engine, fake):
        (stream,) = engine.add([1], params(10_000))
        iterator = stream.__aiter__()
        await iterator.__anext__()
        await iterator.aclose()
        for _ in range(100):
            if fake.aborted:
                break
            await asyncio.sleep(0.01)
        assert fake.aborted == [stream.request_id] and not fake.requests

    run(test)


def test_step_failure_fails_requests_in_flight_but_not_later_ones():
    async def test(engine, fake):
        streams = engine.add([1], params(10_000) * 2)
        await asyncio.gather(*(s.started() for s in streams))
        fake.fail_next_step = True
        for stream in streams:
            with pytest.raises(EngineStepError, match="boom"):
                async for _ in stream:
                    pass
        (later,) = engine.add([2], params(3))
        assert (await later.result()).token_ids == [0, 1, 2]
        assert engine.num_step_failures == 1

    run(test)


def test_admission_is_all_or_nothing():
    async def test(engine, fake):
        engine.add([1], params(10_000) * 2)
        with pytest.raises(QueueFull) as info:
            engine.add([1], params(5) * 2)
        assert info.value.retry_after >= 1 and engine.num_in_flight == 2

    run(test, max_in_flight=3)


# ---- the engine in a child process --------------------------------------------------------------


def test_engine_process_streams_what_the_engine_generates(checkpoints):
    """A real tiny checkpoint in a child process: same tokens as in-process, errors rebuilt."""
    path = str(checkpoints.path("llama"))
    prompt = [5, 6, 7, 8]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
    expected = checkpoints.llm("llama").generate([prompt], greedy)[0]
    config = EngineConfig(device="cpu", dtype="float32", progress=False, max_model_len=64)
    backend = EngineProcess.spawn(path, config, "warning")
    assert backend.info.max_model_len == 64 and backend.info.tokenizer.vocab_size > 0

    async def main():
        engine = AsyncEngine(backend, max_in_flight=4)
        engine.start()
        try:
            (stream,) = engine.add(prompt, [greedy])
            out = await stream.result()
            (too_long,) = engine.add(list(range(1, 65)), [greedy])
            with pytest.raises(PromptTooLong) as info:
                await too_long.started()
            assert info.value.prompt_len == 64 and info.value.max_model_len == 64
            return out, engine.stats()
        finally:
            await engine.shutdown()

    try:
        out, stats = asyncio.run(main())
    finally:
        backend.close()
    assert out.token_ids == expected.token_ids and out.text == expected.text
    assert out.prompt_token_ids == prompt and len(out.logprobs) == 6
    assert stats.kv_pages_used == 0 and stats.running == 0 and not backend.alive


def test_engine_process_raises_what_loading_raised(tmp_path):
    with pytest.raises(ModelNotFound):
        EngineProcess.spawn(str(tmp_path / "absent"), EngineConfig(device="cpu", progress=False))
