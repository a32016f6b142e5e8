"""Prometheus metrics, all named noesis_*: request outcomes and latencies, queue and KV state."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from noesis.engine.async_engine import AsyncEngine, RequestTimes

LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    1.5,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self, engine: AsyncEngine) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.http_requests = Counter(
            "noesis_http_requests",
            "HTTP requests by route and status code",
            ["route", "status"],
            registry=r,
        )
        self.requests = Counter(
            "noesis_requests",
            "Finished generations (one per choice) by finish reason",
            ["finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "noesis_prompt_tokens", "Prompt tokens of finished generations", registry=r
        )
        self.generation_tokens = Counter(
            "noesis_generation_tokens", "Generated tokens of finished generations", registry=r
        )
        self.ttft = Histogram(
            "noesis_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "noesis_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per generation",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "noesis_request_latency_seconds",
            "Arrival to finish, per generation",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(engine))

    def record(
        self, reason: str, times: RequestTimes, prompt_tokens: int | None, output_tokens: int
    ) -> None:
        """One generation ended; prompt_tokens is None when it never produced an output."""
        self.requests.labels(reason).inc()
        if prompt_tokens is None:
            return
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        if times.first_token is None:
            return
        self.ttft.observe(times.first_token - times.arrival)
        if times.finished is not None:
            self.e2e.observe(times.finished - times.arrival)
            if output_tokens > 1:
                self.tpot.observe((times.finished - times.first_token) / (output_tokens - 1))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Engine state read at scrape time (as of the engine loop's latest round)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        stats = self.engine.stats()
        gauges = {
            "noesis_queue_depth": ("Sequences waiting for admission", stats.waiting),
            "noesis_running_sequences": ("Sequences in the running batch", stats.running),
            "noesis_requests_in_flight": (
                "Generations accepted and not finished",
                self.engine.num_in_flight,
            ),
            "noesis_kv_pages_total": ("KV pages in the pool", stats.kv_pages_total),
            "noesis_kv_pages_used": ("KV pages referenced by sequences", stats.kv_pages_used),
            "noesis_kv_pages_free": ("KV pages free (cached ones included)", stats.kv_pages_free),
            "noesis_kv_pages_cached": (
                "Unreferenced KV pages kept for the prefix cache",
                stats.kv_pages_cached,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "noesis_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            value=stats.prefix_query_tokens,
        )
        yield CounterMetricFamily(
            "noesis_prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            value=stats.prefix_hit_tokens,
        )
        yield GaugeMetricFamily(
            "noesis_grammar_compiling",
            "Requests waiting for their grammar to compile (outside the batch)",
            value=stats.compiling,
        )
        yield CounterMetricFamily(
            "noesis_engine_step_failures",
            "Engine steps that failed for no one request (the requests in flight failed)",
            value=self.engine.num_step_failures,
        )
        grammar = stats.grammar
        yield GaugeMetricFamily(
            "noesis_grammar_cache_bytes",
            "Estimated bytes of the compiled grammars cached (an LRU under a byte budget)",
            value=grammar.get("bytes", 0),
        )
        yield GaugeMetricFamily(
            "noesis_grammar_cache_entries", "Compiled grammars cached",
            value=grammar.get("entries", 0),
        )
        for key, doc in (("compiles", "Grammar compiles started (off the engine loop)"),
                         ("failures", "Grammars refused: invalid, unsupported or over a limit"),
                         ("timeouts", "Grammar compiles past their time limit")):
            yield CounterMetricFamily(f"noesis_grammar_{key}", doc, value=grammar.get(key, 0))
        for key, doc in (("proposed", "Speculative decoding: proposed tokens verified"),
                         ("accepted", "Speculative decoding: proposed tokens accepted"),
                         ("verify_rows", "Speculative decoding: verify rows run (one per "
                          "request per step that verified proposals)"),
                         ("target_rows", "Speculative decoding: rows of target forwards that "
                          "sampled a token (plain or verify)"),
                         ("generated", "Speculative decoding: tokens those rows added")):
            yield CounterMetricFamily(f"noesis_spec_{key}", doc,
                                      value=stats.speculative.get(key, 0))
        yield from _spec_channel_metrics(stats.spec_channels)
        yield from _telemetry_histograms(stats.telemetry)
        yield from _sidecar_metrics(stats.sidecars)
        faults = self.engine.fault_counts()
        yield CounterMetricFamily(
            "noesis_isolated_steps",
            "Failed engine steps re-run one sequence at a time to find the failing request",
            value=faults["isolated_steps"],
        )
        yield CounterMetricFamily(
            "noesis_request_errors",
            "Requests ended by a failure of their own (the rest of the batch went on)",
            value=faults["request_errors"],
        )
        yield CounterMetricFamily(
            "noesis_engine_restarts",
            "Fresh engine processes started after a fault or a crash",
            value=self.engine.num_restarts,
        )


TELEMETRY_HISTOGRAMS = {
    "step_gpu_seconds": "Device time per engine step (CUDA events; host time on the CPU)",
    "step_host_seconds": "Host time per engine step, less its waits for the device",
    "batch_rows": "Sequences per engine step",
    "spec_verify_rate": "Speculative decoding: accepted share of each verify row's proposals",
}


def _telemetry_histograms(snapshot: dict[str, tuple]):
    """The engine's telemetry histograms (served with --telemetry; none without)."""
    for name, doc in TELEMETRY_HISTOGRAMS.items():
        if name not in snapshot:
            continue
        bounds, counts, total, count = snapshot[name]
        buckets, running = [], 0
        for bound, bucket_count in zip(bounds, counts, strict=True):
            running += bucket_count
            buckets.append((repr(float(bound)), running))
        buckets.append(("+Inf", count))
        yield HistogramMetricFamily(f"noesis_{name}", doc, buckets=buckets, sum_value=total)


SPEC_CHANNEL_COUNTERS = {
    "verify_rows": "verify rows run, by the channel of the row's first proposed position",
    "proposed": "proposed tokens verified",
    "accepted": "proposed tokens accepted",
    "target_rows": "rows of target forwards that sampled a token (plain or verify)",
    "generated": "tokens those rows added (generated / target_rows: tokens per target forward)",
}


def _spec_channel_metrics(channels: dict[str, dict[str, int]]):
    """Speculative decoding's counters per output channel (label `channel`: Harmony's analysis,
    commentary, final, header, other; text for other tokenizers). None when it is off."""
    for key, doc in SPEC_CHANNEL_COUNTERS.items():
        family = CounterMetricFamily(f"noesis_spec_channel_{key}",
                                     f"Speculative decoding per channel: {doc}",
                                     labels=["channel"])
        for channel, counts in channels.items():
            family.add_metric([channel], counts[key])
        if channels:
            yield family


def _sidecar_metrics(sidecars: dict[str, dict]):
    """Per sidecar (label `sidecar`): each window's wait for its call, windows offered, dropped
    and failed, calls (a batched sidecar scores several windows a call), and decisions taken
    (label `decision`)."""
    latency = HistogramMetricFamily("noesis_sidecar_latency_seconds",
                                    "Seconds a window's sidecar call took", labels=["sidecar"])
    counters = {key: CounterMetricFamily(f"noesis_sidecar_{key}", doc, labels=["sidecar"])
                for key, doc in (("windows", "Text windows offered to a sidecar"),
                                 ("drops", "Windows dropped: the sidecar's queue was full"),
                                 ("errors", "Windows whose sidecar call raised"),
                                 ("calls", "Sidecar calls (one may score several windows)"))}
    decisions = CounterMetricFamily("noesis_sidecar_decisions",
                                    "Sidecar decisions (block: the request ended with "
                                    "content_filter)", labels=["sidecar", "decision"])
    for name, stats in sidecars.items():
        buckets, running = [], 0
        for bound, count in zip(stats["latency_bounds"], stats["latency_counts"], strict=False):
            running += count
            buckets.append((repr(float(bound)), running))
        buckets.append(("+Inf", stats["completed"]))
        latency.add_metric([name], buckets, sum_value=stats["latency_s"])
        for key, family in counters.items():
            family.add_metric([name], stats[key])
        for decision, count in stats["decisions"].items():
            decisions.add_metric([name, decision], count)
    if sidecars:
        yield from (latency, *counters.values(), decisions)
