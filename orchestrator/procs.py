"""Child service processes on this machine: start `treeserve <command>`, learn the port it bound,
wait until its health check says SERVING, stop it."""
from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from treeserve import lifetime

log = logging.getLogger("treeserve.procs")

_LISTENING = re.compile(r"listening on (\S+):(\d+)")
_BIND_FAILED = "Failed to bind to address"  # grpc's words when a server cannot take its port


class PortTaken(RuntimeError):
    """A child could not bind the port it was given: something else took it first."""


# Ray's worker processes take ports 10002-19999 by default; ours are chosen above them.
_LOWEST_PORT = 20000


def _ephemeral_ports() -> tuple[int, int]:
    """The range the kernel hands out for port-0 binds and outgoing connections."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(v) for v in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port that is free now, for a child process to bind a moment later.

    Chosen below the kernel's ephemeral range where there is room: a port that the kernel handed
    out for a port-0 bind and then took back is soon handed out again, to any outgoing connection
    or port-0 bind on the machine, and the child that meant to bind it would fail with 'Address
    already in use'. Explicit binds are the only competition below the range.
    """
    rng = rng or random.Random()
    lo, _ = _ephemeral_ports()
    if lo - _LOWEST_PORT >= 1000:
        for _ in range(64):
            port = rng.randrange(_LOWEST_PORT, lo)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_serving(address: str, timeout: float, service: str = "", alive=lambda: True) -> None:
    """Block until `address` answers its health check with SERVING; raises TimeoutError."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError(f"the process serving {address} exited")
        with grpc.insecure_channel(address) as ch:
            try:
                r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        time.sleep(0.2)
    raise TimeoutError(f"{address} not serving after {timeout:.0f} s")


class Child:
    """`treeserve <args>` as a child process; output goes to `log_path` (a temp file by default,
    removed by `stop` unless the child failed: exited on its own, or did not start in time).
    `address` is known once `wait()` returns. The child ends when this process does, however this
    one ends (`treeserve.lifetime`)."""

    def __init__(self, args: Sequence[str], name: str, log_path: Optional[str] = None, env: Optional[dict] = None,
                 preexec=None, prefix: Sequence[str] = ()):
        self.name = name
        self.args = [str(a) for a in args]
        self._temp_log = log_path is None
        self._failed = False  # its log is kept: it says why
        self._stopped = False
        self.log_path = log_path or tempfile.mkstemp(prefix=f"treeserve-{name}-", suffix=".log")[1]
        self._log = open(self.log_path, "ab")
        self._log_start = self._log.tell()  # a reused log file: an earlier run's 'listening on' is stale
        self._tether = lifetime.Tether()  # it ends with this process, however this one ends
        full_env = dict(os.environ)
        full_env.update(self._tether.env())
        full_env.update(env or {})
        cmd = [*prefix, sys.executable, "-m", "treeserve.cli", *self.args]
        try:
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env,
                                         start_new_session=True, preexec_fn=preexec, pass_fds=[self._tether.fd])
        finally:
            self._tether.child_started()
        self.address: Optional[str] = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float = 120.0, host: Optional[str] = None) -> str:
        """Wait for the 'listening on' line and a SERVING health check; returns host:port."""
        deadline = time.monotonic() + timeout
        while self.address is None:
            m = _LISTENING.search(self.output())
            if m:
                self.address = f"{host or m.group(1)}:{m.group(2)}"
                break
            if not self.alive():
                out = self.output()
                self._failed = True
                failure = PortTaken if _BIND_FAILED in out else RuntimeError
                raise failure(f"{self.name} exited with {self.proc.returncode} (log: {self.log_path}):\n{out[-3000:]}")
            if time.monotonic() > deadline:
                self._failed = True
                raise TimeoutError(f"{self.name} did not start in {timeout:.0f} s (log: {self.log_path}):\n"
                                   f"{self.output()[-3000:]}")
            time.sleep(0.1)
        wait_serving(self.address, max(1.0, deadline - time.monotonic()), alive=self.alive)
        return self.address

    def output(self) -> str:
        """What this process has written to its log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to the service (it shuts down its own helpers, e.g. a private Ray instance),
        then SIGKILL to whatever is left of its process group."""
        if self._stopped:
            return
        self._stopped = True
        if self.alive():
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        elif not self._failed:  # it had ended on its own: its log says why
            self._failed = True
            log.warning("%s had exited with %s before it was stopped; its log: %s", self.name,
                        self.proc.returncode, self.log_path)
        self.kill()
        self._log.close()
        self._tether.close()
        if self._temp_log and not self._failed:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)

    def kill(self) -> None:
        """SIGKILL the child (and its process group): a crash, as far as its peers can tell."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def stop_all(children: Sequence[Child]) -> None:
    threads = [threading.Thread(target=c.stop) for c in children]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
