"""The verifier's configured limits, in one place (the CLI fills them, every module reads them)."""
from __future__ import annotations

from dataclasses import dataclass

# The wire contract caps per-node top-k log-probabilities at 20.
MAX_TOP_LOGPROBS = 20
MAX_SEQUENCE_ID_BYTES = 128
# A batching window is a few milliseconds; one of 10 s is already far past any use (the forward it
# delays is a step of every client that shares it), and the bound keeps every wait finite.
MAX_BATCH_WINDOW_MS = 10_000.0


@dataclass(frozen=True)
class Limits:
    """max_sequences: live sequences (= state slots), and so also Verify items per request.
    max_tree_nodes: nodes per tree. max_sequence_length: tokens a sequence may hold, the tree being
    verified included. batch_window_ms: how long the first Verify item of a batch waits for company
    (at most MAX_BATCH_WINDOW_MS). max_batch: sequences per forward. max_batch_nodes: tree nodes
    per forward. idle_timeout_s: sequences untouched this long are released (0: never)."""

    max_sequences: int = 64
    max_tree_nodes: int = 64
    max_sequence_length: int = 4096
    batch_window_ms: float = 2.0
    max_batch: int = 64
    max_batch_nodes: int = 4096
    idle_timeout_s: float = 600.0

    def validate(self) -> "Limits":
        for name in ("max_sequences", "max_tree_nodes", "max_sequence_length", "max_batch", "max_batch_nodes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_batch_nodes < self.max_tree_nodes:
            raise ValueError(
                f"max_batch_nodes ({self.max_batch_nodes}) must hold at least one full tree ({self.max_tree_nodes})"
            )
        # written as "not in range" so that NaN, which fails every comparison, is refused too
        if not 0 <= self.batch_window_ms <= MAX_BATCH_WINDOW_MS:
            raise ValueError(f"batch_window_ms must be in [0, {MAX_BATCH_WINDOW_MS:g}], got {self.batch_window_ms}")
        if not self.idle_timeout_s >= 0:
            raise ValueError(f"idle_timeout_s must be >= 0, got {self.idle_timeout_s}")
        return self
