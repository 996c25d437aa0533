"""`treeserve serve`: verifier replica(s) and a drafter as child processes, and the orchestrator
(on a private Ray instance) in this process: the whole system on one machine.

Without --model it serves the embedded demo pair (models/demo/target and models/demo/drafter).
"""
from __future__ import annotations

import argparse
import logging
import pathlib
import socket
import sys
from dataclasses import dataclass, field
from typing import Optional

from orchestrator.cli_orchestrator import add_limit_arguments, limits_from
from orchestrator.procs import Child, PortTaken, free_port, stop_all
from orchestrator.runtime import Orchestrator, OrchestratorConfig
from treeserve import cores
from treeserve.server import add_grace_argument, token_argument

log = logging.getLogger("treeserve.serve")

DEMO_DIR = pathlib.Path(__file__).resolve().parents[1] / "models" / "demo"


class SetupError(Exception):
    """The deployment cannot start as asked; the message says what to do."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="DIR", help="target checkpoint (default: the embedded demo model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--drafter-model", default=None, metavar="DIR",
                     help="draft checkpoint (default: the demo drafter with the demo model, else --ngram)")
    src.add_argument("--ngram", action="store_true", help="model-free n-gram drafting")
    src.add_argument("--no-drafter", action="store_true", help="no drafter: plain decoding only")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    p.add_argument("--drafter-device", default="cpu", help="device of the draft model (default cpu)")
    p.add_argument("--drafter-trim-vocab", default=None, metavar="FILE",
                   help="trimmed draft vocabulary for the draft model (see `treeserve trim-vocab`)")
    p.add_argument("--host", default="127.0.0.1", help="interface of the Generation service")
    p.add_argument("--port", type=int, default=50051, help="port of the Generation service (0: pick a free one)")
    p.add_argument("--verifier-replicas", type=int, default=1, help="verifier processes (one per GPU when several)")
    p.add_argument("--max-sequences", type=int, default=None, help="sequences per verifier replica")
    p.add_argument("--auth-token", type=token_argument, default=None, help="require 'authorization: Bearer TOKEN' from clients")
    p.add_argument("--draft-timeout-ms", type=float, default=1000.0)
    add_limit_arguments(p)  # the Generation front's
    p.add_argument("--log-dir", default=None, help="where the child services write their logs (default: temp files)")
    cores.add_argument(p)  # one set for the host: every child process benefits
    add_grace_argument(p)  # the Generation service's: it drains first, then the children stop


@dataclass
class Plan:
    target: pathlib.Path
    drafter: Optional[pathlib.Path]  # None with ngram or no drafter
    ngram: bool
    device: str
    replicas: int
    extra_verifier_args: list = field(default_factory=list)
    drafter_device: str = "cpu"
    drafter_trim_vocab: Optional[pathlib.Path] = None


def plan_from(args: argparse.Namespace) -> Plan:
    target = pathlib.Path(args.model) if args.model else DEMO_DIR / "target"
    drafter = None
    if args.drafter_model:
        drafter = pathlib.Path(args.drafter_model)
    elif not args.model and not args.ngram and not args.no_drafter:
        drafter = DEMO_DIR / "drafter"
    ngram = args.ngram or (args.model is not None and drafter is None and not args.no_drafter)
    for what, path in (("target model", target), ("draft model", drafter)):
        if path is not None and not (path / "config.json").is_file():
            hint = ("the embedded demo models are missing from this checkout (models/demo/); "
                    "pass --model DIR (and --drafter-model DIR or --ngram)") if DEMO_DIR in path.parents else (
                    "expected a Hugging Face checkpoint directory with config.json")
            raise SetupError(f"{what} not found at {path}: {hint}")
    trim = getattr(args, "drafter_trim_vocab", None)
    if trim is not None:
        if drafter is None:
            raise SetupError("--drafter-trim-vocab needs a draft model (--drafter-model DIR, or the demo pair)")
        if not pathlib.Path(trim).is_file():
            raise SetupError(f"trimmed draft vocabulary not found: {trim}")
    if args.verifier_replicas < 1:
        raise SetupError("--verifier-replicas must be >= 1")
    extra = ["--max-sequences", str(args.max_sequences)] if args.max_sequences else []
    return Plan(target, drafter, ngram, resolve_device(args.device), args.verifier_replicas, extra,
                getattr(args, "drafter_device", "cpu"), pathlib.Path(trim) if trim else None)


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def replica_device(device: str, i: int) -> str:
    """Spread replicas over the GPUs when the device is plain 'cuda'."""
    if device != "cuda":
        return device
    import torch

    n = torch.cuda.device_count()
    return f"cuda:{i % n}" if n > 1 else device


def start_services(plan: Plan, log_dir: Optional[str] = None) -> tuple[list[Child], list[str], Optional[str]]:
    """Start the children on ports chosen now, without waiting for them; returns (children,
    verifier addresses, drafter address). `wait_services` then waits until they serve."""
    def log_path(name):
        if log_dir is None:
            return None
        pathlib.Path(log_dir).mkdir(parents=True, exist_ok=True)
        return str(pathlib.Path(log_dir) / f"{name}.log")

    children: list[Child] = []
    try:
        verifiers = []
        for i in range(plan.replicas):
            port = free_port()
            children.append(Child(["verifier", "--model", plan.target, "--device", replica_device(plan.device, i),
                                   "--port", port, "--direct-port", free_port(), *plan.extra_verifier_args],
                                  f"verifier-{i}", log_path(f"verifier-{i}")))
            verifiers.append(f"127.0.0.1:{port}")
        drafter = None
        if plan.drafter is not None or plan.ngram:
            port = free_port()
            source = ["--ngram"] if plan.drafter is None else ["--model", plan.drafter, "--device", plan.drafter_device]
            if plan.drafter_trim_vocab is not None:
                source += ["--trim-vocab", plan.drafter_trim_vocab]
            children.append(Child(["drafter", *source, "--port", port, "--direct-port", free_port()], "drafter",
                                  log_path("drafter")))
            drafter = f"127.0.0.1:{port}"
        return children, verifiers, drafter
    except BaseException:
        stop_all(children)
        raise


def wait_services(children: list[Child], timeout: float = 900.0) -> None:
    """Until every child serves; stops them all and raises if one fails."""
    try:
        for c in children:
            c.wait(timeout)
    except BaseException:
        stop_all(children)
        raise


def prepare_beside(orch: Orchestrator, children: list[Child]) -> None:
    """`orch.prepare()` (Ray starts) while the children load their models. When both go wrong (a
    slow machine's Ray timing out beside a checkpoint that does not load), the child's own failure
    is the one to tell: it is the cause a user can fix."""
    try:
        orch.prepare()
    except Exception as exc:
        for child in children:
            if not child.alive():
                try:
                    child.wait(0.0)
                except (RuntimeError, TimeoutError) as exited:
                    raise exited from exc
        raise


def launch(plan: Plan, config: OrchestratorConfig, log_dir: Optional[str] = None,
           attempts: int = 3) -> tuple[list[Child], Orchestrator]:
    """Children and orchestrator; Ray starts while the models load. A child whose port was taken
    between choosing it and binding it (another program on the machine) is not an error of the
    deployment: everything starts again on new ports, up to `attempts` times."""
    attempt = 1
    while True:
        children, verifiers, drafter = start_services(plan, log_dir)
        config.verifiers, config.drafter = verifiers, drafter
        orch = Orchestrator(config)
        try:
            prepare_beside(orch, children)
            wait_services(children)
            orch.start()
            return children, orch
        except PortTaken as exc:
            stop_all(children)
            orch.stop()
            if attempt >= attempts:
                raise
            attempt += 1
            log.warning("a service's port was taken before it could bind it; starting again on new ports (%s)",
                        str(exc).splitlines()[0])
        except BaseException:
            stop_all(children)
            orch.stop()
            raise


class LaunchFailed(Exception):
    """A service did not start (`launch_or_say_why`); the message is one line for the terminal."""


def launch_or_say_why(plan: Plan, config: OrchestratorConfig, log_dir: Optional[str] = None):
    """`launch`, with what stopped it in one line (LaunchFailed): a child that exited (its own last
    words: a checkpoint that does not load...), did not come up in time, or a port that was taken.
    Checks first that the public port (when one is named) can be bound, before any model loads."""
    if config.port:
        try:
            with socket.socket() as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
                probe.bind((config.host, config.port))
        except OSError as exc:
            raise LaunchFailed(f"cannot take {config.host}:{config.port}: {exc.strerror}") from None
    try:
        return launch(plan, config, log_dir)
    except (RuntimeError, TimeoutError, OSError) as exc:
        lines = [line for line in str(exc).splitlines() if line.strip()]
        why = lines[0] if len(lines) < 2 else f"{lines[0]} {lines[-1]}"
        where = f" (logs in {log_dir})" if log_dir else ""
        raise LaunchFailed(f"{why}{where}") from None


def run(args: argparse.Namespace) -> int:
    try:
        plan = plan_from(args)
    except SetupError as exc:
        print(f"treeserve serve: {exc}", file=sys.stderr)
        return 2
    config = OrchestratorConfig(verifiers=[], host=args.host, port=args.port, auth_token=args.auth_token,
                                tokenizer=str(plan.target), draft_timeout_s=args.draft_timeout_ms / 1e3,
                                limits=limits_from(args),
                                shutdown_grace_s=args.shutdown_grace_s)
    try:
        children, orch = launch_or_say_why(plan, config, args.log_dir)
    except LaunchFailed as exc:
        print(f"treeserve serve: {exc}", file=sys.stderr)
        return 1
    try:
        # after the children have loaded (the loops would slow that a little), before any client
        with cores.CoreSpinners(args.keep_cores_awake):
            print(f"serving {plan.target.name} on {args.host}:{orch.port} (verifiers {', '.join(config.verifiers)}; "
                  f"drafter {config.drafter or 'none'})", flush=True)
            print(f"orchestrator listening on {args.host}:{orch.port}", flush=True)
            orch.wait()
    finally:
        stop_all(children)
    return 0
