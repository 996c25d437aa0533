"""Dynamic trees grown on the device: the best-first loop of `drafter_service.dynamic` over the
fixed candidate table of `kernels.tree_growth`, so that one level (the draft forward over the tree so
far, the children of its frontier, the new selection) is one CUDA graph replay and the host reads one
number per level (whether a frontier is left) instead of every candidate.

A level is three steps: the draft model's forward over the selected tree (padded to the graph's node
bucket), the children of the frontier rows from its logits (`ChildPicker.pick_tensors`), and
`kernels.ops.grow_level`, one launch that writes the children to their keys, selects the next B
and lays out the next forward's tree and frontier.

`dynamic.DynamicProposer`'s host loop is this loop's plain twin: it keys each node's draws by the
same table key, so both build the same tree for the same logits (`tests/drafter/test_growth.py`).
"""
from __future__ import annotations

from typing import Callable

import torch

from drafter_service.children import ChildPicker
from drafter_service.proposer import Draft
from kernels import ops
from kernels.tree_growth import GrowthTables, Shape
from treeserve.sampling import STREAM_DRAFT, Sampling, stream_key, transform_values
from treeserve.tree import SparseDist, TokenTree

# Largest candidate table grown on the device (about 50 bytes a candidate); larger trees (a deep
# limit on a large budget) take the host loop.
MAX_CANDIDATES = 1 << 17

# forward(tokens (N,) int64, positions (N,) int64, parents (N,) int32 local, rows (F,)) -> (F, columns) fp32 logits
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Growth:
    """One growth run's tables (`kernels.tree_growth.GrowthTables`) and its level step, for one
    `Shape` on one device.

    `start` fills a run's inputs (root, committed length, slot, stream key and the sampling
    settings' `transform_values`) and `reset` starts it from them; `level` runs one level and leaves
    the frontier's size in `frontier_count`; `read` brings the result to the host. `reset` and
    `level` launch only device work whose shapes depend on the `Shape` and on the picker's rule,
    support and truncations, so they can be captured once and replayed for every run, whatever its
    seed, temperature, top-k or top-p."""

    def __init__(self, shape: Shape, picker: ChildPicker, forward: Forward, device: torch.device):
        self.shape, self.picker, self.forward = shape, picker, forward
        self.tables = GrowthTables(shape, device)
        # sampling.transform_values; until a run's copy, a valid setting (temperature 1, top-1, top-p 1)
        # for the warm-up that a capture runs
        self.values = torch.ones(3, dtype=torch.float32, device=device)

    @property
    def inputs(self) -> torch.Tensor:
        """(4,) int64: root token, committed length, slot, stream key."""
        return self.tables.inputs

    def start(self, root: int, length: int, slot: int, settings: Sampling) -> None:
        """Fill a run's inputs: two host-to-device copies, queued without waiting."""
        key = stream_key(settings.seed, STREAM_DRAFT)
        self.inputs.copy_(torch.tensor([root, length, slot, key], dtype=torch.int64), non_blocking=True)
        self.values.copy_(transform_values(settings), non_blocking=True)

    @property
    def frontier_count(self) -> torch.Tensor:
        return self.tables.frontier_count

    def reset(self) -> None:
        self.tables.reset()

    def level(self) -> None:
        """One level: forward over the selected tree, children of the frontier, new selection."""
        t = self.tables
        logits = self.forward(t.tree_tokens, t.tree_positions, t.tree_parents, t.rows)
        picked = self.picker.pick_tensors(logits, self.shape.k, t.committed_length, t.fkey, t.inputs[3:4], self.values)
        ops.grow_level(t, picked.tokens, picked.probs, picked.draw_order)

    # ---- results --------------------------------------------------------------------------------
    def read(self, with_dists: bool) -> tuple[Draft, TokenTree]:
        """The grown tree (with the distributions its drawn nodes were drawn from, if asked) and the
        last level's forward tree, brought to the host in one transfer."""
        t, B, N = self.tables, self.shape.budget, self.shape.nodes
        keys = t.chosen  # the selected keys in order (rows past their count: stale keys)
        parts = [t.counts[0:1], t.counts[3:4], t.tree_tokens[:B], t.tree_parents[:B], t.logp[keys],
                 t.last_tokens, t.last_parents]
        if with_dists:
            e = t.expansion[keys]
            parts += [t.dist_tokens[e].flatten(), t.dist_probs[e].flatten()]
        flat = torch.cat([part.double() for part in parts]).cpu().numpy()
        n, fn = int(flat[0]), int(flat[1])
        at = 2
        tokens = flat[at:at + n].astype("int64").tolist()
        parents = flat[at + B:at + B + n].astype("int64").tolist()
        logp = tuple(flat[at + 2 * B:at + 2 * B + n].tolist())
        at += 3 * B
        forwarded = TokenTree(tuple(flat[at:at + fn].astype("int64").tolist()),
                              tuple(flat[at + N:at + N + fn].astype("int64").tolist()))
        # a node reports its distribution only when it has children in the final tree
        has_kids = set(parents[1:])
        if not with_dists or not has_kids:
            return Draft(TokenTree(tuple(tokens), tuple(parents)), logp), forwarded
        at += 2 * N
        m = t.dist_tokens.shape[1]
        dt = flat[at:at + B * m].reshape(B, m).astype("int64")
        dp = flat[at + B * m:at + 2 * B * m].reshape(B, m)
        dists = tuple(SparseDist(tuple(dt[i][dp[i] > 0].tolist()), tuple(dp[i][dp[i] > 0].tolist()), 0.0)
                      if i in has_kids else None for i in range(n))
        return Draft(TokenTree(tuple(tokens), tuple(parents), dists), logp), forwarded

