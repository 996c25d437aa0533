"""Child service processes: starting one whose log file an earlier run already wrote to."""
from __future__ import annotations

from orchestrator.procs import Child, free_port


def test_reused_log_file_is_not_mistaken_for_this_run(tmp_path):
    """`--log-dir` reused across runs: the earlier run's 'listening on' line names a port nobody
    serves any more; the child's address must come from its own output."""
    log = tmp_path / "drafter.log"
    stale = free_port()
    log.write_text(f"drafter listening on 127.0.0.1:{stale}\n")
    child = Child(["drafter", "--ngram", "--port", 0], "drafter", str(log))
    try:
        address = child.wait(60)
    finally:
        child.stop()
    assert address != f"127.0.0.1:{stale}"
    assert f"listening on {address}" in child.output()
    assert log.read_text().startswith(f"drafter listening on 127.0.0.1:{stale}\n")  # appended, not truncated
