"""Prometheus metrics of the verifier (served by `treeserve.server.start_metrics`).

Created once per process: prometheus_client refuses duplicate names in its default registry, and a
process may build several verifiers (benchmarks, tests)."""
from __future__ import annotations

import functools

from prometheus_client import Counter, Gauge, Histogram

_MS_BUCKETS = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 50, 75, 100, 150, 250, 500, 1000, 2500)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


class VerifierMetrics:
    def __init__(self) -> None:
        p = "treeserve_verifier_"
        self.forward_passes = Counter(p + "forward_passes", "Batched tree-verification forward passes")
        self.nodes_verified = Counter(p + "nodes_verified", "Tree nodes verified")
        self.prefills = Counter(p + "prefills", "Prompts prefilled")
        self.commits = Counter(p + "commits", "Commits applied (no-op repeats excluded)")
        self.batch_sequences = Histogram(p + "batch_sequences", "Sequences per verification forward", buckets=_COUNT_BUCKETS)
        self.batch_nodes = Histogram(p + "batch_nodes", "Tree nodes per verification forward", buckets=_COUNT_BUCKETS)
        self.forward_ms = Histogram(p + "forward_ms", "Commit + forward + per-node results, milliseconds", buckets=_MS_BUCKETS)
        self.errors = Counter(p + "errors", "Failed calls and failed batch items, by gRPC status code", ["code"])
        self.active_sequences = Gauge(p + "active_sequences", "Live sequences (state slots in use)")
        self.expired = Counter(p + "idle_expired", "Sequences released by the idle sweep")

    def error(self, code) -> None:
        """code: a grpc.StatusCode."""
        self.errors.labels(code=code.name).inc()


@functools.lru_cache(maxsize=None)
def metrics() -> VerifierMetrics:
    return VerifierMetrics()
