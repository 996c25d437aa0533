"""The draft model as the drafter uses it: one `models.HybridLM` with state slots, driven one
sequence at a time.

Every call here works on a single slot with a single tree. That is deliberate: a batch of one has
the same numerics whichever other work is in flight, so a tree prepared ahead of time on a forked
slot is bit-identical to the one fresh drafting produces on the sequence's own slot.

Calls into the runtime are serialised by one lock (the runtime's slot pool and pending
verifications are not meant for concurrent callers).

On CUDA the steps replay CUDA graphs by default (`use_graphs`): a draft level of a small drafter is
otherwise all kernel-launch overhead. The graphs' shared commit stash is only copied when a live
verification of another slot (draft-ahead) still needs it, and then only that tree's rows.

Dynamic trees grow on the device (`grow`, `drafter_service.growth`): a level of the best-first loop,
forward and selection together, is one graph replay, and the host reads one number per level.
"""
from __future__ import annotations

import logging
import os
import pathlib
import threading
import time
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from drafter_service import growth as growth_mod
from drafter_service.children import ChildPicker
from drafter_service.head import DraftHead
from drafter_service.proposer import Draft, reachable_depth
from drafter_service.vocab import TrimmedVocab
from kernels.tree_growth import Shape as GrowthShape
from models.graphs import CAPTURE_LOCK
from treeserve.errors import InvalidArgument, ResourceExhausted
from treeserve.tree import TokenTree

log = logging.getLogger("treeserve.drafter.model")

# Most growth tables a draft model keeps, one per (budget, depth, pick rule, support, transform truncations).
# With CUDA graphs the first MAX_GROWTHS shapes get graphs for the model's life and later shapes take
# the host loop, so requests cannot make the drafter capture again and again; eagerly, the least
# recently used table is dropped. A drafter captures a dozen at start-up (`prepare_growths`).
MAX_GROWTHS = 24

@dataclass
class Verified:
    """The last verification on a slot: its tree and the runtime's handle to commit a path of it."""

    tree: TokenTree
    pending: Any


class Gate:
    """Foreground work (answering requests) goes first; background work (draft-ahead) waits at each
    step while any foreground work is in progress."""

    def __init__(self):
        self._cv = threading.Condition()
        self._foreground = 0

    @contextmanager
    def foreground(self):
        with self._cv:
            self._foreground += 1
        try:
            yield
        finally:
            with self._cv:
                self._foreground -= 1
                self._cv.notify_all()

    def wait_for_idle(self, timeout: float | None = None) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._foreground == 0, timeout)


class DraftModel:
    """A draft checkpoint loaded through the model runtime, with the head over the tokens it may
    draft (`head.DraftHead`: the whole vocabulary, the ids below a limit, or a trimmed set)."""

    def __init__(self, lm, name: str = "draft", vocab_limit: int | None = None, fork_slots: int | None = None,
                 trim: TrimmedVocab | None = None, trim_source: str = "trimmed vocabulary"):
        """fork_slots: most slots that forks (draft-ahead) may hold at once, so that forks never
        take the slots that sequences are entitled to (None: no limit). vocab_limit: only ids
        below it are drafted or accepted. trim: draft only these ids (see `drafter_service.vocab`)."""
        self.lm = lm
        self.fork_slots = fork_slots
        self._forks: set[int] = set()
        self.name = name
        self.head = DraftHead(lm, trim, vocab_limit, trim_source)
        self.vocab_size = self.head.vocab_size
        self.max_len: int | None = getattr(lm.pool, "max_len", None)
        self._lock = threading.RLock()
        self.gate = Gate()
        self.forward_ms = 0.0  # total time spent in runtime calls (metrics)
        self._growths: OrderedDict = OrderedDict()
        self._refused: set = set()  # growth keys refused for lack of room (logged once each)
        self._stash = None  # without a graph runner: the stash of the latest grown tree

    @classmethod
    def load(cls, path: str, device: str = "cpu", dtype: torch.dtype | None = None, max_slots: int = 64,
             max_len: int = 8192, vocab_limit: int | None = None, cuda_graphs: bool | None = None,
             fork_slots: int | None = None, trim: str | os.PathLike | None = None) -> "DraftModel":
        """cuda_graphs: None = on when the device is CUDA and the model allows it (no MoE blocks);
        the graphs are sized for the drafter (one tree at a time) and captured here, before any
        request. trim: a trimmed-vocabulary file (or a directory holding `vocab_subset.json`)."""
        from models import HybridLM

        if dtype is None:
            dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        kept = TrimmedVocab.load(trim) if trim is not None else None
        lm = HybridLM.from_pretrained(path, device=device, dtype=dtype, max_slots=max_slots, max_len=max_len,
                                      cuda_graphs=False)
        model = cls(lm, name=pathlib.Path(path).resolve().name, vocab_limit=vocab_limit, fork_slots=fork_slots,
                    trim=kept, trim_source=str(trim))
        if cuda_graphs is None:
            cuda_graphs = lm.graphs_supported
        lm.warm_up()  # no sequence's start, catch-up or commit compiles a kernel at a request (CUDA only)
        if cuda_graphs:
            model.use_graphs()
        return model

    def use_graphs(self, capture: bool = True) -> None:
        """Run the draft model's verify and decode steps through bucketed static buffers: CUDA graph
        replays (`capture=True`, CUDA only) or the same programs run eagerly (`capture=False`,
        which is how CPU tests exercise this path).

        The drafter runs one tree at a time, so the runner's shared stash is sized for one tree of
        the largest node bucket, not for a batch of every slot; with capture, every single-tree
        verify bucket, the one-slot decode, the one-path commits of up to
        `models.graphs.PREPARED_PATH` steps and the prompt pieces (`GraphRunner.capture_prefill`) are
        captured now. The graphs of a dynamic tree's growth (`grow`) are captured at the first tree
        of each budget, depth and pick rule (with its support and its transform's truncations:
        whether top-k and top-p apply, not their values; at most `MAX_GROWTHS` shapes), under
        `models.graphs.CAPTURE_LOCK`, which every device step of this model and of its callers'
        pickers holds (`exclusive`), so no drafter work runs beside a capture."""
        from models.buckets import NODE_BUCKETS

        with self._call():
            self._growths.clear()  # their steps write the stash of the runner they were built for
            runner = self.lm.use_graphs(capture, max_rows=max(NODE_BUCKETS))
            if capture:
                self._capture_buckets(runner)
        self.forward_ms = 0.0  # start-up work is not drafting time

    def _capture_buckets(self, runner) -> None:
        """Capture what one tree at a time replays: each verify bucket (by running it once), the
        decode of one slot, the commits of one path, and the pieces its prompts run as."""
        slot = self.lm.pool.alloc()
        try:
            for n in runner.node_buckets:
                if n > self.lm.pool.max_len:
                    break
                self.lm.verify([slot], [TokenTree.chain([0] * n)], head=lambda h: None)
            self.lm.decode([slot], [0])
        finally:
            self.lm.pool.free(slot)
        runner.capture_commits([1])  # a drafter commits one sequence's path at a time
        runner.capture_prefill()  # its starts and catch-ups (`HybridLM.prefill`)

    @property
    def device(self) -> torch.device:
        return torch.device(getattr(self.lm, "device", "cpu"))

    # ---- slots ------------------------------------------------------------------------------
    def open(self, tokens: Sequence[int]) -> int:
        """A new slot that has consumed `tokens`."""
        from models.errors import SequenceTooLong, SlotsExhausted

        with self._call():
            try:
                slot = self.lm.pool.alloc()
            except SlotsExhausted as exc:
                raise ResourceExhausted(f"draft model has no free state slot: {exc}") from exc
            try:
                if tokens:
                    self.lm.prefill([slot], [list(tokens)])
            except SequenceTooLong as exc:
                self.lm.pool.free(slot)
                raise InvalidArgument(f"sequence too long for the draft model: {exc}") from exc
            except BaseException:
                self.lm.pool.free(slot)
                raise
            return slot

    def fork(self, slot: int) -> int | None:
        """A copy of `slot` in a fresh slot, or None when no slot may be taken (draft-ahead then
        skips that outcome)."""
        from models.errors import SlotsExhausted

        with self._call():
            if self.fork_slots is not None and len(self._forks) >= self.fork_slots:
                return None
            try:
                dst = self.lm.pool.alloc()
            except SlotsExhausted:
                return None
            self.lm.fork(slot, dst)
            self._forks.add(dst)
            return dst

    def adopt(self, slot: int) -> None:
        """A forked slot becomes a sequence's own (its old slot is freed in exchange)."""
        with self._call():
            self._forks.discard(slot)

    def free(self, slot: int) -> None:
        with self._call():
            self._forks.discard(slot)
            self.lm.pool.free(slot)

    # ---- forward passes ----------------------------------------------------------------------
    def can_grow(self, budget: int, depth: int, picker: ChildPicker) -> bool:
        """Whether `grow` takes this tree: budget >= 2 and depth >= 1, a node bucket holds it, its
        candidate table stays small (`growth.MAX_CANDIDATES`), and, where growth is captured as
        CUDA graphs, its shape has graphs already or there is room for them (`MAX_GROWTHS`)."""
        if budget < 2 or depth < 1 or self._node_bucket(budget) is None:
            return False
        depth = reachable_depth(budget, depth)
        if GrowthShape(budget, depth, budget).capacity > growth_mod.MAX_CANDIDATES:
            return False
        key = _growth_key(budget, depth, picker)
        if not self.captures_growths or key in self._growths or len(self._growths) < MAX_GROWTHS:
            return True
        if key not in self._refused:
            self._refused.add(key)
            log.warning("draft tree %s not grown on the device: %d growths are captured already; it takes the "
                        "host loop", key, MAX_GROWTHS)
        return False

    @property
    def captures_growths(self) -> bool:
        """Whether growths are captured as CUDA graphs (else they run eagerly)."""
        runner = self.lm.graphs
        return runner is not None and runner.capture

    def prepare_growths(self, shapes: Sequence[tuple[int, int]], pickers: Sequence[ChildPicker]) -> int:
        """Build the growth of every (budget, depth) in `shapes` for every picker now (capturing its
        graphs where growths are captured), so that the first trees of those shapes do not wait for
        a capture: about a second each on an H100, holding every drafting thread (BENCHMARKS.md,
        twenty-eighth round). Shapes `can_grow` refuses are skipped. Returns how many were built (eagerly,
        less any that the least-recently-used rule dropped meanwhile)."""
        held = len(self._growths)
        pickers = [picker.bind(self.head) for picker in pickers]
        for budget, depth in shapes:
            for picker in pickers:
                # one capture at a time under the locks (not `_call`: start-up work is not drafting time)
                with self.exclusive():
                    if self.can_grow(budget, depth, picker):
                        self._growth(budget, reachable_depth(budget, depth), picker)  # built unless held already
        return len(self._growths) - held

    def grow(self, slot: int, root: int, budget: int, depth: int, picker: ChildPicker,
             still_wanted: Callable[[], None]) -> tuple[Draft, Verified]:
        """A dynamic tree grown on the device (`drafter_service.growth`) after the slot's committed
        tokens: the draft, and the last level's verification (there is always one). Only for trees
        `can_grow` takes. `still_wanted()` runs before each level and may raise to stop the run."""
        from models.verify import Pending, VerifyStash

        depth = reachable_depth(budget, depth)
        with self._call():
            length = self.lm.pool.length(slot)
            self.lm.pool.check_room(slot, budget, "draft tree")
            runner = self.lm.graphs
            growth, step = self._growth(budget, depth, picker)
            if runner is not None:
                runner.release_stash()
            else:
                self._stash = VerifyStash(self.lm.pool, growth.shape.nodes, self.lm.dtype)
            growth.start(root, length, slot, picker.sampling)
            step.reset()
            for _ in range(depth):
                still_wanted()
                step.level()
                if int(growth.frontier_count.item()) == 0:
                    break
            draft, forwarded = growth.read(picker.reports_dists)
            stash = runner.hand_out_stash() if runner is not None else self._stash
            pending = Pending(slot, self.lm.pool.version(slot), length, forwarded.parents, stash, 0)
            stash.attach([pending])
            return draft, Verified(forwarded, pending)

    def _node_bucket(self, budget: int) -> int | None:
        from models.buckets import tree_buckets

        fits = [n for n in tree_buckets(self.lm.pool) if budget <= n]
        return min(fits) if fits else None

    def _growth(self, budget: int, depth: int, picker: ChildPicker):
        """The growth table and its two steps for this shape and picker. Captured ones are kept for
        the model's life (`can_grow` bounds how many), so no shape is captured twice; eager ones
        (no capturing runner) are dropped least recently used first."""
        key = _growth_key(budget, depth, picker)
        hit = self._growths.pop(key, None)
        if hit is None:
            hit = self._build_growth(budget, depth, picker)
        self._growths[key] = hit  # most recent last
        if not self.captures_growths:
            while len(self._growths) > MAX_GROWTHS:
                self._growths.pop(next(iter(self._growths)))
        return hit

    @contextmanager
    def exclusive(self):
        """Device work of this model or its callers (a picker's ops on its logits) that must not
        run beside a capture (`models.graphs.CAPTURE_LOCK`) or another caller's steps. CAPTURE_LOCK
        first, as the draft-ahead worker takes it (outside this lock): a lazy graph capture made
        here, or by a target model in this process, then never waits on a thread that waits on us
        (models.graphs.CAPTURE_LOCK)."""
        with CAPTURE_LOCK, self._lock:
            yield

    def _build_growth(self, budget: int, depth: int, picker: ChildPicker):
        from models.batch import Packed

        lm, head = self.lm, self.head
        nodes = self._node_bucket(budget)
        support = min(picker.support, head.size) if picker.reports_dists else 0
        shape = GrowthShape(budget, depth, nodes, support)
        cu = torch.tensor([0, nodes], dtype=torch.int32, device=self.device)
        runner = lm.graphs

        def forward(tokens, positions, parents, rows):
            given = g.tables.inputs32  # root, committed length, slot
            batch = Packed(tokens=tokens, parents=parents, cu_seqlens=cu, slot_idx=given[2:3],
                           cache_lens=given[1:2], positions=positions, max_nodes=nodes,
                           sizes=[nodes], slots=[], lens=[])
            stash = runner.stash if runner is not None else self._stash
            return head.logits_at(lm.hidden("verify", batch, stash), rows)

        g = growth_mod.Growth(shape, picker, forward, self.device)
        if runner is None:
            return g, _EagerSteps(g)
        # the warm-up runs (reset, then one level) touch the scratch slot only
        g.inputs.copy_(torch.tensor([0, 0, lm.pool.scratch_slot, 0], dtype=torch.int64))
        reset = runner.capture_program(g.reset, f"draft tree reset {shape}")
        level = runner.capture_program(g.level, f"draft tree level {shape}") if reset is not None else None
        if level is None:
            return g, _EagerSteps(g)
        return g, _GraphSteps(reset, level)

    def verify(self, slot: int, tree: TokenTree, rows: Sequence[int] | None = None) -> tuple[torch.Tensor | None, Verified]:
        """One forward over `tree` placed after the slot's committed tokens (committed state
        untouched): fp32 logits (len(rows), K) over the head's columns at nodes `rows` (None: every
        node; empty: none are computed, None is returned, the forward only prepares commits)."""
        with self._call():
            res = self.lm.verify([slot], [tree], head=lambda hidden: self.head.logits(hidden, rows))
            return res.output, Verified(tree, res.pending[0])

    def advance(self, slot: int, verified: Verified | None, tokens: Sequence[int]) -> None:
        """Consume `tokens`: the longest prefix that is a root path of the last verified tree is
        committed from that verification (no forward pass); the rest is decoded (one token) or
        prefilled (several)."""
        from models.errors import SequenceTooLong

        tokens = [int(t) for t in tokens]
        done = 0
        with self._call():
            try:
                if verified is not None and tokens:
                    path = matching_path(verified.tree, tokens)
                    if path:
                        self.lm.commit([(verified.pending, path)])
                        done = len(path)
                rest = tokens[done:]
                if len(rest) == 1:
                    self.lm.decode([slot], rest)
                elif rest:
                    self.lm.prefill([slot], [rest])
            except SequenceTooLong as exc:
                raise ResourceExhausted(f"sequence longer than the draft model keeps state for: {exc}") from exc

    @contextmanager
    def _call(self):
        with self.exclusive():
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.forward_ms += (time.perf_counter() - t0) * 1e3


def _growth_key(budget: int, depth: int, picker: ChildPicker) -> tuple:
    """What a growth's graphs depend on: its shape and its picker's rule, support and transform
    truncations (not the seed or the transform's values, which each run passes in device tensors)."""
    return (budget, depth, picker.rule, picker.support, picker.truncations)


class _EagerSteps:
    def __init__(self, growth):
        self.reset, self.level = growth.reset, growth.level


class _GraphSteps:
    def __init__(self, reset, level):
        self.reset, self.level = reset.replay, level.replay


def matching_path(tree: TokenTree, tokens: Sequence[int]) -> list[int]:
    """Local node indices of the longest root path of `tree` whose tokens are a prefix of `tokens`."""
    if not tokens or tree.tokens[0] != tokens[0]:
        return []
    path = [0]
    for tok in tokens[1:]:
        nxt = tree.child_with_token(path[-1], int(tok))
        if nxt is None:
            break
        path.append(nxt)
    return path
