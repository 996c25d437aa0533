"""Separate network hosts on one machine: a Linux network namespace per host, linked to the test's
own namespace by a veth pair (host side 10.231.N.1, namespace side 10.231.N.2). Needs root."""
from __future__ import annotations

import os
import shutil
import subprocess


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *(("netns", "exec", ns, "ip") if ns else ()), *args]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


class Host:
    """A namespace `name` reachable at `address`; `prefix` runs a command inside it."""

    def __init__(self, index: int):
        tag = f"ts{os.getpid() % 100000}{index}"
        self.name = f"{tag}ns"
        self._veth = f"{tag}h"
        self.address = f"10.231.{index}.2"
        self.prefix = ["ip", "netns", "exec", self.name]
        subprocess.run(["ip", "netns", "add", self.name], check=True, capture_output=True, text=True, timeout=30)
        try:
            _ip("link", "add", self._veth, "type", "veth", "peer", "name", f"{tag}n")
            _ip("link", "set", f"{tag}n", "netns", self.name)
            _ip("addr", "add", f"10.231.{index}.1/24", "dev", self._veth)
            _ip("link", "set", self._veth, "up")
            _ip("addr", "add", f"{self.address}/24", "dev", f"{tag}n", ns=self.name)
            _ip("link", "set", f"{tag}n", "up", ns=self.name)
            _ip("link", "set", "lo", "up", ns=self.name)
        except BaseException:
            self.delete()
            raise

    def delete(self) -> None:
        """Removing the namespace removes its end of the veth pair, and with it the pair."""
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self._veth], capture_output=True, timeout=30)


def unavailable() -> str | None:
    """Why separate hosts cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    try:
        Host(250).delete()
    except subprocess.CalledProcessError as exc:
        return f"cannot create a network namespace with a veth pair: {exc.stderr.strip() or exc}"
    return None
