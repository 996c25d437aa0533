"""`treeserve` command line: the composition root. Each subcommand lives with the code it runs and
is imported only when invoked, so `treeserve --help` stays fast and light."""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from treeserve import lifetime

# subcommand -> (module defining add_arguments(parser) and run(args), one-line help)
COMMANDS = {
    "serve": ("orchestrator.cli_serve", "run drafter + verifier + orchestrator on this machine (the demo's server)"),
    "generate": ("orchestrator.cli_generate", "stream a completion from a running server to the terminal"),
    "demo": ("orchestrator.cli_demo", "start everything on the embedded default model and generate a few completions"),
    "verifier": ("verifier_service.cli", "run the verifier service (owns the target model)"),
    "drafter": ("drafter_service.cli", "run the drafter service (draft model or n-gram)"),
    "trim-vocab": ("drafter_service.vocab", "count token frequencies and write a trimmed draft vocabulary file"),
    "orchestrator": ("orchestrator.cli_orchestrator", "run the public Generation service against remote drafter/verifier"),
    "bench": ("bench.cli", "run benchmarks (kernels, runtime, verifier, drafter, e2e)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="treeserve",
        description="Speculative tree decoding for hybrid state-space models, served over gRPC.",
    )
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"), help="logging level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # text a terminal or pipe cannot encode comes out as '?' rather than as a traceback
    sys.stdout.reconfigure(errors="replace")
    lifetime.end_with_parent()  # a child of `treeserve serve` ends with it
    module_name, help_text = COMMANDS[args.command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            print(f"treeserve {args.command}: not available in this build ({module_name} missing)", file=sys.stderr)
            return 2
        raise
    sub = argparse.ArgumentParser(prog=f"treeserve {args.command}", description=help_text)
    module.add_arguments(sub)
    options = sub.parse_args(rest)
    try:
        return int(module.run(options) or 0)
    except KeyboardInterrupt:  # Ctrl-C: whatever the command started has been stopped on the way out
        print(f"\ntreeserve {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141


if __name__ == "__main__":
    sys.exit(main())
