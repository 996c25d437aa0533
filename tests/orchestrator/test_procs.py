"""Child service processes: their ports (chosen free, taken by someone else before the child binds them), and a
log file an earlier run already wrote to."""
from __future__ import annotations

import os

import pytest

from orchestrator.procs import Child, free_port
from tests.orchestrator.stack import STARTUP_S  # a child imports torch: slow on a busy machine


def test_reused_log_file_is_not_mistaken_for_this_run(tmp_path):
    """`--log-dir` reused across runs: the earlier run's 'listening on' line names a port nobody
    serves any more; the child's address must come from its own output."""
    log = tmp_path / "drafter.log"
    stale = free_port()
    log.write_text(f"drafter listening on 127.0.0.1:{stale}\n")
    child = Child(["drafter", "--ngram", "--port", 0], "drafter", str(log))
    try:
        address = child.wait(STARTUP_S)
    finally:
        child.stop()
    assert address != f"127.0.0.1:{stale}"
    assert f"listening on {address}" in child.output()
    assert log.read_text().startswith(f"drafter listening on 127.0.0.1:{stale}\n")  # appended, not truncated


def test_free_port_is_free_and_below_the_ephemeral_range():
    """Ports the kernel hands out for port-0 binds come back to anyone soon after; ours are chosen
    where only explicit binds compete (when the machine's range leaves room below it)."""
    import random
    import socket

    from orchestrator.procs import _LOWEST_PORT, _ephemeral_ports

    lo, _ = _ephemeral_ports()
    rng = random.Random(5)
    for _ in range(20):
        port = free_port(rng=rng)
        if lo - _LOWEST_PORT >= 1000:
            assert _LOWEST_PORT <= port < lo
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_a_child_whose_port_is_taken_says_so():
    import socket

    from orchestrator.procs import PortTaken

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", free_port()))
        holder.listen()
        port = holder.getsockname()[1]
        child = Child(["drafter", "--ngram", "--port", port], "drafter")
        try:
            with pytest.raises(PortTaken, match="drafter exited") as info:
                child.wait(STARTUP_S)
        finally:
            child.stop()
    # a failed child's temp log is kept, and the error names it
    assert f"(log: {child.log_path})" in str(info.value)
    assert os.path.exists(child.log_path)
    os.unlink(child.log_path)


def test_a_temp_log_goes_with_a_child_that_ran_and_was_stopped():
    child = Child(["drafter", "--ngram", "--port", 0], "drafter")
    try:
        child.wait(STARTUP_S)
        assert os.path.exists(child.log_path)
    finally:
        child.stop()
    assert not os.path.exists(child.log_path)
    child.stop()  # twice: nothing more happens


_TAKEN_PORT_DEMO = """
import socket, sys
import orchestrator.cli_serve as serve
from treeserve.cli import main

holder = socket.socket()
holder.bind(("127.0.0.1", serve.free_port()))
holder.listen()
ports = [holder.getsockname()[1]]  # the first port handed out is one this process holds
chosen = serve.free_port
serve.free_port = lambda: ports.pop() if ports else chosen()
sys.exit(main(["demo", "--ngram", "--device", "cpu", "--prompts", "1", "--max-new-tokens", "4"]))
"""


def test_a_launch_whose_port_was_taken_starts_again_on_new_ports():
    """The whole system, launched as `treeserve demo` does, when the first port it chose is taken
    before the verifier can bind it: it starts again on new ports and serves."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run([sys.executable, "-c", _TAKEN_PORT_DEMO], cwd=root, capture_output=True, text=True,
                         timeout=600, env=dict(os.environ, PYTHONPATH=root))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "starting again on new ports" in run.stderr
    assert "ready in" in run.stdout


def test_a_child_ends_when_its_parent_is_killed_outright(tmp_path):
    """`kill -9` of the process that started a child runs none of its clean-up; the child still
    ends (SIGTERM from the kernel when its parent dies) instead of keeping its model and ports."""
    import os
    import signal
    import subprocess
    import sys
    import time

    parent = subprocess.Popen(
        [sys.executable, "-c", "from orchestrator.procs import Child; import time\n"
         f"c = Child(['drafter', '--ngram', '--port', '0'], 'drafter', {str(tmp_path / 'd.log')!r})\n"
         f"c.wait({STARTUP_S}); print(c.proc.pid, flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()

    def running(pid: int) -> bool:  # gone, or a zombie nobody reaps, counts as ended
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 30
    while running(child_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if running(child_pid):
        os.kill(child_pid, signal.SIGKILL)
        pytest.fail("the child outlived its killed parent")


def test_a_child_started_from_a_thread_outlives_that_thread(tmp_path):
    """What ties a child to its parent is the parent process, not the thread that started it (a
    test's helper thread, a restart from a worker)."""
    import threading

    started = {}
    t = threading.Thread(target=lambda: started.update(child=Child(["drafter", "--ngram", "--port", 0], "drafter",
                                                                   str(tmp_path / "d.log"))))
    t.start()
    t.join()
    child = started["child"]
    try:
        child.wait(STARTUP_S)  # serves, after its starter thread has ended
        assert child.alive()
    finally:
        child.stop()
