"""`treeserve verifier`'s direct-port options: off by default, and bad values refused by argparse."""
from __future__ import annotations

import argparse

import pytest

from treeserve.h2grpc.server import POLL_SECONDS
from verifier_service.cli import add_arguments


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
