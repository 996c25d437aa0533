"""A child server's life tied to its parent's: `treeserve serve` starts the verifier and drafter as
child processes, and they must not outlive it when it is killed outright (`kill -9`, the OOM killer,
a crash), which runs none of its clean-up: a verifier left behind keeps its model, its GPU memory
and its ports.

The parent names itself in PARENT_ENV; the child, first thing, asks the kernel (Linux
prctl PR_SET_PDEATHSIG) for SIGTERM when that parent dies, which shuts a server down as any
SIGTERM does. Done in the child rather than in a `preexec_fn`, which is unsafe in a parent that
already runs threads (Ray's)."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger("treeserve.lifetime")

PARENT_ENV = "TREESERVE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def child_env() -> dict[str, str]:
    """What a parent adds to a child's environment so that the child ends with it."""
    return {PARENT_ENV: str(os.getpid())}


def end_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """In a child started with `child_env()`: have `sig` sent to this process when the parent
    dies; if it has died already, end now. A no-op without PARENT_ENV (which it takes out of the
    environment, so this process's own children are not tied to a grandparent) or off Linux."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        log.warning("prctl(PR_SET_PDEATHSIG) failed (%s): this process may outlive its parent",
                    os.strerror(ctypes.get_errno()))
        return
    if os.getppid() != int(parent):  # the parent died before the request took hold
        raise SystemExit(f"parent process {parent} has exited")
