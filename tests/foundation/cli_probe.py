"""A `treeserve` subcommand for tests of the command line's own handling (tests/foundation/test_cli.py)."""
import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=("interrupt", "flood", "text"))


def run(args: argparse.Namespace) -> int:
    if args.what == "interrupt":
        raise KeyboardInterrupt
    if args.what == "flood":  # more than any pipe holds, to a reader that leaves early
        for _ in range(100_000):
            sys.stdout.write("x" * 100 + "\n")
    else:
        sys.stdout.write("é → 世界\n")
    return 0
