"""Bounded soak of `noesis serve`: valid and malformed traffic at once, clients that vanish.

    python benchmarks/soak.py --model DIR [--device cpu] [--duration 600] [--concurrency 32]
        [--seed 0] [--out .bench/soak.json]
    python benchmarks/soak.py --url http://127.0.0.1:8000 --server-pid PID --model-name NAME ...

`--concurrency` clients run on loopback until `--duration` seconds have passed. Each round a client
picks one of: a valid completion (streamed or not) whose text must equal what the same request
gave alone before the soak (greedy, a fixed token budget: any difference is a mixed-up or corrupted
response), a stream it drops after a few events (a client disconnect), or a malformed request (bad
JSON, nesting, out-of-range knobs, lone surrogates, unknown model, a prompt over the context) that
must get a 4xx with an OpenAI error body. At the end it waits for the server to go idle and checks
that no KV page is still referenced. It reports counts, crashes (a 5xx, a dropped connection on a
valid request, the server gone), mismatches, leaked pages, and the resident memory of the server
and its engine process before and after (growth in percent). Prints a table, writes JSON, and exits
non-zero when anything failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import serve as serve_bench  # noqa: E402

MODEL = serve_bench.MODEL
PROMPTS = ["Hello", "The weather today", "One two three", "A story about", "def f(x):", "Why"]
BUDGETS = (4, 8, 16)
# Each: (path, body, expected status). Bodies are bytes or JSON-able objects.
DEEP = b'{"model": "m", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def malformed(model: str, context: int) -> list[tuple[str, object, int]]:
    chat = "/v1/chat/completions"
    messages = [{"role": "user", "content": "hi"}]
    return [
        ("/v1/completions", b'{"model": "x", "prompt": ', 400),
        ("/v1/completions", b"\xff\xfe not utf-8", 400),
        ("/v1/completions", DEEP, 400),
        ("/v1/completions", {"model": model, "prompt": "x", "top_k": 2**63}, 400),
        ("/v1/completions", {"model": model, "prompt": "x", "temperature": "hot"}, 400),
        ("/v1/completions", {"model": model, "prompt": "x", "max_tokens": -1}, 400),
        ("/v1/completions", {"model": model, "prompt": [[0, 10**12]]}, 400),
        ("/v1/completions", {"model": model, "prompt": "word " * (context * 2)}, 400),
        ("/v1/completions", {"model": "no-such-model", "prompt": "x"}, 404),
        (chat, b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}'
         % model.encode(), 400),
        (chat, {"model": model, "messages": []}, 400),
        (chat, {"model": model, "messages": messages, "n": 10**6}, 400),
        (chat, {"model": model, "messages": messages, "seed": 2**64}, 400),
    ]


@dataclass
class SoakReport:
    duration_s: float = 0.0
    concurrency: int = 0
    valid: int = 0
    streamed: int = 0
    disconnects: int = 0
    malformed: int = 0
    mismatches: int = 0
    crashes: int = 0
    wrong_status: int = 0
    leaked_kv_pages: int = 0
    rss_mb_before: dict[str, float] = field(default_factory=dict)
    rss_mb_after: dict[str, float] = field(default_factory=dict)
    rss_growth_pct: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.mismatches or self.crashes or self.wrong_status or self.leaked_kv_pages)

    def note(self, kind: str, text: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        if len(self.problems) < 20:
            self.problems.append(f"{kind}: {text}")


class Soak:
    def __init__(self, url: str, model: str, context: int, pids: list[int], seed: int) -> None:
        self.url = url
        self.model = model
        self.context = context
        self.pids = pids
        self.rng = random.Random(seed)
        self.bad = malformed(model, context)
        self.expected: dict[tuple[str, int], str] = {}
        self.report = SoakReport()

    def body(self, prompt: str, budget: int, stream: bool) -> dict:
        return {"model": self.model, "prompt": prompt, "max_tokens": budget, "temperature": 0,
                "ignore_eos": True, "stream": stream}

    async def prepare(self, client: httpx.AsyncClient) -> None:
        """What each valid request gives when it runs alone."""
        for prompt in PROMPTS:
            for budget in BUDGETS:
                body = self.body(prompt, budget, False)
                response = await client.post("/v1/completions", json=body)
                response.raise_for_status()
                self.expected[(prompt, budget)] = response.json()["choices"][0]["text"]

    async def run(self, duration: float, concurrency: int) -> SoakReport:
        limits = httpx.Limits(max_connections=concurrency * 2)
        async with httpx.AsyncClient(base_url=self.url, timeout=60, limits=limits) as client:
            await self.prepare(client)
            await self.wait_idle(client)
            self.report.rss_mb_before = rss_mb(self.pids)
            start = time.monotonic()
            deadline = start + duration
            await asyncio.gather(*(self.client(client, deadline) for _ in range(concurrency)))
            self.report.duration_s = round(time.monotonic() - start, 1)
            self.report.concurrency = concurrency
            metrics = await self.wait_idle(client)
            self.report.leaked_kv_pages = int(metrics.get("noesis_kv_pages_used", -1))
        self.report.rss_mb_after = rss_mb(self.pids)
        before, after = (sum(r.values()) for r in (self.report.rss_mb_before,
                                                      self.report.rss_mb_after))
        self.report.rss_growth_pct = round(100 * (after - before) / max(before, 1e-9), 1)
        return self.report

    async def client(self, client: httpx.AsyncClient, deadline: float) -> None:
        while time.monotonic() < deadline:
            roll = self.rng.random()
            try:
                if roll < 0.3:
                    await self.valid(client)
                elif roll < 0.6:
                    await self.stream(client, drop_after=None)
                elif roll < 0.75:
                    await self.stream(client, drop_after=self.rng.randint(0, 3))
                else:
                    await self.hostile(client)
            except (httpx.TransportError, httpx.HTTPStatusError) as exc:
                self.report.note("crashes", repr(exc))

    def pick(self) -> tuple[str, int]:
        return self.rng.choice(PROMPTS), self.rng.choice(BUDGETS)

    async def valid(self, client: httpx.AsyncClient) -> None:
        prompt, budget = self.pick()
        response = await client.post("/v1/completions", json=self.body(prompt, budget, False))
        if response.status_code == 429:
            return  # admission control at work: not an error
        response.raise_for_status()
        self.report.valid += 1
        text = response.json()["choices"][0]["text"]
        if text != self.expected[(prompt, budget)]:
            self.report.note("mismatches", f"{prompt!r}/{budget}: {text!r}")

    async def stream(self, client: httpx.AsyncClient, drop_after: int | None) -> None:
        prompt, budget = self.pick()
        body = self.body(prompt, budget, True)
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code == 429:
                return
            response.raise_for_status()
            text, events = "", 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.report.note("crashes", f"in-band error {event['error']}")
                    return
                text += event["choices"][0]["text"]
                events += 1
                if drop_after is not None and events > drop_after:
                    self.report.disconnects += 1
                    return  # leaving the block closes the connection mid-stream
        self.report.streamed += 1
        if text != self.expected[(prompt, budget)]:
            self.report.note("mismatches", f"stream {prompt!r}/{budget}: {text!r}")

    async def hostile(self, client: httpx.AsyncClient) -> None:
        path, body, status = self.rng.choice(self.bad)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        response = await client.post(path, content=content, headers=headers)
        self.report.malformed += 1
        error = _error_of(response)
        if response.status_code != status or error is None:
            self.report.note("wrong_status", f"{path} -> {response.status_code} "
                                              f"{response.text[:200]!r} (wanted {status})")

    async def wait_idle(self, client: httpx.AsyncClient, timeout: float = 60) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            metrics = parse_metrics((await client.get("/metrics")).text)
            busy = sum(metrics.get(k, 0) for k in ("noesis_running_sequences",
                                                   "noesis_queue_depth",
                                                   "noesis_requests_in_flight",
                                                   "noesis_kv_pages_used"))
            if not busy or time.monotonic() > deadline:
                return metrics
            await asyncio.sleep(0.1)


def _error_of(response: httpx.Response) -> dict | None:
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return None
    return error if isinstance(error, dict) and error.get("message") else None


def parse_metrics(text: str) -> dict[str, float]:
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def rss_mb(pids: list[int]) -> dict[str, float]:
    """VmRSS of each process (and its children: the engine process), in MiB."""
    out = {}
    for pid in pids:
        for one in [pid, *children(pid)]:
            try:
                status = Path(f"/proc/{one}/status").read_text()
            except OSError:
                continue
            kib = next(int(line.split()[1]) for line in status.splitlines()
                       if line.startswith("VmRSS:"))
            out[str(one)] = round(kib / 1024, 1)
    return out


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    """`noesis serve` on a free loopback port, as benchmarks/serve.py starts it."""
    options = argparse.Namespace(model=args.model, device=args.device, max_num_seqs=64,
                                 no_overlap=False, startup_timeout=120)
    return serve_bench.start_server(options)


def print_table(report: SoakReport) -> None:
    rows = [(k, v) for k, v in asdict(report).items() if k != "problems"]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    for problem in report.problems:
        print("  -", problem)
    print("OK" if report.ok else "FAILED")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="checkpoint to serve (starts a server)")
    parser.add_argument("--url", help="soak a running server instead")
    parser.add_argument("--server-pid", type=int, help="with --url: its pid, for memory")
    parser.add_argument("--model-name", default=MODEL, help="with --url: the served name")
    parser.add_argument("--context", type=int, default=None, help="the served context length")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=".bench/soak.json")
    args = parser.parse_args()
    if not (args.model or args.url):
        parser.error("give --model (a server is started) or --url")
    process = None
    url, name, pids = args.url, args.model_name, [args.server_pid] if args.server_pid else []
    if args.model:
        process, url = start_server(args)
        name, pids = MODEL, [process.pid]
    try:
        context = args.context or httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"]
        soak = Soak(url, name, context, pids, args.seed)
        report = asyncio.run(soak.run(args.duration, args.concurrency))
        if process is not None and process.poll() is not None:
            report.note("crashes", f"the server exited with {process.returncode}")
    finally:
        if process is not None:
            serve_bench.stop_server(process)
    print_table(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**asdict(report), "ok": report.ok}, indent=2))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
