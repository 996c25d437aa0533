"""Drafter metrics: a plain dataclass per drafter (what `Stats` returns) mirrored into Prometheus
collectors (process-wide, created once)."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

_collectors = None
_collectors_lock = threading.Lock()


def _prometheus():
    global _collectors
    with _collectors_lock:
        if _collectors is None:
            from prometheus_client import Counter, Gauge, Histogram

            ms = (0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
            _collectors = {
                "trees": Counter("treeserve_drafter_trees_total", "Trees drafted", ["shape"]),
                "errors": Counter("treeserve_drafter_errors_total", "Draft requests answered with an error", ["code"]),
                "draft_ms": Histogram("treeserve_drafter_draft_ms", "Time to answer a draft request (ms)", buckets=ms),
                "nodes": Histogram("treeserve_drafter_tree_nodes", "Nodes per drafted tree",
                                   buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256)),
                "hits": Counter("treeserve_drafter_ahead_hits_total", "Trees served from draft-ahead"),
                "misses": Counter("treeserve_drafter_ahead_misses_total", "Draft-ahead rounds whose outcome was not prepared"),
                "saved_ms": Counter("treeserve_drafter_ahead_saved_ms_total", "Drafting time saved by draft-ahead hits (ms)"),
                "hit_rate": Gauge("treeserve_drafter_ahead_hit_rate", "Draft-ahead hits / (hits + misses)"),
                "active": Gauge("treeserve_drafter_active_sequences", "Sequences with draft state"),
                "expired": Counter("treeserve_drafter_idle_expired_total", "Sequences ended by the idle sweep"),
                "direct": Gauge("treeserve_drafter_direct_connections",
                                "Open connections on the direct port (--direct-port; 0 without one)"),
            }
        return _collectors


@dataclass
class DrafterMetrics:
    strategy: str
    trees: int = 0
    draft_ms_total: float = 0.0
    ahead_hits: int = 0
    ahead_misses: int = 0
    saved_ms: float = 0.0
    errors: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def mean_draft_ms(self) -> float:
        return self.draft_ms_total / self.trees if self.trees else 0.0

    @property
    def hit_rate(self) -> float:
        total = self.ahead_hits + self.ahead_misses
        return self.ahead_hits / total if total else 0.0

    def tree(self, shape: str, nodes: int, draft_ms: float) -> None:
        with self._lock:
            self.trees += 1
            self.draft_ms_total += draft_ms
        p = _prometheus()
        p["trees"].labels(shape).inc()
        p["draft_ms"].observe(draft_ms)
        p["nodes"].observe(nodes)

    def ahead(self, hit: bool, saved_ms: float = 0.0) -> None:
        with self._lock:
            if hit:
                self.ahead_hits += 1
                self.saved_ms += max(0.0, saved_ms)
            else:
                self.ahead_misses += 1
            rate = self.hit_rate
        p = _prometheus()
        (p["hits"] if hit else p["misses"]).inc()
        if hit:
            p["saved_ms"].inc(max(0.0, saved_ms))
        p["hit_rate"].set(rate)

    def error(self, code_name: str) -> None:
        with self._lock:
            self.errors += 1
        _prometheus()["errors"].labels(code_name).inc()

    def active(self, n: int) -> None:
        _prometheus()["active"].set(n)

    def expired(self) -> None:
        _prometheus()["expired"].inc()

    def direct_connections(self, count) -> None:
        """`count()`: the direct port's open connections, read at each scrape."""
        _prometheus()["direct"].set_function(count)
