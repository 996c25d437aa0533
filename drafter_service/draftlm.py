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
"""
from __future__ import annotations

import os
import pathlib
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from drafter_service.head import DraftHead
from drafter_service.vocab import TrimmedVocab
from models.graphs import CAPTURE_LOCK
from treeserve.errors import InvalidArgument, ResourceExhausted
from treeserve.tree import TokenTree

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
        if cuda_graphs:
            model.use_graphs()
        return model

    def use_graphs(self, capture: bool = True) -> None:
        """Run the draft model's verify and decode steps through bucketed static buffers: CUDA graph
        replays (`capture=True`, CUDA only) or the same programs run eagerly (`capture=False`,
        which is how CPU tests exercise this path).

        The drafter runs one tree at a time, so the runner's shared stash is sized for one tree of
        the largest node bucket, not for a batch of every slot; with capture, every single-tree
        bucket is captured now, so no capture ever runs while other threads use the device."""
        from models.graphs import NODE_BUCKETS

        with self._call():
            runner = self.lm.use_graphs(capture, max_rows=max(NODE_BUCKETS))
            if capture:
                self._warm_up(runner)
        self.forward_ms = 0.0  # start-up work is not drafting time

    def _warm_up(self, runner) -> None:
        slot = self.lm.pool.alloc()
        try:
            for n in runner.node_buckets:
                if n > self.lm.pool.max_len:
                    break
                self.lm.verify([slot], [TokenTree(tuple([0] * n), tuple(range(-1, n - 1)))], head=lambda h: None)
            self.lm.decode([slot], [0])
        finally:
            self.lm.pool.free(slot)

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
        # CAPTURE_LOCK first, as the draft-ahead worker takes it (outside this lock): a lazy graph
        # capture made here, or by a target model in this process, then never waits on a thread
        # that waits on us (models.graphs.CAPTURE_LOCK)
        with CAPTURE_LOCK, self._lock:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.forward_ms += (time.perf_counter() - t0) * 1e3


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
