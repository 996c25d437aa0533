"""`--keep-cores-awake`: SCHED_IDLE busy loops that start at that priority, as many as asked, and are
gone after `stop()` and after their owner is killed with SIGKILL (no orphan keeps spinning)."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import pytest

from treeserve import cores

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux only")


def running(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie (a killed orphan waits as one until init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def wait_until(predicate, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


def test_spinners_run_at_sched_idle_and_stop():
    with cores.CoreSpinners(2) as spinners:
        pids = spinners.pids
        assert len(pids) == 2 and len(set(pids)) == 2
        for pid in pids:
            assert running(pid)
            assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        # each became the shell loop (a small process), keeping its priority
        assert wait_until(lambda: all(cores.SPIN in cmdline(p) for p in pids))
        assert all(os.sched_getscheduler(p) == os.SCHED_IDLE for p in pids)
    assert spinners.pids == []
    assert not any(running(p) for p in pids)  # killed and reaped by stop()
    spinners.stop()  # idempotent


def test_zero_spinners_start_nothing():
    with cores.CoreSpinners(0) as spinners:
        assert spinners.pids == []
    with pytest.raises(ValueError):
        cores.CoreSpinners(-1)


def test_spinners_die_with_an_owner_killed_by_sigkill():
    """No orphan survives `kill -9` of the process that started them (parent-death signal)."""
    script = ("import sys, time; from treeserve.cores import CoreSpinners; s = CoreSpinners(3).start(); "
              "print(*s.pids, flush=True); time.sleep(120)")
    owner = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 3
        assert all(running(p) and os.sched_getscheduler(p) == os.SCHED_IDLE for p in pids)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
        owner.stdout.close()
    assert wait_until(lambda: not any(running(p) for p in pids)), \
        [(p, cmdline(p)) for p in pids if running(p)]


@pytest.mark.parametrize("text, expected", [("0", 0), ("3", 3), (" 2 ", 2), ("all", None), ("ALL", None), ("-1", None)])
def test_spinner_count(text, expected):
    assert cores.spinner_count(text) == (cores.usable_cores() if expected is None else expected)


@pytest.mark.parametrize("module", ["verifier_service.cli", "drafter_service.cli", "orchestrator.cli_serve"])
@pytest.mark.parametrize("bad", ["-2", "x", "1.5", ""])
def test_bad_counts_are_argparse_errors(module, bad, capsys):
    import importlib

    p = argparse.ArgumentParser(prog="treeserve x")
    importlib.import_module(module).add_arguments(p)
    with pytest.raises(SystemExit) as exc:
        p.parse_args(["--model", "m", "--keep-cores-awake", bad])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--keep-cores-awake" in err and "'all'" in err, err


@pytest.mark.parametrize("module", ["verifier_service.cli", "drafter_service.cli", "orchestrator.cli_serve"])
def test_servers_take_the_option(module):
    """Also `treeserve serve`, which runs one set for the host its children share."""
    import importlib

    p = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(p)
    assert p.parse_args(["--model", "m"]).keep_cores_awake == 0
    assert p.parse_args(["--model", "m", "--keep-cores-awake", "all"]).keep_cores_awake == cores.usable_cores()
