"""`treeserve bench`: the sub-benchmarks are listed and arguments reach pass-through modules intact."""
from __future__ import annotations

import argparse
import subprocess
import sys

from bench import cli

ALL = ["e2e", "verify-cost", "plots", "ssm-kernels", "attn-conv-kernels", "model-runtime", "commit-graphs",
       "verifier-service", "drafter", "first-use", "prefill", "random-checkpoint"]


def test_help_lists_every_sub_benchmark():
    r = subprocess.run([sys.executable, "-m", "treeserve.cli", "bench", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    for name in ALL:
        assert f"    {name}" in r.stdout, f"{name} missing from:\n{r.stdout}"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="treeserve bench")
    cli.add_arguments(p)
    return p


def test_pass_through_keeps_the_module_flags():
    args = parser().parse_args(["model-runtime", "--shape", "hybrid-8b", "--out", "x.json", "--layers", "4"])
    assert args.bench == "model-runtime"
    assert args.argv == ["--shape", "hybrid-8b", "--out", "x.json", "--layers", "4"]
    assert parser().parse_args(["ssm-kernels", "--help"]).argv == ["--help"]


def test_own_subcommands_parse_their_options():
    args = parser().parse_args(["e2e", "--toy", "--budgets", "4", "8", "--temperatures", "0", "--paths", "inproc"])
    assert (args.bench, args.toy, args.budgets, args.temperatures, args.paths) == ("e2e", True, [4, 8], [0.0], ["inproc"])
    args = parser().parse_args(["verify-cost", "--tau", "2.5", "--ratios", "a.json", "b.json"])
    assert (args.tau, args.ratios, args.shapes) == ("2.5", ["a.json", "b.json"], ["mamba2-2.7b", "hybrid-8b"])
