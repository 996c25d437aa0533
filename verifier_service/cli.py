"""`treeserve verifier`: serve the target model's Verifier service."""
from __future__ import annotations

import argparse
import logging
import pathlib

from treeserve import cores
from treeserve.h2grpc import server as direct_port
from treeserve.h2grpc.server import POLL_SECONDS
from treeserve.server import GRACE_SECONDS, add_grace_argument, number_argument, token_argument
from verifier_service.limits import MAX_BATCH_WINDOW_MS, Limits

log = logging.getLogger("treeserve.verifier")

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# --cuda-graphs -> HybridLM.from_pretrained(cuda_graphs=...): None lets the runtime decide (CUDA only)
GRAPH_MODES = {"lazy": None, "startup": None, "off": False}


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Limits()
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory of the target model")
    p.add_argument("--device", default=None, help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="weights/activations (default bf16 on cuda, fp32 on cpu)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50052, help="0 picks a free port (printed on startup)")
    p.add_argument("--max-sequences", type=int, default=d.max_sequences, help="live sequences = state slots")
    p.add_argument("--max-tree-nodes", type=int, default=d.max_tree_nodes, help="nodes per tree")
    p.add_argument("--max-sequence-length", type=int, default=d.max_sequence_length, help="tokens per sequence")
    p.add_argument("--batch-window-ms", type=number_argument("milliseconds", MAX_BATCH_WINDOW_MS),
                   default=d.batch_window_ms, metavar="MS",
                   help=f"how long a Verify item waits for company (at most {MAX_BATCH_WINDOW_MS:g})")
    p.add_argument("--max-batch", type=int, default=d.max_batch, help="sequences per forward")
    p.add_argument("--max-batch-nodes", type=int, default=d.max_batch_nodes, help="tree nodes per forward")
    p.add_argument("--idle-timeout-s", type=number_argument("seconds"), default=d.idle_timeout_s, metavar="S",
                   help="release sequences idle this long (0: never)")
    direct_port.add_arguments(p, "Verify and VerifyStream")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus /metrics port (0: off)")
    p.add_argument("--auth-token", type=token_argument, default=None, help="require 'authorization: Bearer TOKEN' on every call")
    p.add_argument("--cuda-graphs", choices=GRAPH_MODES, default="lazy",
                   help="lazy: capture each shape bucket on first use; startup: capture every bucket before "
                        "serving; off: eager forwards")
    cores.add_argument(p)
    add_grace_argument(p)


def limits_from(args: argparse.Namespace) -> Limits:
    return Limits(
        max_sequences=args.max_sequences,
        max_tree_nodes=args.max_tree_nodes,
        max_sequence_length=args.max_sequence_length,
        batch_window_ms=args.batch_window_ms,
        max_batch=args.max_batch,
        max_batch_nodes=max(args.max_batch_nodes, args.max_tree_nodes),
        idle_timeout_s=args.idle_timeout_s,
    ).validate()


def start(
    model: str,
    *,
    device: str | None = None,
    dtype: str | None = None,
    limits: Limits = Limits(),
    address: str = "127.0.0.1:0",
    auth_token: str | None = None,
    cuda_graphs: str = "lazy",
    grace_s: float = GRACE_SECONDS,
    direct_address: str | None = None,
    direct_poll_s: float = POLL_SECONDS,
):
    """Load the checkpoint and start serving; returns the running VerifierServer (`.port`,
    `.stop()`). `device` None: cuda when available, else cpu; `dtype` None: bf16 on cuda, fp32 on
    cpu; `grace_s`: how long a shutdown lets calls in flight finish; `direct_address`: where the
    direct port listens (None: no direct port), `direct_poll_s` how long its connections poll for
    the next request. Usable by anything that wants
    a verifier in its own process."""
    import torch

    from models import HybridLM
    from verifier_service.engine import prepare
    from verifier_service.servicer import ModelInfo, VerifierServer, eos_ids

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = dtype or ("bf16" if dev.type == "cuda" else "fp32")
    lm = HybridLM.from_pretrained(
        model, device=dev, dtype=getattr(torch, DTYPES[dtype]), max_slots=limits.max_sequences,
        max_len=limits.max_sequence_length, cuda_graphs=GRAPH_MODES[cuda_graphs],
    )
    prepare(lm, capture_graphs=cuda_graphs == "startup")  # nothing compiles at a request
    info = ModelInfo(name=pathlib.Path(model).resolve().name, device=str(dev), eos_token_ids=eos_ids(lm))
    server = VerifierServer(lm, limits, address, info, auth_token=auth_token, grace_s=grace_s,
                            direct_address=direct_address, direct_poll_s=direct_poll_s)
    log.info("%s on %s (%s), %s", info.name, dev, dtype, limits)
    return server


def run(args: argparse.Namespace) -> int:
    from treeserve.server import start_metrics

    try:
        server = start(
            args.model, device=args.device, dtype=args.dtype, limits=limits_from(args),
            address=f"{args.host}:{args.port}", auth_token=args.auth_token, cuda_graphs=args.cuda_graphs,
            grace_s=args.shutdown_grace_s,
            direct_address=None if args.direct_port is None else f"{args.host}:{args.direct_port}",
            direct_poll_s=args.direct_poll_us * 1e-6,
        )
    except ValueError as exc:  # a checkpoint that does not load (CheckpointError), CUDA graphs on a CPU...
        raise SystemExit(f"verifier: {exc}") from None
    start_metrics(args.metrics_port)
    # after loading (the spinners would slow it down a little), before the first client can call
    with cores.CoreSpinners(args.keep_cores_awake):
        print(f"verifier listening on {args.host}:{server.port}", flush=True)
        if server.direct_port is not None:
            print(f"verifier direct port on {args.host}:{server.direct_port}", flush=True)
        server.wait()
    return 0
