"""`treeserve verifier`'s options: the direct port off by default, and bad numbers (the poll time,
the batching window, the idle timeout) refused by argparse, and by `Limits.validate` for callers
that build Limits themselves."""
from __future__ import annotations

import argparse
import math

import pytest

from treeserve.h2grpc.server import POLL_SECONDS
from verifier_service.cli import add_arguments, limits_from, run
from verifier_service.limits import MAX_BATCH_WINDOW_MS, Limits


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(["--model", "m", *argv])


def test_the_direct_port_is_off_by_default_and_polls_as_the_server_does():
    args = parse()
    assert args.direct_port is None
    assert args.direct_poll_us == POLL_SECONDS * 1e6
    args = parse("--direct-port", "0", "--direct-poll-us", "0")
    assert args.direct_port == 0 and args.direct_poll_us == 0.0


@pytest.mark.parametrize("bad", ["-1", "nan", "half", "2e6"])
def test_a_bad_poll_time_is_refused(bad, capsys):
    with pytest.raises(SystemExit):
        parse("--direct-poll-us", bad)
    assert "microseconds" in capsys.readouterr().err


@pytest.mark.parametrize("window", ["0", "2.5", str(MAX_BATCH_WINDOW_MS)])
def test_a_batching_window_within_bounds_is_taken(window):
    assert limits_from(parse("--batch-window-ms", window)).batch_window_ms == float(window)


@pytest.mark.parametrize("bad", ["inf", "nan", "-1", "1e300", str(MAX_BATCH_WINDOW_MS + 1), "soon"])
def test_a_bad_batching_window_is_refused(bad, capsys):
    """An endless window once passed here and then took the model thread down at its first wait."""
    with pytest.raises(SystemExit):
        parse("--batch-window-ms", bad)
    assert "milliseconds" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["nan", "-5", "never"])
def test_a_bad_idle_timeout_is_refused(bad, capsys):
    with pytest.raises(SystemExit):
        parse("--idle-timeout-s", bad)
    assert "seconds" in capsys.readouterr().err


@pytest.mark.parametrize("field, bad", [
    ("batch_window_ms", math.inf), ("batch_window_ms", math.nan), ("batch_window_ms", -1.0),
    ("batch_window_ms", MAX_BATCH_WINDOW_MS * 2), ("idle_timeout_s", math.nan), ("idle_timeout_s", -1.0),
])
def test_limits_refuse_what_the_cli_refuses(field, bad):
    with pytest.raises(ValueError, match=field):
        Limits(**{field: bad}).validate()


def test_a_checkpoint_that_does_not_load_is_one_line_not_a_traceback(tmp_path):
    args = parse("--device", "cpu")
    args.model = str(tmp_path / "nowhere")
    with pytest.raises(SystemExit) as exit_:
        run(args)
    assert str(exit_.value).startswith("verifier: ") and "config.json" in str(exit_.value)

