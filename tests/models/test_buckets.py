"""The bucketed shapes graphs are captured at, and the eager commit's path axis that follows them."""
from __future__ import annotations

from types import SimpleNamespace

from models.buckets import NODE_BUCKETS, batch_buckets, bucket, tree_buckets
from models.verify import eager_steps


def test_bucket_is_the_smallest_that_holds():
    assert [bucket(n, NODE_BUCKETS) for n in (1, 2, 4, 5, 16, 17, 128)] == [1, 4, 4, 8, 16, 32, 128]
    assert bucket(129, NODE_BUCKETS) is None


def test_batch_buckets_end_at_the_pool_size():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]


def test_tree_buckets_fit_the_pools_headroom():
    pool = SimpleNamespace(max_len=100, capacity=100 + 20)
    assert tree_buckets(pool) == (1, 4, 8, 16)


def test_eager_commits_round_their_paths_to_the_buckets():
    assert [eager_steps(n) for n in (1, 3, 9, 128, 129, 300)] == [1, 4, 16, 128, 256, 512]
