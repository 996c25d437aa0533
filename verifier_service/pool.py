"""A thread pool for gRPC's synchronous server that gives each task to the thread idle the shortest.

gRPC runs every call on a pool thread. The standard pool's idle threads take turns, so a steady
stream of calls, one at a time, visits every thread of the pool, each time one whose caches have
gone cold. This pool keeps such a stream on one thread: the most recently idle one takes the next
task. In the verifier that thread should also be one that has run the model itself before (the
batcher lets only a few threads do that, see `batcher.INLINE_THREADS`): `prefer` names such threads,
and an idle preferred thread goes before more recently idle others (after a burst of concurrent
calls the last thread to come free is any of them). Threads are made on demand, up to
`max_workers`; tasks beyond that wait, in order, for the next thread to come free.

`context` (optional) is entered by each pool thread around everything it runs, once for its life:
per-thread state that every task wants (the verifier's: torch inference mode) without each task
paying to set it up and tear it down.
"""
from __future__ import annotations

import collections
import threading
from concurrent.futures import Executor, Future
from typing import Callable, ContextManager, Optional


class _Worker:
    """One pool thread. `give` hands it a task (None: exit); a bare lock is the cheapest wake-up."""

    def __init__(self, pool: "LifoExecutor", task):
        self._pool = pool
        self._task = task
        self.ident: Optional[int] = None  # the thread's, once it runs
        self._wake = threading.Lock()
        self._wake.acquire()

    def give(self, task) -> None:
        self._task = task
        self._wake.release()

    def wait(self):
        self._wake.acquire()
        return self._task

    def run(self) -> None:
        self.ident = threading.get_ident()
        if self._pool._context is None:
            self._serve()
        else:
            with self._pool._context():
                self._serve()

    def _serve(self) -> None:
        task = self._task
        while task is not None:
            future, fn, args, kwargs = task
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - handed to the future, as the standard pool does
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del future, fn, args, kwargs  # drop references while idle
            task = self._pool._next(self)


class LifoExecutor(Executor):
    def __init__(self, max_workers: int, name: str = "rpc", prefer: Optional[Callable[[int], bool]] = None,
                 context: Optional[Callable[[], ContextManager]] = None):
        """prefer(thread ident): whether an idle thread should take the next task before others.
        context(): a context manager each thread enters once, around all the tasks it runs."""
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._max = max_workers
        self._name = name
        self._prefer = prefer
        self._context = context
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []  # a stack: the last one in goes first
        self._backlog: collections.deque = collections.deque()
        self._threads: list[threading.Thread] = []
        self._shutdown = False

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        task = (future, fn, args, kwargs)
        with self._lock:
            if self._shutdown:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if self._idle:
                self._take_idle().give(task)
            elif len(self._threads) < self._max:
                worker = _Worker(self, task)
                thread = threading.Thread(target=worker.run, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            else:
                self._backlog.append(task)
        return future

    def _take_idle(self) -> _Worker:
        """The most recently idle preferred worker, else the most recently idle one (lock held)."""
        if self._prefer is not None:
            for i in range(len(self._idle) - 1, -1, -1):
                if self._prefer(self._idle[i].ident):  # set: a worker is idle only after it ran
                    return self._idle.pop(i)
        return self._idle.pop()

    def _next(self, worker: _Worker):
        """The worker's next task, waiting while there is none; None when the pool shuts down."""
        with self._lock:
            if self._backlog:
                return self._backlog.popleft()
            if self._shutdown:
                return None
            self._idle.append(worker)
        return worker.wait()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            self._shutdown = True
            if cancel_futures:
                while self._backlog:
                    self._backlog.popleft()[0].cancel()
            idle, self._idle = self._idle, []
            threads = list(self._threads)
        for worker in idle:
            worker.give(None)
        if wait:
            me = threading.current_thread()
            for thread in threads:
                if thread is not me:
                    thread.join()
