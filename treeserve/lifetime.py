"""A child server's life tied to its parent process's: `treeserve serve` starts the verifier and
drafter as child processes, and they must not outlive it when it is killed outright (`kill -9`, the
OOM killer, a crash), which runs none of its clean-up: a verifier left behind keeps its model, its
GPU memory and its ports.

The parent keeps the write end of a pipe open for as long as it lives and hands the child the read
end (`Tether`). The child, first thing, watches it from a daemon thread (`end_with_parent`): when the
parent process ends, however it ends, the kernel closes the write end, the read returns end-of-file,
and the child sends itself SIGTERM, which shuts a server down as any SIGTERM does. A pipe rather than
prctl(PR_SET_PDEATHSIG), which follows the thread that started the child, not the process; and
nothing runs between fork and exec (a `preexec_fn` is unsafe beside Ray's threads)."""
from __future__ import annotations

import os
import signal
import threading

PARENT_FD_ENV = "TREESERVE_PARENT_FD"


class Tether:
    """The parent's side: `fd` goes to the child (`subprocess.Popen(pass_fds=[fd])`) and `env()`
    into its environment; `close()` once the child is gone. The write end stays here, never
    inherited (os.pipe's descriptors are not), so only this process's end closes it."""

    def __init__(self):
        self.fd, self._write = os.pipe()

    def env(self) -> dict[str, str]:
        return {PARENT_FD_ENV: str(self.fd)}

    def child_started(self) -> None:
        """The child has its copy of the read end: this process needs none."""
        os.close(self.fd)

    def close(self) -> None:
        """The child may go now (idempotent)."""
        if self._write is not None:
            os.close(self._write)
            self._write = None


def end_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """In a child started with a Tether: send this process `sig` when the parent process ends. A
    no-op without PARENT_FD_ENV, which it takes out of the environment so that this process's own
    children are not tied to a grandparent."""
    fd = os.environ.pop(PARENT_FD_ENV, None)
    if fd is None:
        return

    def watch() -> None:
        while os.read(int(fd), 1):  # nothing is ever written: only the end of the parent ends this
            pass
        os.kill(os.getpid(), sig)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
