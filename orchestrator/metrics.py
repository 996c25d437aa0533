"""Prometheus metrics of the public Generation service (served by `treeserve.server.start_metrics`
when the orchestrator runs with --metrics-port). Per-replica engine figures (load, steps, measured
acceptance and verify cost) are in `Coordinator.stats()`.

Created once per process: prometheus_client refuses duplicate names in its default registry."""
from __future__ import annotations

import functools

from prometheus_client import Counter, Gauge, Histogram

_S_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TAU_BUCKETS = (1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 8)


class GenerationMetrics:
    def __init__(self) -> None:
        p = "treeserve_orchestrator_"
        self.requests = Counter(p + "requests", "Finished Generate requests, by finish reason or error code", ["outcome"])
        self.active = Gauge(p + "active_requests", "Generate streams in progress")
        self.tokens = Counter(p + "generated_tokens", "Tokens sent to clients")
        self.forwards = Counter(p + "target_forwards", "Target forward passes of finished requests (prefill included)")
        self.first_token = Histogram(p + "time_to_first_token_seconds", "From request to first token", buckets=_S_BUCKETS)
        self.tau = Histogram(p + "tokens_per_forward", "Mean tokens per target forward, per request", buckets=_TAU_BUCKETS)


@functools.lru_cache(maxsize=None)
def metrics() -> GenerationMetrics:
    return GenerationMetrics()
