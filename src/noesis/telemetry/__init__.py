"""Telemetry, timing buckets, benchmarks and deterministic replay (see ARCHITECTURE.md)."""

from noesis.telemetry.recorder import RequestMetrics, Telemetry, read_records
from noesis.telemetry.trace import Trace, TraceError, load_trace

__all__ = ["RequestMetrics", "Telemetry", "Trace", "TraceError", "load_trace", "read_records"]
