"""Continuous batching: one model thread owns the engine; RPC threads hand it work.

Verify items from many RPCs are packed into one forward. Items queued while the model was busy
join the next forward at once. Beyond those, the first item of a batch waits at most
`batch_window_ms` (from its arrival) for company, and only while company is expected: the wait
ends as soon as every sequence of the previous forward is back, or every live sequence is in the
batch. So a lone client, or an orchestrator that sends its whole batch in one RPC, never waits,
while independent clients stepping in lockstep share forwards. Prefill, Commit and Release run on
the same thread, in arrival order, between forwards; one that arrives during a window runs right
after that window's forward.

Items whose caller has gone away (deadline passed, cancelled) are dropped before they reach the
model. A batch never holds one sequence twice, and never more than `max_batch` trees or
`max_batch_nodes` nodes: whatever does not fit waits for the next forward.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import grpc
import torch

from treeserve.errors import ServeError, Unavailable
from verifier_service.engine import Engine, ItemOutput, VerifyWork
from verifier_service.limits import Limits

log = logging.getLogger("treeserve.verifier")


class Cancelled(ServeError):
    code = grpc.StatusCode.CANCELLED


@dataclass
class VerifyReply:
    outputs: list[ItemOutput]
    forward_ms: float  # summed over the forwards this request's items rode in (usually one)
    batch_sequences: int  # the largest of those forwards


def _always() -> bool:
    return True


@dataclass
class _Op:
    fn: Callable
    args: tuple
    alive: Callable[[], bool]
    future: Future = field(default_factory=Future)


@dataclass
class _VerifyJob:
    works: list[VerifyWork]
    alive: Callable[[], bool]
    arrived: float
    future: Future = field(default_factory=Future)
    outputs: list[ItemOutput | None] = field(default_factory=list)
    forwards: dict[int, tuple[float, int]] = field(default_factory=dict)  # batch id -> (ms, sequences)

    def __post_init__(self):
        self.outputs = [None] * len(self.works)
        self._left = len(self.works)
        if not self.works:
            self.future.set_result(VerifyReply([], 0.0, 0))

    def deliver(self, index: int, output: ItemOutput, batch_id: int | None = None, ms: float = 0.0, seqs: int = 0):
        self.outputs[index] = output
        if batch_id is not None and seqs:
            self.forwards[batch_id] = (ms, seqs)
        self._left -= 1
        if self._left == 0:
            ms_total = sum(f[0] for f in self.forwards.values())
            widest = max((f[1] for f in self.forwards.values()), default=0)
            self.future.set_result(VerifyReply(self.outputs, ms_total, widest))  # type: ignore[arg-type]


@dataclass
class _Item:
    job: _VerifyJob
    index: int

    @property
    def work(self) -> VerifyWork:
        return self.job.works[self.index]


_STOP = object()


class Batcher:
    def __init__(self, engine: Engine, limits: Limits, device: torch.device | str = "cpu", clock=time.monotonic):
        self.engine = engine
        self.limits = limits
        self._device = torch.device(device)
        self._clock = clock
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="verifier-model", daemon=True)
        self._stopped = False
        self._batch_ids = itertools.count()
        self._last_batch: set[str] = set()  # sequence ids of the previous forward
        timeout = limits.idle_timeout_s
        self._sweep_every = min(1.0, timeout / 4) if timeout > 0 else None
        self._last_sweep = clock()

    # ---- submission (any thread) ----------------------------------------------------------
    def start(self) -> "Batcher":
        self._thread.start()
        return self

    def submit(self, fn: Callable, *args, alive: Callable[[], bool] = _always) -> Future:
        """Run `fn(*args)` on the model thread, between forwards."""
        op = _Op(fn, args, alive)
        self._push([op])
        return op.future

    def verify(self, works: list[VerifyWork], alive: Callable[[], bool] = _always) -> Future:
        """Future of a VerifyReply with one output per work, in order."""
        job = _VerifyJob(list(works), alive, self._clock())
        self._push([_Item(job, i) for i in range(len(works))])
        return job.future

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopped = True
            self._queue.append(_STOP)
            self._cv.notify()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        with self._cv:
            left = [e for e in self._queue if e is not _STOP]
            self._queue.clear()
        for entry in left:
            self._fail(entry, Unavailable("the verifier is shutting down"))

    def _push(self, entries: list) -> None:
        with self._cv:
            if self._stopped:
                err = Unavailable("the verifier is shutting down")
                for e in entries:
                    self._fail(e, err)
                return
            self._queue.extend(entries)
            self._cv.notify()

    # ---- the model thread -----------------------------------------------------------------
    def _take(self, timeout: float | None):
        """Next queued entry, waiting up to `timeout` seconds (None: forever); None on timeout."""
        with self._cv:
            if not self._queue and (timeout is None or timeout > 0):
                self._cv.wait_for(lambda: bool(self._queue), timeout)
            return self._queue.popleft() if self._queue else None

    def _put_back(self, entries: list) -> None:
        with self._cv:
            self._queue.extendleft(reversed(entries))

    def _loop(self) -> None:
        if self._device.type == "cuda" and self._device.index is not None:
            torch.cuda.set_device(self._device)  # the current device is per thread
        with torch.inference_mode():
            while True:
                entry = self._take(self._sweep_every)
                if entry is _STOP:
                    return
                if isinstance(entry, _Op):
                    self._run_op(entry)
                elif isinstance(entry, _Item):
                    self._run_batch(entry)
                self._maybe_sweep()

    def _maybe_sweep(self) -> None:
        if self._sweep_every is None or self._clock() - self._last_sweep < self._sweep_every:
            return
        self._last_sweep = self._clock()
        try:
            self.engine.sweep()
        except Exception:  # noqa: BLE001 - the sweep must never stop the model thread
            log.exception("idle sweep failed")

    def _run_op(self, op: _Op) -> None:
        if not op.alive():
            op.future.set_exception(Cancelled("the caller went away before the operation ran"))
            return
        try:
            op.future.set_result(op.fn(*op.args))
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            op.future.set_exception(exc)

    def _run_batch(self, first: _Item) -> None:
        batch: list[_Item] = []
        names: set[str] = set()
        nodes = 0
        later: list = []  # entries taken meanwhile that wait for after this forward
        window_end = first.job.arrived + self.limits.batch_window_ms / 1e3
        entry = first
        while True:
            if isinstance(entry, _Item):
                w = entry.work
                if not entry.job.alive():
                    entry.job.deliver(entry.index, ItemOutput(error=Cancelled("the caller went away")))
                elif w.sequence_id in names or nodes + w.tree.size > self.limits.max_batch_nodes:
                    later.append(entry)
                else:
                    batch.append(entry)
                    names.add(w.sequence_id)
                    nodes += w.tree.size
            else:
                later.append(entry)
                if entry is _STOP:
                    break
            if len(batch) >= self.limits.max_batch:
                break
            entry = self._take(0.0)  # whatever is queued already joins
            if entry is None:
                if not batch or self._complete(names):
                    break
                entry = self._take(window_end - self._clock())
                if entry is None:
                    break
        if later:
            self._put_back(later)
        if batch:
            self._last_batch = names
            self._forward(batch)

    def _complete(self, names: set[str]) -> bool:
        """Whether waiting for more items is pointless: every live sequence is in the batch, or
        every sequence of the previous forward is back (the usual steady state, and always so for
        a caller that sends all its sequences in one request)."""
        table = self.engine.table
        if len(names) >= len(table):
            return True
        return all(sid in names or sid not in table for sid in self._last_batch)

    def _forward(self, batch: list[_Item]) -> None:
        batch_id = next(self._batch_ids)
        try:
            report = self.engine.verify([it.work for it in batch])
        except Exception as exc:  # noqa: BLE001 - a bug must not take the model thread down
            log.exception("verify batch failed")
            for it in batch:
                it.job.deliver(it.index, ItemOutput(error=exc))
            return
        for it, out in zip(batch, report.outputs):
            it.job.deliver(it.index, out, batch_id, report.forward_ms, report.sequences)

    @staticmethod
    def _fail(entry, exc: BaseException) -> None:
        if isinstance(entry, _Op):
            entry.future.set_exception(exc)
        elif isinstance(entry, _Item):
            entry.job.deliver(entry.index, ItemOutput(error=exc))
