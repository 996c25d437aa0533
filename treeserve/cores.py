"""Keep CPU cores out of their idle states with lowest-priority busy loops (`--keep-cores-awake N`).

A thread woken on a core that sat idle (a deep C-state, or in a virtual machine a halted vCPU that
exited to the host) starts late: tens to hundreds of microseconds, paid several times per gRPC round
trip (the server's poll and handler threads, the client's sender and reader). N child processes that
spin at SCHED_IDLE priority keep N cores busy: the kernel runs a SCHED_IDLE task only when nothing
else wants the core and preempts it at once when something does, so served work barely notices them,
but the cores never go idle. On the verifier's host this halved a bare gRPC stream round trip (0.65
to 0.32 ms, `bench/grpc_roundtrip.py`). The price: N cores show 100% busy and draw power all the
time, and other SCHED_IDLE work on the host gets less CPU. Where an idle guest core is not an idle
physical one (a VM under a CPU quota, shared or SMT-sibling cores) the loops compete with real work
instead: measure on the serving host. Linux only.

Each spinner is a short Python prologue (parent-death signal, then a readiness line) that execs
`/bin/sh` running `while :; do :; done`: under 2 MB of memory per spinner once running, no
`preexec_fn` (unsafe in a process that already runs threads). The parent lowers each one to
SCHED_IDLE once it is ready. They die with their owner in every case:
- `stop()` (or leaving the `with` block) kills and reaps them;
- a crash or `kill -9` of the owner: each spinner asked the kernel (prctl PR_SET_PDEATHSIG) for
  SIGKILL when its parent goes. The kernel ties that to the *thread* that started the child, so
  start spinners from a thread that lives as long as they should (the main thread).
"""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys

log = logging.getLogger("treeserve.cores")

SHELL = "/bin/sh"
SPIN = "while :; do :; done"  # the shell's builtin `:`: no system calls, no allocation

# Runs in each child before it becomes the spinner: ask for SIGKILL when the parent dies, make sure
# the parent did not die before that (the signal would never come), say so, then exec the shell loop
# (the death signal survives exec). argv: parent pid, shell, loop.
_PROLOGUE = """\
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(1, 9, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG, SIGKILL
    sys.exit("prctl(PR_SET_PDEATHSIG) failed: " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):
    sys.exit(0)
os.write(1, b"ready\\n")
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)
os.execv(sys.argv[2], ["sh", "-c", sys.argv[3]])
"""


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask; the machine's count where unknown)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def spinner_count(text: str) -> int:
    """argparse `type` of `--keep-cores-awake`: a count >= 0 (0: off), or `all` / -1 for one
    spinner per usable core."""
    value = text.strip().lower()
    try:
        n = usable_cores() if value in ("all", "-1") else int(value)
    except ValueError:
        n = -2
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a number of cores >= 0, or 'all' (-1) for every core; got {text!r}")
    if n > 0 and not hasattr(os, "SCHED_IDLE"):
        raise argparse.ArgumentTypeError("keeping cores awake needs Linux (SCHED_IDLE)")
    return n


def add_argument(p: argparse.ArgumentParser) -> None:
    """The `--keep-cores-awake` option, the same on every server."""
    p.add_argument("--keep-cores-awake", type=spinner_count, default=0, metavar="N",
                   help="run N lowest-priority (SCHED_IDLE) busy loops so that cores never go idle: lower "
                        "wake-up latency per request for N otherwise idle cores kept 100%% busy; 'all' or -1: "
                        "one per core (default 0: off)")


class CoreSpinners:
    """`count` SCHED_IDLE busy-loop child processes. `start()` returns once every one runs at that
    priority; `stop()` kills and reaps them (idempotent). A context manager."""

    def __init__(self, count: int):
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        self.count = count
        self._procs: list[subprocess.Popen] = []

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def start(self) -> "CoreSpinners":
        if self._procs or not self.count:
            return self
        try:
            # started together, then waited for: their interpreters start in parallel
            for _ in range(self.count):
                self._procs.append(subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _PROLOGUE, str(os.getpid()), SHELL, SPIN],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, close_fds=True))
            for p in self._procs:
                line = p.stdout.readline()
                p.stdout.close()
                if line != b"ready\n":
                    raise RuntimeError(f"a core spinner failed to start (exit status {p.wait()})")
                # lowered only now, so that its start-up is not starved on a busy host
                os.sched_setscheduler(p.pid, os.SCHED_IDLE, os.sched_param(0))
        except BaseException:
            self.stop()
            raise
        log.info("keeping %d core(s) awake with SCHED_IDLE spinners", self.count)
        return self

    def stop(self) -> None:
        procs, self._procs = self._procs, []
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
            if p.stdout is not None and not p.stdout.closed:
                p.stdout.close()

    def __enter__(self) -> "CoreSpinners":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
