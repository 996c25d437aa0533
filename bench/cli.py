"""`treeserve bench <benchmark>`: every benchmark behind one command.

Own subcommands (arguments defined here, help with `treeserve bench NAME --help`):
  e2e            end-to-end generation on a model pair: every decoding method, tokens/s, tau, speedups
  verify-cost    verify cost ratio against tree size at realistic shapes, and the projected speedup
  plots          redraw the e2e plots from an e2e.json

Pass-throughs (everything after the name goes to the module's own parser, so
`treeserve bench model-runtime --help` shows its options):
  ssm-kernels, attn-conv-kernels, model-runtime, commit-graphs, verifier-service, drafter, first-use,
  prefill, random-checkpoint
"""
from __future__ import annotations

import argparse
import importlib
import sys

OWN = {
    "e2e": ("bench.e2e", "end-to-end generation on a model pair: tokens/s, tau and speedup of every decoding method"),
    "verify-cost": ("bench.verify_cost", "verify cost ratio vs tree size at realistic shapes, and the projected "
                                         "speedup from a measured tau"),
}
PASS_THROUGH = {
    "ssm-kernels": ("bench.ssm_kernels", "SSM kernels (tree scan, commit, decode, prefill) against their floors"),
    "attn-conv-kernels": ("bench.attn_conv_kernels", "tree conv and tree attention kernels"),
    "model-runtime": ("bench.model_runtime", "model runtime: decode vs floor, verify cost ratio, CUDA graphs"),
    "commit-graphs": ("bench.commit_graphs", "commits replayed as CUDA graphs against eager commits, one process"),
    "verifier-service": ("bench.verifier_service", "verifier service: nodes/s and gRPC overhead vs sequences"),
    "drafter": ("bench.drafter", "drafter: draft time per tree vs budget, draft-ahead in a greedy loop"),
    "first-use": ("bench.first_use", "what a prompt, a catch-up and a decode cost at first use and after, and what "
                                     "each compiles"),
    "prefill": ("bench.prefill", "prefill latency against prompt length: the packed prefill, prompts as chains "
                                 "through the graphs, and in pieces (chunks, then chains)"),
    "random-checkpoint": ("bench.random_checkpoint", "write a random-weight checkpoint of a benchmark shape (with a "
                                                     "tokenizer, or weights whose greedy text repeats)"),
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (p.description or "") + " Run `treeserve bench BENCHMARK --help` for a benchmark's options."
    sub = p.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name, (module, help_text) in OWN.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(sp)
    sp = sub.add_parser("plots", help="redraw the e2e plots from an e2e.json", description="redraw the e2e plots")
    sp.add_argument("result", help="e2e.json written by `treeserve bench e2e`")
    sp.add_argument("--out", default=None, help="output directory (default: the JSON's directory)")
    for name, (module, help_text) in PASS_THROUGH.items():
        # '+' as the option prefix: every '--flag' after the name is left for the module's parser
        sp = sub.add_parser(name, help=f"{help_text} (python -m {module})", add_help=False, prefix_chars="+")
        sp.add_argument("argv", nargs=argparse.REMAINDER)


def run(args: argparse.Namespace) -> int:
    if args.bench in OWN:
        return int(importlib.import_module(OWN[args.bench][0]).run(args) or 0)
    if args.bench == "plots":
        return _plots(args)
    module_name = PASS_THROUGH[args.bench][0]
    module = importlib.import_module(module_name)
    saved = sys.argv
    sys.argv = [f"python -m {module_name}", *args.argv]
    try:
        return int(module.main() or 0)
    finally:
        sys.argv = saved


def _plots(args: argparse.Namespace) -> int:
    import json
    import pathlib

    from bench import plots

    src = pathlib.Path(args.result)
    files = plots.e2e_plots(json.loads(src.read_text()), pathlib.Path(args.out) if args.out else src.parent)
    for f in files:
        print(f"wrote {f}")
    return 0 if files else 1
