"""Serving benchmark: a bounded loopback load generator against `noesis serve`.

    python benchmarks/serve.py --model DIR [--device cpu] [--concurrency 1,8,32,64,128]
        [--prompt-len 512] [--output-len 256] [--requests 2] [--max-seconds 60]
        [--chat-turns 20] [--compare-no-prefix-cache] [--out .bench/serve.json]

It starts the server on 127.0.0.1 (or targets `--url`), then at each concurrency level keeps that
many streaming /v1/completions requests in flight (random token prompts of --prompt-len, exactly
--output-len new tokens via ignore_eos) until `--requests` x concurrency have been sent or
`--max-seconds` have passed. It reports output tokens/s, requests/s, p50/p99 time to first token
and per-token latency (mean gap between a request's tokens after the first), and errors.
Requests ask for logprobs=0 so that every token is an event: random-weight checkpoints emit ids
that their small tokenizer decodes to no text. `--chat-turns N` also plays one N-turn chat (the
whole history resent every turn) and reports the time to first token per turn: flat with prefix
caching, growing without it. Prints a table and writes JSON.
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
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-queue",
        "1024",
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


async def stream_request(client: httpx.AsyncClient, url: str, body: dict) -> Sample:
    """Send one streaming request; time its first token and the gaps after it."""
    sample, first, last = Sample(), None, None
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Sample(error=f"{response.status_code}: {response.text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Sample(error=chunk["error"]["message"])
                if chunk.get("choices"):
                    last = time.perf_counter()
                    first = first or last
                if chunk.get("usage"):
                    sample.tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        return Sample(error=repr(exc))
    if first is None:
        return Sample(error="no tokens")
    sample.ttft = first - start
    if sample.tokens > 1:
        sample.tpot = (last - first) / (sample.tokens - 1)
    return sample


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
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:

        async def worker() -> None:
            nonlocal sent
            while sent < total and time.perf_counter() < deadline:
                sent += 1
                body = completion_body(args, rng)
                samples.append(await stream_request(client, url + "/v1/completions", body))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return summarize(concurrency, samples, wall)


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
)


def print_level(r: dict) -> None:
    print(
        f"{r['concurrency']:>5} {r['requests']:>5} {r['errors']:>4} "
        f"{r['output_tok_s']:>10.1f} {r['requests_s']:>7.2f} {r['ttft_p50_ms']:>9.1f} "
        f"{r['ttft_p99_ms']:>9.1f} {r['tpot_p50_ms']:>9.2f} {r['tpot_p99_ms']:>9.2f}",
        flush=True,
    )


def print_turns(label: str, turns: list[dict]) -> None:
    first, last = turns[0], turns[-1]
    print(
        f"{label}: TTFT turn 1 {first['ttft_ms']:.1f} ms ({first['prompt_tokens']} prompt "
        f"tokens), turn {last['turn']} {last['ttft_ms']:.1f} ms "
        f"({last['prompt_tokens']} prompt tokens)"
    )


async def measure(args: argparse.Namespace, url: str) -> dict:
    warm = completion_body(args, random.Random(-1)) | {"max_tokens": 2}
    async with httpx.AsyncClient(timeout=args.request_timeout) as client:
        await stream_request(client, url + "/v1/completions", warm)
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
    parser.add_argument("--device", default="auto")
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
    return args


def main() -> None:
    args = parse_args()
    process, url = (None, args.url) if args.url else start_server(args)
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
