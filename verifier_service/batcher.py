"""Continuous batching: one thread at a time runs the engine; RPC threads hand it work.

Whoever finds the model free runs it: an RPC thread whose request arrives while no thread is
running the model runs its own forward, or operation, on the spot (after anything queued ahead of
it), with no hand-off to another thread and none back; that is the usual case for a lone client or
an orchestrator that sends its whole batch in one call. Work that arrives while the model is busy
is queued, and the thread holding the model takes it while it gathers a batch, or the model thread
takes it afterwards. Entries are taken in arrival order, by one thread at a time.

Verify items from many RPCs are packed into one forward. Items queued while the model was busy
join the next forward at once. Beyond those, the first item of a batch waits at most
`batch_window_ms` (from its arrival, or from when the model came free if it had to wait for that)
for company, and only while company is expected: from
sequences of the previous forward that came in other requests and are not back yet (see
`_complete`). So a lone client, or an orchestrator that sends its whole batch in one call (even
one that just dropped a finished sequence), never waits, while independent clients stepping in
lockstep share forwards. Prefill, Commit and Release run between forwards; one that arrives
during a window runs right after that window's forward.

Items whose caller has gone away (deadline passed, cancelled) are dropped before they reach the
model. A batch never holds one sequence twice, and never more than `max_batch` trees or
`max_batch_nodes` nodes: whatever does not fit waits for the next forward.

Each reply carries where its request's time went on the model side (`Timing`), so the servicer can
report the split of a call (metrics) without timing anything itself.
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


@dataclass(frozen=True)
class Timing:
    """Milliseconds of one request on the model side, from its hand-off to its reply.
    queue: hand-off until its first forward began (waiting behind other work, the batching
    window). forward: the forwards it rode in (commits + forward + per-node results, the engine's
    `forward_ms`). engine: the rest of those batches (per-item checks, bookkeeping, handing
    results out). `inline`: whether the calling thread ran the model itself."""

    queue: float = 0.0
    forward: float = 0.0
    engine: float = 0.0
    inline: bool = False


@dataclass
class VerifyReply:
    outputs: list[ItemOutput]
    forward_ms: float  # summed over the forwards this request's items rode in (usually one)
    batch_sequences: int  # the largest of those forwards
    timing: Timing = Timing()
    done_at: float = 0.0  # time.perf_counter() when the reply was complete


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
    arrived: float  # batcher clock: the batching window counts from here
    number: int = 0  # which request, in arrival order
    future: Future = field(default_factory=Future)
    outputs: list[ItemOutput | None] = field(default_factory=list)
    forwards: dict[int, tuple[float, int]] = field(default_factory=dict)  # batch id -> (ms, sequences)
    handed: float = field(default_factory=time.perf_counter)
    started: float | None = None  # perf_counter when its first batch began
    inline: bool = False

    def __post_init__(self):
        self.outputs = [None] * len(self.works)
        self._left = len(self.works)
        if not self.works:
            self.future.set_result(VerifyReply([], 0.0, 0, done_at=self.handed))

    def deliver(self, index: int, output: ItemOutput, batch_id: int | None = None, ms: float = 0.0, seqs: int = 0):
        self.outputs[index] = output
        if batch_id is not None and seqs:
            self.forwards[batch_id] = (ms, seqs)
        self._left -= 1
        if self._left == 0:
            done = time.perf_counter()
            fwd = sum(f[0] for f in self.forwards.values())
            widest = max((f[1] for f in self.forwards.values()), default=0)
            started = self.started if self.started is not None else done
            timing = Timing(
                queue=(started - self.handed) * 1e3,
                forward=fwd,
                engine=max(0.0, (done - started) * 1e3 - fwd),
                inline=self.inline,
            )
            self.future.set_result(VerifyReply(self.outputs, fwd, widest, timing, done))  # type: ignore[arg-type]


@dataclass
class _Item:
    job: _VerifyJob
    index: int

    @property
    def work(self) -> VerifyWork:
        return self.job.works[self.index]


_STOP = object()

# Callers run the model themselves on a few threads at most, whatever the size of gRPC's thread pool
# (a thread per concurrent call): CUDA libraries keep per-thread state, e.g. a cuBLAS handle with a
# workspace of tens of MiB of device memory, made on a thread's first matmul. Other threads hand
# their work to the model thread.
INLINE_THREADS = 4


class Batcher:
    def __init__(self, engine: Engine, limits: Limits, device: torch.device | str = "cpu", clock=time.monotonic):
        self.engine = engine
        self.limits = limits
        self._device = torch.device(device)
        self._clock = clock
        self._queue: collections.deque = collections.deque()
        # one lock, two wake-ups: the idle model thread waits for queued work and a free model;
        # the thread holding the model waits (in a batching window) for more arrivals
        self._lock = threading.Lock()
        self._free = threading.Condition(self._lock)
        self._arrival = threading.Condition(self._lock)
        self._busy = False  # some thread is running the model
        self._runners: set[int] = set()  # RPC threads that have run the model (at most INLINE_THREADS)
        self._started = False
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="verifier-model", daemon=True)
        self._batch_ids = itertools.count()
        self._job_numbers = itertools.count()
        self._last_batch: dict[str, int] = {}  # sequence id -> request number, of the previous forward
        timeout = limits.idle_timeout_s
        self._sweep_every = min(1.0, timeout / 4) if timeout > 0 else None
        self._last_sweep = clock()

    # ---- submission (any thread) ----------------------------------------------------------
    def start(self) -> "Batcher":
        with self._lock:
            self._started = True
        self._thread.start()
        return self

    def submit(self, fn: Callable, *args, alive: Callable[[], bool] = _always) -> Future:
        """Run `fn(*args)` between forwards: at once on this thread when the model is free, else on
        whichever thread holds it. The future is done on return when this thread ran it."""
        op = _Op(fn, args, alive)
        self._push([op], op.future)
        return op.future

    def verify(self, works: list[VerifyWork], alive: Callable[[], bool] = _always) -> Future:
        """Future of a VerifyReply with one output per work, in order (done on return when this
        thread found the model free and ran the forward itself)."""
        job = _VerifyJob(list(works), alive, self._clock(), next(self._job_numbers))
        if job.works:
            self._push([_Item(job, i) for i in range(len(job.works))], job.future, job)
        return job.future

    def is_runner(self, ident: int) -> bool:
        """Whether the thread `ident` has run the model (and may again without growing the set)."""
        return ident in self._runners

    @property
    def queued(self) -> int:
        """Entries waiting for the model (Verify items count one each)."""
        with self._lock:
            return len(self._queue)

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
            self._queue.append(_STOP)
            self._free.notify()
            self._arrival.notify()
        if self._thread.ident is not None:
            self._thread.join(timeout)
        with self._lock:
            left = [e for e in self._queue if e is not _STOP]
            self._queue.clear()
        for entry in left:
            self._fail(entry, Unavailable("the verifier is shutting down"))

    def _push(self, entries: list, done: Future, job: _VerifyJob | None = None) -> None:
        with self._lock:
            if self._stopped:
                err = Unavailable("the verifier is shutting down")
                for e in entries:
                    self._fail(e, err)
                return
            self._queue.extend(entries)
            if self._busy:
                self._arrival.notify()  # the holder may be gathering a batch
                return
            me = threading.get_ident()
            if not self._started or (me not in self._runners and len(self._runners) >= INLINE_THREADS):
                self._free.notify()  # the model thread's (once started)
                return
            self._busy = True  # the model is free: this thread runs it
            self._runners.add(me)
        if job is not None:
            job.inline = True
        self._lead(done)

    # ---- running the model (the holder only) ------------------------------------------------
    def _set_device(self) -> None:
        if self._device.type == "cuda" and self._device.index is not None:
            torch.cuda.set_device(self._device)  # the current device is per thread

    def _lead(self, done: Future) -> None:
        """On a caller's thread, which holds the model: run queued entries in order until `done`
        is done (its entries are queued, so it is reached), then give the model back."""
        try:
            self._set_device()
            with torch.inference_mode():
                while not done.done():
                    entry = self._next_for_holder()
                    if entry is None:  # shutting down: the rest is the model thread's or stop()'s
                        break
                    self._run(entry)
        finally:
            with self._lock:
                self._busy = False
                if self._queue:
                    self._free.notify()

    def _next_for_holder(self):
        """Pop the next entry for the thread holding the model, waiting for one; None once the
        queue is empty after stop() or its head is the stop marker."""
        with self._lock:
            self._arrival.wait_for(lambda: self._queue or self._stopped)
            if not self._queue or self._queue[0] is _STOP:
                return None
            return self._queue.popleft()

    def _take(self, timeout: float) -> object | None:
        """For the holder gathering a batch: the next queued entry, waiting up to `timeout` s."""
        with self._lock:
            if not self._queue and timeout > 0:
                self._arrival.wait_for(lambda: bool(self._queue), timeout)
            return self._queue.popleft() if self._queue else None

    def _put_back(self, entries: list) -> None:
        with self._lock:
            self._queue.extendleft(reversed(entries))

    def _run(self, entry) -> None:
        if isinstance(entry, _Op):
            self._run_op(entry)
        elif isinstance(entry, _Item):
            self._run_batch(entry)

    # ---- the model thread -----------------------------------------------------------------
    def _loop(self) -> None:
        self._set_device()
        with torch.inference_mode():
            while True:
                with self._lock:
                    self._free.wait_for(lambda: self._queue and not self._busy, self._sweep_every)
                    if self._busy:
                        continue
                    entry = self._queue.popleft() if self._queue else None
                    if entry is _STOP:
                        return
                    self._busy = True
                try:
                    if entry is not None:
                        self._run(entry)
                    self._maybe_sweep()
                finally:
                    with self._lock:
                        self._busy = False

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
        # the window opens when this batch can start: for an item that arrived while the model was
        # busy, that is now (else clients that fell out of step, each arriving during the other's
        # forward, would never share one again)
        window_end = max(first.job.arrived, self._clock()) + self.limits.batch_window_ms / 1e3
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
            self._last_batch = {it.work.sequence_id: it.job.number for it in batch}
            self._forward(batch)

    def _complete(self, names: set[str]) -> bool:
        """Whether waiting for more items is pointless. Company is expected only from a sequence of
        the previous forward that is still live, not in this batch, and came in a request that
        none of this batch's sequences came in: a caller that sent it along with sequences it sends
        again now, but left it out, is done with it (an orchestrator whose request just finished
        and whose Release is still on its way). So a batch goes at once when every live sequence is
        in it, when every sequence of the previous forward is back, and always for a caller that
        sends all its sequences in one request."""
        table = self.engine.table
        if len(names) >= len(table):
            return True
        prev = self._last_batch
        here = {prev[sid] for sid in names if sid in prev}
        return not any(req not in here and sid not in names and sid in table for sid, req in prev.items())

    def _forward(self, batch: list[_Item]) -> None:
        batch_id = next(self._batch_ids)
        now = time.perf_counter()
        for it in batch:
            if it.job.started is None:
                it.job.started = now
        try:
            report = self.engine.verify([it.work for it in batch])
        except Exception as exc:  # noqa: BLE001 - a bug must not take the running thread down
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
