"""`noesis bench`: latency (TTFT, TPOT, batch-1 decode), offline throughput, telemetry overhead
and a bounded load generator against a running server, each beside the memory-bandwidth
roofline measured in the same run."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from noesis.sampling.params import SamplingParams


@dataclass(frozen=True)
class BenchConfig:
    prompt_len: int = 128
    gen_len: int = 128
    batches: tuple[int, ...] = (1, 8, 64)  # offline throughput batch sizes
    repeats: int = 3
    overhead_batches: tuple[int, ...] = ()  # telemetry overhead at these batch sizes
    overhead_steps: int = 64


def run_offline(engine, config: BenchConfig) -> dict[str, Any]:
    """Every offline measurement on a loaded engine, with the roofline beside each."""
    shapes = model_bytes(engine)
    bandwidth = copy_bandwidth(engine.device)
    report: dict[str, Any] = {
        "bandwidth_gb_s": bandwidth / 1e9,
        **shapes,
        "timings": engine.timing_buckets(),
    }
    report["latency"] = latency(engine, config)
    ctx = config.prompt_len + config.gen_len / 2
    report["latency"]["roofline_tok_s"] = roofline(bandwidth, shapes, 1, ctx)
    report["throughput"] = {}
    for batch in config.batches:
        entry = throughput(engine, batch, config)
        entry["roofline_tok_s"] = roofline(bandwidth, shapes, batch, ctx)
        report["throughput"][batch] = entry
    if config.overhead_batches:
        report["telemetry_overhead"] = telemetry_overhead(engine, config)
    return report


def model_bytes(engine) -> dict[str, int]:
    from noesis.kv.cache import page_bytes
    from noesis.telemetry.observer import weight_bytes

    loaded = engine.loaded
    return {
        "weight_bytes": weight_bytes(loaded.model),
        "kv_bytes_per_token": page_bytes(loaded.config, 1, loaded.dtype),
    }


def roofline(bandwidth: float, shapes: dict[str, int], batch: int, mean_ctx: float) -> float:
    """Decode tokens/s if each step only moved the weights once and each row's KV context."""
    step_bytes = shapes["weight_bytes"] + batch * mean_ctx * shapes["kv_bytes_per_token"]
    return batch * bandwidth / step_bytes


def copy_bandwidth(device: torch.device, repeats: int = 12) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read plus bytes written."""
    numel = (1 << 29) if device.type == "cuda" else (1 << 24)  # 2 GiB / 64 MiB of float32
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * numel * 4 / statistics.median(times[2:])


def prompt_ids(engine, length: int, seed: int) -> list[int]:
    vocab = engine.loaded.config.vocab_size
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(min(10, vocab - 1), vocab, (length,), generator=generator).tolist()


def latency(engine, config: BenchConfig) -> dict[str, float]:
    """Batch 1: time to first token, time per output token after it, decode tokens/s (medians
    over `repeats` runs)."""
    ttfts, tpots = [], []
    timed(engine, [prompt_ids(engine, config.prompt_len, 0)], 4)  # warm
    for repeat in range(config.repeats):
        prompt = prompt_ids(engine, config.prompt_len, 1 + repeat)
        first, total = timed(engine, [prompt], config.gen_len)
        ttfts.append(first)
        tpots.append((total - first) / max(config.gen_len - 1, 1))
    tpot = statistics.median(tpots)
    return {
        "ttft_ms": statistics.median(ttfts) * 1e3,
        "tpot_ms": tpot * 1e3,
        "decode_tok_s": 1 / tpot if tpot > 0 else float("inf"),
    }


def throughput(engine, batch: int, config: BenchConfig) -> dict[str, float]:
    """Offline: `batch` prompts at once; output tokens/s over the whole run and once all
    prompts are in (decode)."""
    prompts = [prompt_ids(engine, config.prompt_len, 100 + row) for row in range(batch)]
    first, total = timed(engine, prompts, config.gen_len)
    out_tokens = batch * config.gen_len
    decode_s = total - first
    return {
        "batch": batch,
        "seconds": total,
        "output_tok_s": out_tokens / total,
        "decode_tok_s": batch * (config.gen_len - 1) / decode_s if decode_s > 0 else 0.0,
    }


def timed(engine, prompts: list[list[int]], gen_len: int) -> tuple[float, float]:
    """(seconds to the first output token of all prompts, seconds to the end): greedy,
    exactly gen_len tokens each."""
    params = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)
    _sync(engine.device)
    start = time.perf_counter()
    pending = {engine.add_request(p, params) for p in prompts}
    started: set[str] = set()
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.token_ids:
                started.add(out.request_id)
            if out.finished:
                pending.discard(out.request_id)
        if first is None and len(started) == len(prompts):
            first = time.perf_counter() - start
    _sync(engine.device)
    total = time.perf_counter() - start
    return first if first is not None else total, total


def steady_decode(engine, prompts: list[list[int]], steps: int) -> float:
    """Seconds per engine step once every sequence decodes one token per step."""
    params = SamplingParams(temperature=0, max_tokens=steps + 16, ignore_eos=True)
    ids = [engine.add_request(p, params, stream=False) for p in prompts]
    running = engine.scheduler.running
    while engine.scheduler.waiting or any(s.num_computed < s.prompt_len for s in running):
        engine.step()
    for _ in range(3):  # past the steps that still mix in the last prefill chunk
        engine.step()
    _sync(engine.device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(engine.device)
    seconds = time.perf_counter() - start
    for request_id in ids:
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return seconds / steps


def telemetry_overhead(engine, config: BenchConfig, rounds: int = 5) -> dict[int, dict]:
    """Decode step time with telemetry off and on (in memory, plus a JSON-lines file),
    alternating `rounds` times per batch size; medians and the overhead in percent."""
    import tempfile

    from noesis.telemetry.observer import EngineObserver, weight_bytes
    from noesis.telemetry.recorder import Telemetry

    saved, results = engine.observer, {}
    shapes = model_bytes(engine)
    with tempfile.TemporaryDirectory() as folder:
        sink = Telemetry(
            f"{folder}/overhead.jsonl",
            weight_bytes(engine.loaded.model),
            shapes["kv_bytes_per_token"],
        )
        for batch in config.overhead_batches:
            prompts = [prompt_ids(engine, config.prompt_len, 200 + row) for row in range(batch)]
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(rounds):
                for on in (False, True):
                    engine.observer = EngineObserver(engine, sink, None) if on else None
                    engine.runner.timing = on
                    times[on].append(steady_decode(engine, prompts, config.overhead_steps))
            off, on = statistics.median(times[False]), statistics.median(times[True])
            results[batch] = {
                "step_ms_off": off * 1e3,
                "step_ms_on": on * 1e3,
                "overhead_pct": 100 * (on - off) / off,
            }
        sink.close()
    engine.observer = saved
    engine.runner.timing = saved is not None and saved.telemetry is not None
    return results


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- a running server -----------------------------------------------------------------------


@dataclass(frozen=True)
class LoadConfig:
    url: str
    requests: int = 64
    concurrency: int = 8
    prompt_len: int = 128  # words of the prompt
    gen_len: int = 128
    api_key: str | None = None
    timeout_s: float = 120.0  # per request
    model: str | None = None  # the served model name (default: the server's first)


def run_server_load(config: LoadConfig) -> dict[str, Any]:
    """At most `concurrency` streamed completions at a time, `requests` in all, each bounded
    by `timeout_s`: TTFT, TPOT and end-to-end percentiles, requests/s and output tokens/s."""
    return asyncio.run(_load(config))


async def _load(config: LoadConfig) -> dict[str, Any]:
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    base = config.url.rstrip("/")
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=config.timeout_s) as http:
        model = config.model or (await http.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(config.concurrency)
        body = {
            "model": model,
            "prompt": " ".join(["hello"] * config.prompt_len),
            "max_tokens": config.gen_len,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }

        async def one() -> dict[str, float] | None:
            async with gate:
                try:
                    return await asyncio.wait_for(_stream(http, body), config.timeout_s)
                except (httpx.HTTPError, asyncio.TimeoutError, ValueError):
                    return None

        start = time.perf_counter()
        samples = await asyncio.gather(*(one() for _ in range(config.requests)))
        wall = time.perf_counter() - start
    done = [s for s in samples if s is not None]
    return summarize_load(done, config.requests - len(done), wall)


async def _stream(http, body: dict) -> dict[str, float]:
    start = time.perf_counter()
    first, chunks = None, 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise ValueError(f"HTTP {response.status_code}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if json.loads(line[6:])["choices"][0].get("text"):
                chunks += 1
                first = first if first is not None else time.perf_counter() - start
    total = time.perf_counter() - start
    return {"ttft": first if first is not None else total, "total": total, "tokens": chunks}


def summarize_load(samples: list[dict[str, float]], failed: int, wall: float) -> dict[str, Any]:
    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    ttft = [s["ttft"] for s in samples]
    tpot = [(s["total"] - s["ttft"]) / (s["tokens"] - 1) for s in samples if s["tokens"] > 1]
    tokens = sum(s["tokens"] for s in samples)
    return {
        "requests": len(samples),
        "failed": failed,
        "seconds": wall,
        "requests_per_s": len(samples) / wall,
        "output_tok_s": tokens / wall,
        "ttft_ms_p50": pct(ttft, 0.5),
        "ttft_ms_p90": pct(ttft, 0.9),
        "tpot_ms_p50": pct(tpot, 0.5),
        "tpot_ms_p90": pct(tpot, 0.9),
        "e2e_ms_p50": pct([s["total"] for s in samples], 0.5),
    }


# ---- the table ------------------------------------------------------------------------------


def format_offline(report: dict[str, Any]) -> str:
    lat = report["latency"]
    lines = [
        f"memory bandwidth (copy, this run): {report['bandwidth_gb_s']:.1f} GB/s; weights "
        f"{report['weight_bytes'] / 2**20:.1f} MiB; KV {report['kv_bytes_per_token']} B/token",
        f"latency (batch 1): TTFT {lat['ttft_ms']:.2f} ms, TPOT {lat['tpot_ms']:.2f} ms, decode "
        f"{lat['decode_tok_s']:.1f} tok/s (roofline {lat['roofline_tok_s']:.1f}, "
        f"{_share(lat['decode_tok_s'], lat['roofline_tok_s'])})",
        f"{'batch':>6} {'output tok/s':>13} {'decode tok/s':>13} {'roofline':>10} {'share':>7}",
    ]
    for batch, entry in report["throughput"].items():
        lines.append(
            f"{batch:>6} {entry['output_tok_s']:>13.1f} {entry['decode_tok_s']:>13.1f} "
            f"{entry['roofline_tok_s']:>10.1f} "
            f"{_share(entry['decode_tok_s'], entry['roofline_tok_s']):>7}"
        )
    for batch, entry in report.get("telemetry_overhead", {}).items():
        lines.append(
            f"telemetry overhead at batch {batch}: {entry['step_ms_off']:.3f} -> "
            f"{entry['step_ms_on']:.3f} ms per decode step ({entry['overhead_pct']:+.2f}%)"
        )
    return "\n".join(lines)


def format_load(report: dict[str, Any]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    return (
        f"{report['requests']} requests ({report['failed']} failed) in "
        f"{report['seconds']:.2f} s: {report['requests_per_s']:.2f} req/s, "
        f"{report['output_tok_s']:.1f} output tok/s; TTFT p50/p90 {ms(report['ttft_ms_p50'])}"
        f"/{ms(report['ttft_ms_p90'])} ms, TPOT p50/p90 {ms(report['tpot_ms_p50'])}/"
        f"{ms(report['tpot_ms_p90'])} ms, end-to-end p50 {ms(report['e2e_ms_p50'])} ms"
    )


def _share(value: float, ceiling: float) -> str:
    return f"{100 * value / ceiling:.0f}%" if ceiling else "-"
