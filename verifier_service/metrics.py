"""Prometheus metrics of the verifier (served by `treeserve.server.start_metrics`).

Created once per process: prometheus_client refuses duplicate names in its default registry, and a
process may build several verifiers (benchmarks, tests)."""
from __future__ import annotations

import functools

from prometheus_client import Counter, Gauge, Histogram

_MS_BUCKETS = (0.5, 1, 2, 3, 5, 7.5, 10, 15, 20, 30, 50, 75, 100, 150, 250, 500, 1000, 2500)
# per-call stages are often far below a millisecond
_STAGE_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20, 50, 100, 250, 1000)
_COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


# A Verify call on the server, or one request/response pair of a VerifyStream (counted as a call),
# in order: decode (protobuf -> validated work), queue (hand-off until its forward begins: waiting
# behind other work or in the batching window), forward (commits + forward + per-node results),
# engine (the rest of its batches: checks, bookkeeping), handback (reply ready until the RPC thread
# has it; 0 when the RPC thread ran the model), encode (reply -> protobuf); total is the handler
# from start to end (for a stream message: from its arrival in the handler to its response being
# ready). What a client sees beyond total is gRPC. Recorded once the reply went out.
CALL_STAGES = ("decode", "queue", "forward", "engine", "handback", "encode", "total")


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
        # where a Verify call's time goes on the server, stage by stage (see CALL_STAGES)
        self.call_ms = Histogram(p + "call_ms", "Verify call (or stream message) time on the server by stage, "
                                 "milliseconds", ["stage"], buckets=_STAGE_BUCKETS)
        self._stage = {s: self.call_ms.labels(stage=s) for s in CALL_STAGES}
        self.inline_calls = Counter(p + "inline_calls", "Verify calls that found the model free and ran it themselves")
        self.errors = Counter(p + "errors", "Failed calls and failed batch items, by gRPC status code", ["code"])
        self.active_sequences = Gauge(p + "active_sequences", "Live sequences (state slots in use)")
        self.expired = Counter(p + "idle_expired", "Sequences released by the idle sweep")
        # read when scraped (VerifierServer points it at its direct port); 0 without one
        self.direct_connections = Gauge(p + "direct_connections", "Open connections on the direct port "
                                        "(--direct-port): engines whose steps take it")

    def call(self, stages: dict[str, float]) -> None:
        """Record one Verify call or stream message: milliseconds by stage (keys from CALL_STAGES)."""
        for name, ms in stages.items():
            self._stage[name].observe(ms)

    def error(self, code) -> None:
        """code: a grpc.StatusCode."""
        self.errors.labels(code=code.name).inc()


@functools.lru_cache(maxsize=None)
def metrics() -> VerifierMetrics:
    return VerifierMetrics()
