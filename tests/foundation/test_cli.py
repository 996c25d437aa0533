"""`treeserve`'s entry point: one line, not a traceback, for an interrupt, a reader that leaves, text
the output cannot encode, and a bad --log-level. Each runs as a process of its own, the command a
test module (`cli_probe`) put in the list."""
from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def treeserve(*argv: str, env: dict | None = None, **kw) -> subprocess.Popen:
    code = ("import sys, treeserve.cli as cli; cli.COMMANDS['probe'] = ('tests.foundation.cli_probe', 'probe'); "
            f"sys.exit(cli.main({list(argv)!r}))")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **(env or {})}, **kw)


def test_an_interrupt_is_one_line_and_exit_130():
    proc = treeserve("probe", "interrupt")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert b"Traceback" not in err and b"treeserve probe: interrupted" in err


def test_a_reader_that_leaves_ends_the_command_quietly():
    proc = treeserve("probe", "flood")
    assert len(proc.stdout.read(10)) == 10
    proc.stdout.close()  # `| head -c 10`
    err = proc.stderr.read()
    assert proc.wait(60) == 141, err
    assert b"Traceback" not in err and b"Exception ignored" not in err


def test_text_the_output_cannot_encode_is_replaced():
    proc = treeserve("probe", "text", env={"PYTHONIOENCODING": "ascii"})
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out == b"? ? ??\n"


def test_a_bad_log_level_is_a_usage_error():
    proc = treeserve("--log-level", "loud", "probe", "text")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and b"Traceback" not in err and b"--log-level" in err
