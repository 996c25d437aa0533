"""`treeserve drafter`: serve the Drafter service (a draft model, or n-gram lookup without one)."""
from __future__ import annotations

import argparse
import logging

from drafter_service.limits import IDLE_TIMEOUT_S, MODEL_MAX_LEN, NGRAM_MAX_LEN
from treeserve import cores
from treeserve.errors import ServeError
from treeserve.h2grpc import server as direct_port
from treeserve.server import add_grace_argument, count_argument, number_argument, token_argument
from treeserve.tree import MAX_DRAFT_SUPPORT

log = logging.getLogger("treeserve.drafter")

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="Hugging Face checkpoint directory of the draft model")
    src.add_argument("--ngram", action="store_true", help="no model: prompt-lookup (n-gram) drafting only")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 on cuda, fp32 on cpu")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50051, help="0 picks a free port (printed on startup)")
    p.add_argument("--shape", choices=("dynamic", "static", "chain", "ngram", "fused"), default=None,
                   help="default tree shape (dynamic with a model, ngram without; every shape but ngram "
                        "needs --model)")
    p.add_argument("--static-shape", default="stree-13",
                   help="static shape table: a preset name or per-level branching like '3,2-1,2-1,3'")
    p.add_argument("--node-budget", type=count_argument(1), default=16, help="default nodes per tree, root included")
    p.add_argument("--max-depth", type=count_argument(0), default=6, help="default depth limit")
    p.add_argument("--max-nodes", type=count_argument(1), default=256, help="largest tree any request may ask for")
    p.add_argument("--no-draft-ahead", action="store_true", help="never prepare trees for predicted outcomes")
    p.add_argument("--ahead-trees", type=count_argument(0), default=4, help="outcomes prepared per tree by draft-ahead")
    p.add_argument("--ahead-fanout", type=count_argument(1), default=4,
                   help="bonus guesses for the likeliest accepted node")
    p.add_argument("--ahead-slots", type=count_argument(0), default=None,
                   help="state slots for prepared outcomes, shared by all sequences (default: max-sequences x "
                        "ahead-trees); when none is free an outcome is simply not prepared")
    p.add_argument("--support", type=count_argument(1, MAX_DRAFT_SUPPORT), default=64,
                   help="most tokens in a reported draft distribution (sampling); larger supports are truncated")
    p.add_argument("--vocab-limit", type=count_argument(0), default=0,
                   help="only draft tokens below this id (the target's vocabulary size when the draft's is padded; "
                        "0: no limit)")
    p.add_argument("--trim-vocab", default=None, metavar="FILE",
                   help="draft only the tokens listed in this file (built by `treeserve trim-vocab`; a directory "
                        "means its vocab_subset.json): the LM head shrinks to those rows")
    p.add_argument("--max-sequences", type=count_argument(1), default=64)
    p.add_argument("--max-len", type=count_argument(1), default=None,
                   help=f"longest sequence in tokens: what the draft model keeps state for (default {MODEL_MAX_LEN}), "
                        f"or with --ngram the history it searches (default {NGRAM_MAX_LEN}); longer ones are refused")
    p.add_argument("--idle-timeout-s", type=number_argument("seconds"), default=IDLE_TIMEOUT_S, metavar="S",
                   help=f"end sequences no request touched for this long (0: never; default {IDLE_TIMEOUT_S:g})")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA graphs for the draft model's steps (default: on with a CUDA device, captured at "
                        "start-up; --no-cuda-graphs runs it eagerly)")
    direct_port.add_arguments(p, "the Speculate stream")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    p.add_argument("--auth-token", type=token_argument, default=None, help="require 'authorization: Bearer TOKEN' on every call")
    cores.add_argument(p)
    add_grace_argument(p)


def build(args: argparse.Namespace):
    """The Drafter engine described by the command-line arguments."""
    import torch

    from drafter_service.ahead import AheadConfig
    from drafter_service.draftlm import DraftModel
    from drafter_service.engine import Drafter, Options
    from drafter_service.static import PRESETS, ShapeTable

    try:
        table = PRESETS.get(args.static_shape) or ShapeTable.parse(args.static_shape)
    except ValueError as exc:
        raise SystemExit(f"--static-shape {args.static_shape!r}: {exc}") from exc
    model = None
    if args.model:
        dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
        ahead_slots = 0 if args.no_draft_ahead else args.ahead_slots
        if ahead_slots is None:
            ahead_slots = args.max_sequences * args.ahead_trees
        from drafter_service.vocab import VocabFileError

        try:
            model = DraftModel.load(args.model, device=args.device, dtype=dtype,
                                    max_slots=args.max_sequences + ahead_slots,
                                    max_len=args.max_len or MODEL_MAX_LEN,
                                    vocab_limit=args.vocab_limit or None, cuda_graphs=args.cuda_graphs,
                                    fork_slots=ahead_slots, trim=args.trim_vocab)
        except VocabFileError as exc:
            raise SystemExit(f"--trim-vocab: {exc}") from None
        except ValueError as exc:  # e.g. --cuda-graphs on a CPU device
            raise SystemExit(f"drafter: {exc}") from None
    shape = args.shape or ("dynamic" if model is not None else "ngram")
    defaults = Options(shape, args.node_budget, args.max_depth, not args.no_draft_ahead)
    ahead = None if args.no_draft_ahead else AheadConfig(args.ahead_trees, args.ahead_fanout)
    try:
        return Drafter(model, defaults, max_sequences=args.max_sequences, max_nodes=args.max_nodes, ahead=ahead,
                       static_table=table, support=args.support, max_len=args.max_len or NGRAM_MAX_LEN,
                       idle_timeout_s=args.idle_timeout_s)
    except ServeError as exc:  # the defaults the options give, refused as a request's would be
        raise SystemExit(f"drafter: {exc}") from None


def run(args: argparse.Namespace) -> int:
    from drafter_service.servicer import serve
    from treeserve.server import start_metrics

    drafter = build(args)
    server = serve(drafter, f"{args.host}:{args.port}", auth_token=args.auth_token, grace_s=args.shutdown_grace_s,
                   direct_address=None if args.direct_port is None else f"{args.host}:{args.direct_port}",
                   direct_poll_s=args.direct_poll_us * 1e-6)
    start_metrics(args.metrics_port)
    log.info("drafter: %s, defaults %s", drafter.strategy, drafter.defaults)
    if drafter.model is not None:
        graphs = drafter.model.lm.graphs
        log.info("draft head: %s; CUDA graphs %s", drafter.model.head.describe(),
                 "on" if graphs is not None and graphs.capture else "off")
    try:
        with cores.CoreSpinners(args.keep_cores_awake):
            print(f"drafter listening on {args.host}:{server.port}", flush=True)
            if server.direct_port is not None:
                print(f"drafter direct port on {args.host}:{server.direct_port}", flush=True)
            server.wait()
    finally:
        drafter.close()
    return 0
