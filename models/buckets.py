"""The bucketed shapes that CUDA graphs are captured at, and that eager steps round up to so that
they run programs a capture or the warm-up has compiled."""
from __future__ import annotations

# Tree sizes (nodes a tree is padded to) of the verify graphs; also the path-length buckets of
# commits (an accepted path is at most a tree's depth plus one).
NODE_BUCKETS = (1, 4, 8, 16, 32, 64, 128)


def bucket(n: int, buckets) -> int | None:
    """The smallest of the ascending `buckets` that holds n, or None when n is past them all."""
    for b in buckets:
        if n <= b:
            return b
    return None


def batch_buckets(max_slots: int) -> list[int]:
    """Sequence-count buckets of a pool with `max_slots` slots: 1, 2, 4, ... and max_slots itself."""
    out, b = [], 1
    while b < max_slots:
        out.append(b)
        b *= 2
    out.append(max_slots)
    return out


def tree_buckets(pool, node_buckets=NODE_BUCKETS) -> tuple[int, ...]:
    """The node buckets whose padded trees fit after a full sequence (the pool's tree headroom)."""
    return tuple(n for n in node_buckets if n <= pool.capacity - pool.max_len)
