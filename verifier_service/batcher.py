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
`max_batch_nodes` nodes: whatever does not fit waits for the next forward. An unexpected exception
while running one entry (a bug) is answered to that entry's callers as INTERNAL and logged; the
thread running the model carries on with the next one.

Each reply carries where its request's time went on the model side (`Timing`), so the servicer can
report the split of a call (metrics) without timing anything itself.

The usual case, one caller whose request finds the model free and nothing queued, takes a short cut
(`run`, `_run_alone`): the same forward the queue would give it, run at once, without passing its
items through the queue or making a Future, and with the forward's metrics left for after the reply.
It is on the path of every step a lone client makes, where every operation counts: the step's host
work runs on caches the forward has just evicted, at several times its warm cost.
"""
from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import grpc
import torch

from treeserve.errors import ServeError, Unavailable
from verifier_service.engine import BatchReport, Engine, ItemOutput, VerifyWork
from verifier_service.limits import Limits

log = logging.getLogger("treeserve.verifier")


class Cancelled(ServeError):
    code = grpc.StatusCode.CANCELLED


class Timing(NamedTuple):  # a tuple: made for every request, cheaper than a frozen dataclass
    """Milliseconds of one request on the model side, from its hand-off to its reply.
    queue: hand-off until its first forward began (waiting behind other work, the batching
    window). forward: the forwards it rode in (commits + forward + per-node results, the engine's
    `forward_ms`). engine: the rest of those batches (per-item checks, bookkeeping, handing
    results out). `inline`: whether the calling thread ran the model itself."""

    queue: float = 0.0
    forward: float = 0.0
    engine: float = 0.0
    inline: bool = False


def _nothing() -> None:
    pass


@dataclass
class VerifyReply:
    outputs: list[ItemOutput]
    forward_ms: float  # summed over the forwards this request's items rode in (usually one)
    batch_sequences: int  # the largest of those forwards
    timing: Timing = Timing()
    done_at: float = 0.0  # time.perf_counter() when the reply was complete
    # bookkeeping left to the caller, to run once its answer is on its way (see `Batcher.run`)
    after: Callable[[], None] = _nothing


def _always() -> bool:
    return True


@dataclass
class _Op:
    fn: Callable
    args: tuple
    alive: Callable[[], bool]
    future: Future = field(default_factory=Future)


class _VerifyJob:
    """One request's Verify items on their way through the batcher. `reply` is set once every item
    has its output, and handed to `future` when there is one (a job run at once by its caller's
    thread needs none)."""

    __slots__ = ("works", "alive", "arrived", "number", "future", "reply", "outputs", "forwards", "handed",
                 "started", "inline", "_left")

    def __init__(self, works: list[VerifyWork], alive: Callable[[], bool], arrived: float, number: int = 0,
                 future: Future | None = None):
        self.works = works
        self.alive = alive
        self.arrived = arrived  # batcher clock: the batching window counts from here
        self.number = number  # which request, in arrival order
        self.future = future
        self.reply: VerifyReply | None = None
        self.outputs: list[ItemOutput | None] = [None] * len(works)
        self.forwards: dict[int, tuple[float, int]] = {}  # batch id -> (ms, sequences)
        self.handed = time.perf_counter()
        self.started: float | None = None  # perf_counter when its first batch began
        self.inline = False
        self._left = len(works)
        if not works:
            self._complete(VerifyReply([], 0.0, 0, done_at=self.handed))

    def _complete(self, reply: VerifyReply) -> None:
        self.reply = reply
        if self.future is not None:
            self.future.set_result(reply)

    def deliver(self, index: int, output: ItemOutput, batch_id: int | None = None, ms: float = 0.0, seqs: int = 0):
        self.outputs[index] = output
        if batch_id is not None and seqs:
            self.forwards[batch_id] = (ms, seqs)
        self._left -= 1
        if self._left == 0:
            done = time.perf_counter()
            fwd, widest = 0.0, 0
            for ms, seqs in self.forwards.values():
                fwd += ms
                widest = max(widest, seqs)
            started = self.started if self.started is not None else done
            timing = Timing(
                queue=(started - self.handed) * 1e3,
                forward=fwd,
                engine=max(0.0, (done - started) * 1e3 - fwd),
                inline=self.inline,
            )
            self._complete(VerifyReply(self.outputs, fwd, widest, timing, done))  # type: ignore[arg-type]


@dataclass
class _Item:
    job: _VerifyJob
    index: int

    @property
    def work(self) -> VerifyWork:
        return self.job.works[self.index]


_STOP = object()

_ALREADY = contextlib.nullcontext()


def _model_mode():
    """Inference mode around model work, unless this thread has it on already: the verifier's RPC
    threads keep it on for good (`VerifierServer`), as entering and leaving it costs tens of
    microseconds per step on a cold cache."""
    return _ALREADY if torch.is_inference_mode_enabled() else torch.inference_mode()

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
        self._hurried = False  # a shutdown began: no forward waits for company any more
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
        got = self.run(works, alive)
        if isinstance(got, Future):
            return got
        got.after()  # nobody else will
        future: Future = Future()
        future.set_result(got)
        return future

    def run(self, works: list[VerifyWork], alive: Callable[[], bool] = _always) -> VerifyReply | Future:
        """`verify` for a caller about to wait for the answer: the VerifyReply itself when this
        thread found the model free and ran the forward at once (`_run_alone`, no Future made),
        else the Future of the queued work. Such a reply's `after()` records the forward's metrics:
        the caller runs it once its answer is on its way."""
        job = _VerifyJob(list(works), alive, self._clock(), next(self._job_numbers))
        if not job.works or self._run_alone(job):
            return job.reply  # type: ignore[return-value]
        job.future = Future()
        self._push([_Item(job, i) for i in range(len(job.works))], job.future, job)
        return job.future

    def _run_alone(self, job: _VerifyJob) -> bool:
        """Run `job` as one forward on this thread at once, if that is exactly what the queue would
        do: the model is free, nothing is queued ahead, this thread may run the model (`_push`'s
        rule), and the job is one batch (within the limits, no sequence twice) that would not wait
        for company (`_complete`). Returns whether it ran; if not, the caller takes the queue."""
        works = job.works
        limits = self.limits
        if len(works) > limits.max_batch:
            return False
        names = {w.sequence_id for w in works}
        if len(names) != len(works) or sum(w.tree.size for w in works) > limits.max_batch_nodes:
            return False
        me = threading.get_ident()
        with self._lock:
            if (self._busy or self._queue or not self._started or self._stopped or not self._may_run(me)
                    or not self._complete(names, {job.number})):  # reads the table: no thread holds the model
                return False
            self._busy = True
            self._runners.add(me)
        job.inline = True
        try:
            self._set_device()
            with _model_mode():
                if job.alive():
                    self._last_batch = {w.sequence_id: job.number for w in works}
                    report = self._forward([_Item(job, i) for i in range(len(works))], record=False)
                    if report is not None:  # the job is complete: its one batch ran
                        job.reply.after = functools.partial(self.engine.record, report)
                else:
                    for i in range(len(works)):
                        job.deliver(i, ItemOutput(error=Cancelled("the caller went away")))
        finally:
            with self._lock:
                self._busy = False
                if self._queue:
                    self._free.notify()  # what arrived meanwhile: the model thread's
        return True

    def _may_run(self, me: int) -> bool:
        """Whether thread `me` may run the model itself (the lock held): it has before, or one of
        the INLINE_THREADS places is free. A runner that has ended gives its place up: a direct-port
        connection's thread lives only as long as its connection, and engines reconnect."""
        if me in self._runners:
            return True
        if len(self._runners) >= INLINE_THREADS:
            self._runners &= {t.ident for t in threading.enumerate()}
        return len(self._runners) < INLINE_THREADS

    def is_runner(self, ident: int) -> bool:
        """Whether the thread `ident` has run the model (and may again without growing the set)."""
        return ident in self._runners

    @property
    def queued(self) -> int:
        """Entries waiting for the model (Verify items count one each)."""
        with self._lock:
            return len(self._queue)

    def hurry(self) -> None:
        """From now on no forward waits in its batching window (a shutdown began: the calls in
        flight have only their grace), and one waiting now goes at once."""
        with self._lock:
            self._hurried = True
            self._arrival.notify_all()

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
            if not self._started or not self._may_run(me):
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
            with _model_mode():
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
        """For the holder gathering a batch: the next queued entry, waiting up to `timeout` s
        (capped at what a lock wait accepts: beyond it, Condition.wait raises OverflowError)."""
        with self._lock:
            if not self._queue and timeout > 0 and not self._hurried:
                self._arrival.wait_for(lambda: bool(self._queue) or self._hurried, min(timeout, threading.TIMEOUT_MAX))
            return self._queue.popleft() if self._queue else None

    def _put_back(self, entries: list) -> None:
        with self._lock:
            self._queue.extendleft(reversed(entries))

    def _run(self, entry) -> None:
        """Run one queued entry: an operation, or a forward led by this Verify item. An exception
        that escapes (a bug: the engine's own failures are answered to their callers already) is
        logged and answered to the entry's caller, as INTERNAL, and the thread carries on: the
        model thread must outlive any one request, or every later one would wait for ever."""
        try:
            if isinstance(entry, _Op):
                self._run_op(entry)
            elif isinstance(entry, _Item):
                self._run_batch(entry)
        except Exception as exc:  # noqa: BLE001 - see above
            log.exception("verifier: queued work failed; its caller gets INTERNAL")
            self._fail_unanswered(entry, exc)

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
        try:
            if not op.alive():
                op.future.set_exception(Cancelled("the caller went away before the operation ran"))
                return
            op.future.set_result(op.fn(*op.args))
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            op.future.set_exception(exc)

    def _run_batch(self, first: _Item) -> None:
        batch: list[_Item] = []
        later: list = []  # entries taken meanwhile that wait for after this forward
        try:
            self._gather(first, batch, later)
        except Exception as exc:
            # taken off the queue for this forward, which will not run: answered, not lost
            for it in batch:
                self._fail_unanswered(it, exc)
            raise
        finally:
            if later:
                self._put_back(later)
        if batch:
            self._last_batch = {it.work.sequence_id: it.job.number for it in batch}
            self._forward(batch)

    def _gather(self, first: _Item, batch: list[_Item], later: list) -> None:
        """Take queued entries into `batch` (this forward's items, `first` leading) and `later`
        (the rest: operations, items that do not fit, the stop marker), waiting within the batching
        window while company is expected. Items whose caller is gone are answered on the way."""
        names: set[str] = set()
        requests: set[int] = set()  # the request numbers of this batch's items
        nodes = 0
        deferred = False  # an item was left for the next forward: that one is due anyway
        # the window opens when this batch can start: for an item that arrived while the model was
        # busy, that is now (else clients that fell out of step, each arriving during the other's
        # forward, would never share one again)
        window_end = max(first.job.arrived, self._clock()) + self.limits.batch_window_ms / 1e3
        entry = first
        while True:
            if not isinstance(entry, _Item):
                later.append(entry)
                if entry is _STOP:
                    break
            elif not self._answered_early(entry):
                w = entry.work
                if w.sequence_id in names or nodes + w.tree.size > self.limits.max_batch_nodes:
                    later.append(entry)
                    deferred = True
                else:
                    batch.append(entry)
                    names.add(w.sequence_id)
                    requests.add(entry.job.number)
                    nodes += w.tree.size
            if len(batch) >= self.limits.max_batch:
                break
            entry = self._take(0.0)  # whatever is queued already joins
            if entry is None:
                if not batch or deferred or self._complete(names, requests):
                    break
                entry = self._take(window_end - self._clock())
                if entry is None:
                    break

    @staticmethod
    def _answered_early(item: _Item) -> bool:
        """Answer `item` at once, and say so, when it must not reach the model: its caller has gone
        away (CANCELLED), or asking that failed (INTERNAL; `alive` is the caller's code, and its
        bug must not take the model thread down)."""
        try:
            if item.job.alive():
                return False
            error: Exception = Cancelled("the caller went away")
        except Exception as exc:  # noqa: BLE001 - handed to that caller
            log.exception("verifier: a caller's liveness check failed")
            error = exc
        item.job.deliver(item.index, ItemOutput(error=error))
        return True

    def _complete(self, names: set[str], requests: set[int]) -> bool:
        """Whether waiting for more items is pointless. Company is expected only from a sequence of
        the previous forward that is still live, not in this batch, and came in a request that
        neither this batch's sequences nor its items came in: a caller that sent it along with
        sequences it sends again now, but left it out, is done with it (an orchestrator whose
        request just finished and whose Release is still on its way), and a request split over two
        forwards (more items or nodes than one takes) has its other part behind this one. So a
        batch goes at once when every live sequence is in it, when every sequence of the previous
        forward is back, and always for a caller that sends all its sequences in one request.
        `names`: the batch's sequence ids; `requests`: its items' request numbers."""
        table = self.engine.table
        if len(names) >= len(table):
            return True
        prev = self._last_batch
        here = requests | {prev[sid] for sid in names if sid in prev}
        return not any(req not in here and sid not in names and sid in table for sid, req in prev.items())

    def _forward(self, batch: list[_Item], record: bool = True) -> BatchReport | None:
        """Run one batch and hand its outputs out; then its metrics, unless `record` is False (the
        returned report's, for the caller to record later). None when the engine failed."""
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
            return None
        for it, out in zip(batch, report.outputs):
            it.job.deliver(it.index, out, batch_id, report.forward_ms, report.sequences)
        if record:  # after the answers are out: waiting callers wake first
            self.engine.record(report)
        return report

    @staticmethod
    def _fail(entry, exc: BaseException) -> None:
        if isinstance(entry, _Op):
            entry.future.set_exception(exc)
        elif isinstance(entry, _Item):
            entry.job.deliver(entry.index, ItemOutput(error=exc))

    @classmethod
    def _fail_unanswered(cls, entry, exc: BaseException) -> None:
        """`_fail`, unless the entry's caller has its answer already (a failure after it went out)."""
        answered = (entry.future.done() if isinstance(entry, _Op)
                    else isinstance(entry, _Item) and entry.job.outputs[entry.index] is not None)
        if not answered:
            cls._fail(entry, exc)
