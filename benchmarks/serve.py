"""Serving benchmark: a bounded loopback load generator against `noesis serve`.

    python benchmarks/serve.py --model DIR [--device cpu] [--concurrency 1,8,32,64,128]
        [--prompt-len 512] [--output-len 256] [--requests 2] [--max-seconds 60]
        [--chat-turns 20] [--compare-no-prefix-cache] [--engine-only] [--out .bench/serve.json]

It starts the server on 127.0.0.1 (or targets `--url`), then at each concurrency level keeps that
many streaming /v1/completions requests in flight (random token prompts of --prompt-len, exactly
--output-len new tokens via ignore_eos) until `--requests` x concurrency have been sent or
`--max-seconds` have passed. It reports output tokens/s, requests/s, p50/p99 time to first token
and per-token latency (mean gap between a request's tokens after the first), and errors.
Requests ask for logprobs=0 so that every token is an event: random-weight checkpoints emit ids
that their small tokenizer decodes to no text. `--chat-turns N` also plays one N-turn chat (the
whole history resent every turn) and reports the time to first token per turn: flat with prefix
caching, growing without it. Prints a table and writes JSON.

The client is a few lines of asyncio over raw HTTP/1.1 that split the chunked body into events and
parse JSON only for usage and errors: a general client (httpx + json per line) spends ~150 us of
CPU per event and would cap one process near 6,000 tokens/s. For a server it started (or one
named with --url and --server-pid) it also reports CPU microseconds per output token: all server
processes, the server's event-loop thread, and this client. `--engine-only` runs the same load on
an Engine in this process instead, with no HTTP at all: the ceiling for the server's numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "bench"
WORDS = "the engine reads weights once and keeps them resident each step schedules a batch".split()


@dataclass
class Sample:
    ttft: float = 0.0
    tpot: float | None = None
    tokens: int = 0
    error: str | None = None


# ---- server -------------------------------------------------------------------------------------


def start_server(args: argparse.Namespace, *extra: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "noesis.cli",
        "serve",
        "--model",
        args.model,
        "--device",
        args.device,
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--log-level",
        "warning",
        "--no-safety",  # the engine's serving figures; gpu_sidecars.py times the sidecars
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-queue",
        "1024",
        *(["--no-overlap-steps"] if args.no_overlap else []),
        *extra,
    ]
    process = subprocess.Popen(command, stdout=sys.stderr, stderr=sys.stderr)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise SystemExit("the server did not become healthy in time")


def stop_server(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(60)
    except subprocess.TimeoutExpired:
        process.kill()


# ---- one request ---------------------------------------------------------------------------------


class Connection:
    """One keep-alive HTTP/1.1 connection with just enough client to read SSE at full speed.

    A general client (httpx + json per line) costs ~150 us of CPU per streamed event, which
    caps one load-generator process near 6,000 events/s: the benchmark would measure itself.
    This one splits the chunked body into events and parses JSON only for the usage chunk.
    """

    def __init__(self, url: str) -> None:
        host, _, port = url.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port or 80)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self, path: str, body: bytes) -> tuple[int, asyncio.StreamReader, dict]:
        if self.writer is None or self.writer.is_closing():
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nAccept: text/event-stream\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        status_line = await self.reader.readline()
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if not status_line:
            raise ConnectionError("the server closed the connection")
        return int(status_line.split()[1]), self.reader, headers

    async def body_chunks(self, reader: asyncio.StreamReader, headers: dict):
        """The response body as the pieces the server wrote (chunked or by length)."""
        if headers.get("transfer-encoding") != "chunked":
            yield await reader.readexactly(int(headers.get("content-length", 0)))
            return
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                return
            yield data[:-2]

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


CHOICES = (b'"choices":[{', b'"choices": [{')  # with or without spaces after separators
USAGE = (b'"usage":{', b'"usage": {')
ERROR = (b'"error":{', b'"error": {')


def _has(event: bytes, patterns: tuple[bytes, bytes]) -> bool:
    return patterns[0] in event or patterns[1] in event


async def stream_request(conn: Connection, path: str, body: dict) -> Sample:
    """Send one streaming request; time its first token and the gaps after it."""
    sample, first, last = Sample(), None, None
    start = time.perf_counter()
    try:
        status, reader, headers = await conn.post(path, json.dumps(body).encode())
        if status != 200:
            text = b"".join([c async for c in conn.body_chunks(reader, headers)])
            return Sample(error=f"{status}: {text[:200].decode(errors='replace')}")
        pending = b""
        async for data in conn.body_chunks(reader, headers):
            now = time.perf_counter()
            *events, pending = (pending + data).split(b"\n\n")
            for event in events:
                if _has(event, CHOICES):  # a chunk that carries choice deltas
                    last = now
                    first = first or now
                elif _has(event, USAGE):
                    sample.tokens = json.loads(event[6:])["usage"]["completion_tokens"]
                elif _has(event, ERROR):
                    return Sample(error=json.loads(event[6:])["error"]["message"])
    except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
        conn.close()
        return Sample(error=repr(exc))
    if first is None:
        return Sample(error="no tokens")
    sample.ttft = first - start
    if sample.tokens > 1:
        sample.tpot = (last - first) / (sample.tokens - 1)
    return sample


async def _bounded(request, timeout: float, conn: Connection) -> Sample:
    try:
        return await asyncio.wait_for(request, timeout)
    except asyncio.TimeoutError:
        conn.close()
        return Sample(error=f"no answer within {timeout} s")


def completion_body(args: argparse.Namespace, rng: random.Random) -> dict:
    return {
        "model": MODEL,
        "prompt": [rng.randrange(10, 300) for _ in range(args.prompt_len)],
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "ignore_eos": True,
        "logprobs": 0,  # one event per token even where random ids decode to no text
        "stream": True,
        "stream_options": {"include_usage": True},
    }


# ---- load levels ---------------------------------------------------------------------------------


async def run_level(args: argparse.Namespace, url: str, concurrency: int) -> dict:
    """`concurrency` workers send requests back to back until the count or the time runs out."""
    rng = random.Random(concurrency)
    total = args.requests * concurrency
    sent, samples = 0, []
    deadline = time.perf_counter() + args.max_seconds

    async def worker() -> None:
        nonlocal sent
        conn = Connection(url)
        try:
            while sent < total and time.perf_counter() < deadline:
                sent += 1
                body = completion_body(args, rng)
                request = stream_request(conn, "/v1/completions", body)
                samples.append(await _bounded(request, args.request_timeout, conn))
        finally:
            conn.close()

    cpu = CpuClock(args.server_pid)
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return summarize(concurrency, samples, wall) | cpu.per_token(sum(s.tokens for s in samples))


class CpuClock:
    """CPU seconds spent by the server's processes, its event-loop thread, and this client.

    Server CPU per output token is the serving overhead that a fast engine step exposes; read
    from /proc (server process and its children, e.g. the engine process), so only for a
    server whose pid is known, on Linux.
    """

    def __init__(self, server_pid: int | None) -> None:
        self.pid = server_pid if server_pid and Path(f"/proc/{server_pid}").exists() else None
        self.start = self._read()

    def _read(self) -> tuple[float, float, float]:
        client = time.process_time()
        if self.pid is None:
            return client, 0.0, 0.0
        ticks = os.sysconf("SC_CLK_TCK")
        every = sum(_proc_cpu(f"/proc/{pid}/stat") for pid in _process_tree(self.pid)) / ticks
        loop = _proc_cpu(f"/proc/{self.pid}/task/{self.pid}/stat") / ticks  # the main thread
        return client, every, loop

    def per_token(self, tokens: int) -> dict:
        client, every, loop = (b - a for a, b in zip(self.start, self._read(), strict=True))
        us = 1e6 / max(tokens, 1)
        out = {"client_cpu_us_per_token": client * us}
        if self.pid is not None:
            out |= {"server_cpu_us_per_token": every * us, "loop_cpu_us_per_token": loop * us}
        return out


def _process_tree(pid: int) -> list[int]:
    """pid and its descendants (children that exit between two reads drop out of the sum)."""
    pids, todo = [], [pid]
    while todo:
        pids.append(todo.pop())
        for task in Path(f"/proc/{pids[-1]}/task").glob("*"):
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return pids


def _proc_cpu(path: str) -> int:
    try:
        fields = Path(path).read_text().rpartition(")")[2].split()
    except OSError:  # exited
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks


def summarize(concurrency: int, samples: list[Sample], wall: float) -> dict:
    good = [s for s in samples if s.error is None]
    ttft = [s.ttft for s in good]
    tpot = [s.tpot for s in good if s.tpot is not None]
    errors = [s.error for s in samples if s.error is not None]
    return {
        "concurrency": concurrency,
        "requests": len(samples),
        "errors": len(errors),
        "error_examples": errors[:3],
        "wall_s": wall,
        "output_tok_s": sum(s.tokens for s in good) / wall,
        "requests_s": len(good) / wall,
        "ttft_p50_ms": percentile(ttft, 50) * 1e3,
        "ttft_p99_ms": percentile(ttft, 99) * 1e3,
        "tpot_p50_ms": percentile(tpot, 50) * 1e3,
        "tpot_p99_ms": percentile(tpot, 99) * 1e3,
    }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


# ---- multi-turn chat -----------------------------------------------------------------------------


async def chat_turns(args: argparse.Namespace, url: str) -> list[dict]:
    """One conversation; every turn resends the history. Returns per-turn TTFT and prompt size."""
    rng = random.Random(0)
    messages = [{"role": "system", "content": "You are a benchmark."}]
    turns = []
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        warm = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "warm up"}],
            "max_tokens": 2,
            "stream": True,
        }
        await chat_request(client, url + "/v1/chat/completions", warm)  # first-call costs
        for turn in range(args.chat_turns):
            words = " ".join(rng.choice(WORDS) for _ in range(args.turn_words))
            messages.append({"role": "user", "content": f"Turn {turn}: {words}"})
            body = {
                "model": MODEL,
                "messages": messages,
                "max_tokens": args.turn_reply_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": True,
                "top_logprobs": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            sample, reply = await chat_request(client, url + "/v1/chat/completions", body)
            if sample.error:
                raise SystemExit(f"chat turn {turn} failed: {sample.error}")
            turns.append(
                {"turn": turn + 1, "ttft_ms": sample.ttft * 1e3, "prompt_tokens": sample.tokens}
            )
            messages.append({"role": "assistant", "content": reply})
    return turns


async def chat_request(client: httpx.AsyncClient, url: str, body: dict) -> tuple[Sample, str]:
    sample, reply, start = Sample(), "", time.perf_counter()
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return Sample(error=response.text[:200]), ""
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                has_token = choice["delta"].get("content") or choice.get("logprobs")
                if has_token and not sample.ttft:
                    sample.ttft = time.perf_counter() - start
                reply += choice["delta"].get("content") or ""
            if chunk.get("usage"):
                sample.tokens = chunk["usage"]["prompt_tokens"]
    return sample, reply


# ---- main ----------------------------------------------------------------------------------------


HEADER = (
    f"{'conc':>5} {'reqs':>5} {'err':>4} {'out tok/s':>10} {'req/s':>7} "
    f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9}  (ms)"
    f"  {'server':>7} {'loop':>6} {'client':>6}  (CPU us/token)"
)


def print_level(r: dict) -> None:
    cpu = [r.get(f"{k}_cpu_us_per_token", float("nan")) for k in ("server", "loop", "client")]
    print(
        f"{r['concurrency']:>5} {r['requests']:>5} {r['errors']:>4} "
        f"{r['output_tok_s']:>10.1f} {r['requests_s']:>7.2f} {r['ttft_p50_ms']:>9.1f} "
        f"{r['ttft_p99_ms']:>9.1f} {r['tpot_p50_ms']:>9.2f} {r['tpot_p99_ms']:>9.2f}      "
        f"{cpu[0]:>7.1f} {cpu[1]:>6.1f} {cpu[2]:>6.1f}",
        flush=True,
    )


def print_turns(label: str, turns: list[dict]) -> None:
    first, last = turns[0], turns[-1]
    print(
        f"{label}: TTFT turn 1 {first['ttft_ms']:.1f} ms ({first['prompt_tokens']} prompt "
        f"tokens), turn {last['turn']} {last['ttft_ms']:.1f} ms "
        f"({last['prompt_tokens']} prompt tokens)"
    )


def engine_only(args: argparse.Namespace) -> dict:
    """The same load straight on an Engine in this process (no HTTP, no event loop, no second
    thread): the ceiling that the server's numbers are to be compared with."""
    from noesis.engine.engine import Engine, EngineConfig

    config = EngineConfig(
        device=args.device,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=True,
        progress=False,
        overlap_steps=False if args.no_overlap else None,
    )
    engine = Engine(args.model, config)
    run_engine_level(engine, args, 1, random.Random(-1))  # warm-up
    results: dict = {"levels": []}
    print("engine only (the same requests added straight to an Engine):")
    print(HEADER)
    for concurrency in args.concurrency:
        level = run_engine_level(engine, args, concurrency, random.Random(concurrency))
        results["levels"].append(level)
        print_level(level)
    return results


def run_engine_level(engine, args: argparse.Namespace, concurrency: int, rng) -> dict:
    from noesis.sampling.params import SamplingParams

    params = SamplingParams(
        max_tokens=args.output_len, temperature=args.temperature, ignore_eos=True, logprobs=0
    )
    total = args.requests * concurrency
    live: dict[str, tuple[float, list[float]]] = {}  # request id -> (start, token times)
    samples: list[Sample] = []
    sent = 0
    start = time.perf_counter()
    deadline = start + args.max_seconds
    while live or sent < total:
        while len(live) < concurrency and sent < total and time.perf_counter() < deadline:
            prompt = [rng.randrange(10, 300) for _ in range(args.prompt_len)]
            live[engine.add_request(prompt, params, delta=True)] = (time.perf_counter(), [])
            sent += 1
        for out in engine.step():
            now = time.perf_counter()
            begin, times = live[out.request_id]
            times.extend([now] * len(out.token_ids))
            if out.finished:
                del live[out.request_id]
                samples.append(_engine_sample(begin, times))
    wall = time.perf_counter() - start
    return summarize(concurrency, samples, wall) | {"client_cpu_us_per_token": float("nan")}


def _engine_sample(start: float, times: list[float]) -> Sample:
    tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
    return Sample(ttft=times[0] - start, tpot=tpot, tokens=len(times))


async def measure(args: argparse.Namespace, url: str) -> dict:
    warm = completion_body(args, random.Random(-1)) | {"max_tokens": 2}
    conn = Connection(url)
    await stream_request(conn, "/v1/completions", warm)
    conn.close()
    results: dict = {"levels": []}
    print(HEADER)
    for concurrency in args.concurrency:
        results["levels"].append(await run_level(args, url, concurrency))
        print_level(results["levels"][-1])
    if args.chat_turns:
        results["chat_turns"] = await chat_turns(args, url)
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="checkpoint to serve (not needed with --url)")
    parser.add_argument("--url", help="benchmark a server that is already running")
    parser.add_argument("--server-pid", type=int, help="with --url: read its CPU time (Linux)")
    parser.add_argument(
        "--engine-only",
        action="store_true",
        help="run the same load on an Engine in this process instead (the server's ceiling)",
    )
    parser.add_argument("--device", default="auto")
    parser.add_argument("--no-overlap", action="store_true",
                        help="read every engine step back before planning the next")
    parser.add_argument(
        "--concurrency", default="1,8,32,64,128", type=lambda s: [int(c) for c in s.split(",")]
    )
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--requests", type=int, default=2, help="requests per concurrency slot")
    parser.add_argument("--max-seconds", type=float, default=60.0, help="per level")
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--startup-timeout", type=float, default=600.0)
    parser.add_argument("--chat-turns", type=int, default=0)
    parser.add_argument("--turn-words", type=int, default=40)
    parser.add_argument("--turn-reply-tokens", type=int, default=32)
    parser.add_argument(
        "--compare-no-prefix-cache",
        action="store_true",
        help="replay the chat on a second server without prefix caching",
    )
    parser.add_argument("--out", type=Path, default=ROOT / ".bench" / "serve.json")
    args = parser.parse_args()
    if not args.url and not args.model:
        parser.error("pass --model (to start a server) or --url")
    if args.engine_only and not args.model:
        parser.error("--engine-only needs --model")
    return args


def main() -> None:
    args = parse_args()
    if args.engine_only:
        results = engine_only(args)
        write_results(args, results)
        return
    process, url = (None, args.url) if args.url else start_server(args)
    if process is not None:
        args.server_pid = process.pid
    try:
        results = asyncio.run(measure(args, url))
    finally:
        if process is not None:
            stop_server(process)
    if args.chat_turns:
        print_turns("prefix caching on", results["chat_turns"])
    if args.chat_turns and args.compare_no_prefix_cache and not args.url:
        process, url = start_server(args, "--no-prefix-caching")
        try:
            results["chat_turns_no_prefix_cache"] = asyncio.run(chat_turns(args, url))
        finally:
            stop_server(process)
        print_turns("prefix caching off", results["chat_turns_no_prefix_cache"])
    write_results(args, results)


def write_results(args: argparse.Namespace, results: dict) -> None:
    import torch

    results["setup"] = {k: str(v) for k, v in vars(args).items()} | {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
