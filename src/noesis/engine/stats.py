"""EngineStats: the engine's state for /metrics and the stats log, read at the end of a round."""

from __future__ import annotations

from dataclasses import dataclass, field

from noesis.engine.engine import Engine


@dataclass(slots=True)
class EngineStats:
    """Engine state for /metrics, as of the end of the engine loop's latest round."""

    waiting: int = 0
    running: int = 0
    kv_pages_total: int = 0
    kv_pages_used: int = 0
    kv_pages_free: int = 0
    kv_pages_cached: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prompt_tokens: int = 0  # prompt tokens computed so far (the scheduler's count)
    generation_tokens: int = 0  # tokens generated so far
    compiling: int = 0  # requests waiting for their grammar
    isolated_steps: int = 0  # steps that failed and were re-run one sequence at a time
    request_errors: int = 0  # requests ended by a failure of their own
    grammar: dict[str, int] = field(default_factory=dict)  # the grammar compiler's stats()
    speculative: dict[str, int] = field(default_factory=dict)  # Engine.spec_counts ({}: off)
    spec_channels: dict[str, dict[str, int]] = field(default_factory=dict)  # per channel
    telemetry: dict[str, tuple] = field(default_factory=dict)  # its histograms ({}: off)
    sidecars: dict[str, dict] = field(default_factory=dict)  # SidecarRuntime.stats() ({}: none)

    @classmethod
    def of(cls, engine: Engine) -> EngineStats:
        scheduler, allocator, cache = engine.scheduler, engine.allocator, engine.prefix_cache
        return cls(
            grammar=engine.grammar_stats(),
            speculative=engine.spec_counts,
            spec_channels=engine.spec_channels,
            telemetry=engine.observer.telemetry.snapshot()
            if engine.observer is not None and engine.observer.telemetry is not None else {},
            compiling=engine.num_compiling,
            sidecars=engine.sidecars.stats() if engine.sidecars is not None else {},
            isolated_steps=engine.fault_counts["isolated_steps"],
            request_errors=engine.fault_counts["request_errors"],
            waiting=len(scheduler.waiting),
            running=len(scheduler.running),
            kv_pages_total=allocator.num_pages,
            kv_pages_used=allocator.num_used,
            kv_pages_free=allocator.num_free,
            kv_pages_cached=allocator.num_parked,
            prefix_query_tokens=cache.query_tokens if cache else 0,
            prefix_hit_tokens=cache.hit_tokens if cache else 0,
            prompt_tokens=scheduler.num_prompt_tokens,
            generation_tokens=scheduler.num_generated_tokens,
        )
