"""`treeserve orchestrator`: the public Generation service in front of remote verifier replicas
and a drafter, on a private Ray instance or a Ray cluster.

Replica management of a running deployment (joins its Ray cluster, then exits):
    treeserve orchestrator --ray-address HEAD:6379 --register VERIFIER_ADDR
    treeserve orchestrator --ray-address HEAD:6379 --unregister VERIFIER_ADDR
    treeserve orchestrator --ray-address HEAD:6379 --list
"""
from __future__ import annotations

import argparse
import json
import sys

from orchestrator.names import COORDINATOR, DEFAULT_NAMESPACE
from treeserve.server import add_grace_argument, count_argument, token_argument


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verifier", action="append", default=[], metavar="ADDR",
                   help="verifier replica host:port (repeat for several replicas)")
    p.add_argument("--drafter", default=None, metavar="ADDR", help="drafter host:port (none: plain decoding)")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="join this Ray cluster (default: start a private one on 127.0.0.1)")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE, help="Ray namespace of this deployment")
    p.add_argument("--host", default="127.0.0.1", help="interface of the Generation service (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=50051, help="port of the Generation service (0: pick a free one)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="target model directory with its tokenizer (needed for text prompts and text output)")
    p.add_argument("--auth-token", type=token_argument, default=None, help="require 'authorization: Bearer TOKEN' from clients")
    p.add_argument("--service-token", type=token_argument, default=None, help="bearer token for calls to the verifier and drafter")
    p.add_argument("--draft-timeout-ms", type=float, default=1000.0,
                   help="longest wait for a drafted tree before a step decodes plainly")
    p.add_argument("--replica-timeout-s", type=float, default=60.0,
                   help="fail requests whose verifier replica stays unreachable this long")
    p.add_argument("--connect-timeout-s", type=float, default=300.0,
                   help="how long a replica's engine waits for its verifier to come up when registered")
    add_limit_arguments(p)
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    add_grace_argument(p)
    admin = p.add_mutually_exclusive_group()
    admin.add_argument("--register", metavar="ADDR", help="add a verifier replica to a running deployment and exit")
    admin.add_argument("--unregister", metavar="ADDR", help="drain and remove a verifier replica, then exit")
    admin.add_argument("--list", action="store_true", help="print the deployment's replicas as JSON and exit")


def add_limit_arguments(p: argparse.ArgumentParser) -> None:
    """The Generation front's limits (`FrontLimits`), for `orchestrator` and `serve` alike."""
    p.add_argument("--default-max-new-tokens", type=count_argument(1), default=256,
                   help="max_new_tokens of a request that names none")
    p.add_argument("--max-new-tokens", type=count_argument(1), default=4096,
                   help="largest max_new_tokens a client may ask for")
    p.add_argument("--max-streams", type=count_argument(1), default=240,  # FrontLimits' default (a test keeps them one)
                   help="open Generate streams this front serves at once (each holds a server thread); more are "
                        "refused with RESOURCE_EXHAUSTED")
    p.add_argument("--max-prompt-tokens", type=count_argument(1), default=32768,  # FrontLimits' default
                   help="longest prompt, in tokens, this front takes (a text prompt: at most 16 characters per "
                        "token); longer ones are refused with INVALID_ARGUMENT before they are tokenised")


def limits_from(args: argparse.Namespace):
    from orchestrator.generation import FrontLimits

    try:
        return FrontLimits(args.default_max_new_tokens, args.max_new_tokens, args.max_streams, args.max_prompt_tokens)
    except ValueError as exc:
        raise SystemExit(f"--default-max-new-tokens: {exc}") from None


def config_from(args: argparse.Namespace):
    from orchestrator.runtime import OrchestratorConfig

    return OrchestratorConfig(
        verifiers=list(args.verifier), drafter=args.drafter, ray_address=args.ray_address, namespace=args.namespace,
        host=args.host, port=args.port, auth_token=args.auth_token, service_token=args.service_token,
        tokenizer=args.tokenizer, draft_timeout_s=args.draft_timeout_ms / 1e3, replica_timeout_s=args.replica_timeout_s,
        connect_timeout_s=args.connect_timeout_s,
        limits=limits_from(args),
        metrics_port=args.metrics_port,
        shutdown_grace_s=args.shutdown_grace_s,
    )


def _admin(args: argparse.Namespace) -> int:
    import ray

    from orchestrator.cluster import init_ray

    if args.ray_address is None:
        print("--register/--unregister/--list need --ray-address of the deployment's Ray cluster", file=sys.stderr)
        return 2
    init_ray(args.ray_address, args.namespace)
    try:
        coord = ray.get_actor(COORDINATOR, namespace=args.namespace)
    except ValueError:
        print(f"no treeserve coordinator in namespace {args.namespace!r}: start an orchestrator first", file=sys.stderr)
        return 1
    if args.register:
        print(json.dumps(ray.get(coord.register.remote(args.register))))
    elif args.unregister:
        print(json.dumps({"unregistered": ray.get(coord.unregister.remote(args.unregister))}))
    else:
        print(json.dumps(ray.get(coord.replicas.remote()), indent=2))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.register or args.unregister or args.list:
        return _admin(args)
    if not args.verifier and args.ray_address is None:
        print("give at least one --verifier (or --ray-address of a deployment whose replicas register later)",
              file=sys.stderr)
        return 2
    from orchestrator.runtime import Orchestrator, RegistrationFailed

    orch = Orchestrator(config_from(args))
    try:
        orch.start()
    except (RegistrationFailed, OSError, RuntimeError) as exc:  # a verifier, or the port (gRPC's bind error)
        orch.stop()
        print(f"treeserve orchestrator: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 1
    print(f"orchestrator listening on {args.host}:{orch.port}", flush=True)
    orch.wait()
    return 0
