"""Prometheus metrics, all named noesis_*: request outcomes and latencies, queue and KV state."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from noesis.engine.async_engine import AsyncEngine, RequestTimes
from noesis.engine.outputs import RequestOutput

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

    def record(self, out: RequestOutput | None, times: RequestTimes, reason: str) -> None:
        """One generation ended: `out` is its last output (None when it never produced one)."""
        self.requests.labels(reason).inc()
        if out is None:
            return
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        if times.first_token is None:
            return
        self.ttft.observe(times.first_token - times.arrival)
        if times.finished is not None:
            self.e2e.observe(times.finished - times.arrival)
            if len(out.token_ids) > 1:
                gaps = len(out.token_ids) - 1
                self.tpot.observe((times.finished - times.first_token) / gaps)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """Engine state read at scrape time (lengths and counters written by the engine thread)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        engine = self.engine.engine
        scheduler, allocator = engine.scheduler, engine.allocator
        gauges = {
            "noesis_queue_depth": ("Sequences waiting for admission", len(scheduler.waiting)),
            "noesis_running_sequences": ("Sequences in the running batch", len(scheduler.running)),
            "noesis_requests_in_flight": (
                "Generations accepted and not finished",
                self.engine.num_in_flight,
            ),
            "noesis_kv_pages_total": ("KV pages in the pool", allocator.num_pages),
            "noesis_kv_pages_used": ("KV pages referenced by sequences", allocator.num_used),
            "noesis_kv_pages_free": ("KV pages free (cached ones included)", allocator.num_free),
            "noesis_kv_pages_cached": (
                "Unreferenced KV pages kept for the prefix cache",
                allocator.num_parked,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        cache = engine.prefix_cache
        queries = cache.query_tokens if cache else 0
        hits = cache.hit_tokens if cache else 0
        yield CounterMetricFamily(
            "noesis_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            value=queries,
        )
        yield CounterMetricFamily(
            "noesis_prefix_cache_hits", "Prompt tokens found in the prefix cache", value=hits
        )
        yield CounterMetricFamily(
            "noesis_engine_step_failures",
            "Engine steps that raised",
            value=self.engine.num_step_failures,
        )
