"""`treeserve generate "prompt"`: stream a completion from a running server to the terminal, then
report the decode rate and the mean number of tokens per target forward pass."""
from __future__ import annotations

import argparse
import os
import sys

import grpc

from orchestrator.client import MODES, SHAPES, GenerationClient, request
from treeserve.server import token_argument
from treeserve.v1 import treeserve_pb2 as pb

AUTH_TOKEN_ENV = "TREESERVE_AUTH_TOKEN"

# the finish reasons of a whole completion
COMPLETE = (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS, pb.FINISH_REASON_STOP)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", default=None, help="prompt text (or --tokens)")
    p.add_argument("--tokens", type=token_ids, default=None, metavar="IDS",
                   help="prompt as space-separated token ids instead of text")
    p.add_argument("--address", default="127.0.0.1:50051", help="Generation service host:port")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="0: the server picks one")
    p.add_argument("--speculation", choices=sorted(MODES), default="auto",
                   help="auto: adaptive tree speculation (server default)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="default", help="tree shape for --speculation tree")
    p.add_argument("--node-budget", type=int, default=0, help="nodes per tree, root included (0: default)")
    p.add_argument("--max-depth", type=int, default=0)
    p.add_argument("--draft-ahead", action="store_true", help="let the drafter prepare trees for likely outcomes")
    p.add_argument("--adaptive", action="store_true", help="adaptive budget with an explicit --speculation mode")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    # a client's only: the servers started beside it (`serve`'s children) must not pick it up
    p.add_argument("--auth-token", type=token_argument, default=None, metavar="TOKEN",
                   help=f"send 'authorization: Bearer TOKEN' (default: ${AUTH_TOKEN_ENV}; a flag shows in `ps`)")
    p.add_argument("--timeout", type=float, default=600.0, help="deadline in seconds")


def token_ids(text: str) -> list[int]:
    """An argparse type: space-separated token ids (whole numbers >= 0)."""
    try:
        ids = [int(t) for t in text.split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be space-separated token ids, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"must be one or more token ids >= 0, got {text!r}")
    return ids


def auth_token(args: argparse.Namespace) -> str | None:
    """--auth-token, else $TREESERVE_AUTH_TOKEN (refused like a bad flag: ArgumentTypeError), else
    None."""
    if args.auth_token is not None:
        return args.auth_token
    env = os.environ.get(AUTH_TOKEN_ENV)
    return token_argument(env) if env else None


def run(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.tokens is None):
        print("treeserve generate: give a prompt or --tokens", file=sys.stderr)
        return 2
    try:
        token = auth_token(args)
    except argparse.ArgumentTypeError as exc:  # named as the variable: no flag was given
        print(f"treeserve generate: ${AUTH_TOKEN_ENV} {exc}", file=sys.stderr)
        return 2
    prompt = args.prompt if args.tokens is None else args.tokens
    req = request(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed, speculation=args.speculation, shape=args.shape,
                  node_budget=args.node_budget, max_depth=args.max_depth, draft_ahead=args.draft_ahead,
                  adaptive=args.adaptive, stop=args.stop)
    text_mode = args.tokens is None

    def show(msg):
        if text_mode:
            sys.stdout.write(msg.text)
        elif msg.token_ids:
            sys.stdout.write(" ".join(map(str, msg.token_ids)) + " ")
        sys.stdout.flush()

    try:
        with GenerationClient(args.address, token) as client:
            res = client.generate(req, timeout=args.timeout, on_message=show)
    except grpc.RpcError as exc:
        print(f"\ntreeserve generate: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(flush=True)
    print(f"[{res.generated_tokens} tokens, {res.tokens_per_s:.1f} tokens/s, mean accepted "
          f"{res.mean_accepted:.2f} tokens per target forward, finish: {res.finish_name}]", file=sys.stderr)
    # cancelled (by a Cancel from elsewhere) or no end at all: the completion is not whole
    return 0 if res.finish_reason in COMPLETE else 1
