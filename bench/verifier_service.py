"""Verifier service benchmark: verified tree nodes/s and step latency against concurrent sequences,
and what gRPC + batching add on top of the model's own work.

    python -m bench.verifier_service --shape mamba2-2.7b --out verifier.json
    python -m bench.verifier_service --model DIR --out verifier.json        # an existing checkpoint

Without --model, a random-weight bf16 checkpoint of the shape is written to a temporary directory
(config.json + one safetensors file; no tokenizer). The verifier runs as a separate process
(`treeserve verifier`, CUDA graphs as the runtime decides), the load generator in this one.

Three ways to load it, each with 1, 4, 16 and 64 sequences and 16-node trees:
  clients   one thread per sequence, each sending its own Verify call per step (the server's
            batching window packs them into shared forwards);
  batched   one unary Verify call per step carrying every sequence;
  stream    the batched loop over one open VerifyStream: one request/response message pair per
            step (what the orchestrator's engine loop sends), so batched vs stream is what the
            stream saves per round trip;
  direct    the stream loop on the verifier's direct port (`--direct-port`, treeserve.h2grpc), the
            client a DirectStreamSession: gRPC on sockets at both ends, no grpcio threads.
Every step carries the piggy-backed commit of the previous tree (a random root path of at most 4
nodes), so state moves as in real decoding.

Per step we record the call's wall time (request prebuilt, so only the call, or the stream's
message pair, is timed) and the server's `forward_ms` (commits + forward + per-node results,
measured on the model thread after the device has finished). overhead = wall - forward_ms is
everything gRPC, the queue handoff and the batching window add (in `clients` mode with several
sequences it also holds the time a call waits behind forwards it did not ride in). Target: median
overhead <= 10% of the step at one sequence. Medians after warm-up.

Where the overhead goes: the server reports each Verify call's (or stream message's) time by
stage in its metrics (`treeserve_verifier_call_ms{stage}`: decode, queue, forward, engine,
handback, encode, total; see verifier_service/metrics.py). The bench reads them before and after
each row and prints their means per call, with grpc = mean call wall time - mean server handler
time (both ends of gRPC, including the client's own encoding and decoding), and the share of calls
that ran the model on their own RPC thread (inline).

CPU smoke run (the tiny shape, no GPU):
    python -m bench.verifier_service --shape mamba2-tiny --device cpu --concurrency 1 --out v.json
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from bench.random_checkpoint import write_checkpoint
from verifier_service.metrics import CALL_STAGES

MODES = ("clients", "batched", "stream", "direct")
TREE_NODES = 16
PROMPT = 128
MAX_COMMIT = 4  # nodes per committed path


# ---- the server process -----------------------------------------------------------------------
class Server:
    def __init__(self, model: pathlib.Path, device: str, dtype: str, max_sequences: int, max_len: int, log_path: str,
                 extra: list[str]):
        from orchestrator.procs import free_port

        cmd = [
            sys.executable, "-m", "treeserve.cli", "verifier", "--model", str(model), "--device", device,
            "--dtype", dtype, "--port", "0", "--max-sequences", str(max_sequences), "--max-tree-nodes",
            str(TREE_NODES), "--max-sequence-length", str(max_len), "--max-batch", str(max_sequences),
            "--idle-timeout-s", "0", "--metrics-port", str(free_port()), "--direct-port", "0", *extra,
        ]
        port = cmd[len(cmd) - cmd[::-1].index("--metrics-port")]  # the value after the last one given (it wins)
        self.metrics_url = f"http://127.0.0.1:{port}/metrics"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, text=True)
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(1200)
        if not line or not line[0].startswith("verifier listening on "):
            self.stop()
            raise SystemExit(f"verifier did not start: {line!r}\n{open(log_path).read()[-4000:]}")
        self.address = line[0].split()[-1]
        direct = self.proc.stdout.readline()
        self.direct_address = direct.split()[-1] if direct.startswith("verifier direct port on ") else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._log.close()


# ---- the server's own time split ----------------------------------------------------------------
STAGES = CALL_STAGES[:-1]  # every stage but "total"


def call_totals(metrics_url: str) -> dict[str, float]:
    """Running totals from the verifier's metrics: '<stage>_sum' / '<stage>_count' (ms, calls) for
    every stage of `treeserve_verifier_call_ms`, and 'inline' (calls that ran the model inline).
    Empty when the server serves no metrics (e.g. '--metrics-port 0' in --server-args)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name == "treeserve_verifier_call_ms":
            for smp in fam.samples:
                if smp.name.endswith(("_sum", "_count")):
                    out[f"{smp.labels['stage']}_{smp.name.rsplit('_', 1)[1]}"] = smp.value
        elif fam.name == "treeserve_verifier_inline_calls":
            out["inline"] = sum(smp.value for smp in fam.samples if smp.name.endswith("_total"))
    return out


def call_split(before: dict[str, float], after: dict[str, float], wall_mean_ms: float) -> dict[str, float]:
    """Mean ms per call by stage between two `call_totals` readings, plus grpc (what the client saw
    beyond the server's handler) and the inline share of calls."""
    calls = after.get("total_count", 0.0) - before.get("total_count", 0.0)
    if calls <= 0:
        return {}

    def mean(stage: str) -> float:
        return (after.get(f"{stage}_sum", 0.0) - before.get(f"{stage}_sum", 0.0)) / calls

    server = mean("total")
    split = {"grpc": wall_mean_ms - server, **{st: mean(st) for st in STAGES}, "server": server}
    split["inline_share"] = (after.get("inline", 0.0) - before.get("inline", 0.0)) / calls
    return split


# ---- load generation --------------------------------------------------------------------------
def random_tree(rng: random.Random, root: int, vocab: int):
    """16 nodes, parents among the last few (bushy, depth about a third of the size)."""
    from treeserve.tree import TokenTree

    parents = [-1] + [rng.randrange(max(0, i - 3), i) for i in range(1, TREE_NODES)]
    tokens = [root]
    used = set()
    for i in range(1, TREE_NODES):
        t = rng.randrange(vocab)
        while (parents[i], t) in used:
            t = rng.randrange(vocab)
        used.add((parents[i], t))
        tokens.append(t)
    return TokenTree(tuple(tokens), tuple(parents))


class Sequence:
    """One sequence's step loop state: builds the next request item and consumes its result."""

    def __init__(self, sid: str, rng: random.Random, vocab: int, length: int, root: int):
        self.sid, self.rng, self.vocab = sid, rng, vocab
        self.length, self.root = length, root
        self.commit = None
        self.tree = None

    def item(self):
        from treeserve.tree import tree_to_proto
        from treeserve.v1 import treeserve_pb2 as pb

        self.tree = random_tree(self.rng, self.root, self.vocab)
        msg = pb.VerifyItem(sequence_id=self.sid, committed_length=self.length, tree=tree_to_proto(self.tree))
        if self.commit is not None:
            msg.commit.CopyFrom(self.commit)
        return msg

    def advance(self, result) -> None:
        from treeserve.v1 import treeserve_pb2 as pb

        if result.HasField("error"):
            raise RuntimeError(f"{self.sid}: {result.error.message}")
        depth = self.tree.depths()
        node = self.rng.choice([i for i in range(self.tree.size) if depth[i] < MAX_COMMIT])
        path = self.tree.path_to(node)
        self.commit = pb.Commit(committed_length=self.length, accepted_nodes=path)
        self.length += len(path)
        self.root = int(result.target_tokens[node])


def prefill_all(client, n: int, vocab: int, tag: str, seed: int) -> list[Sequence]:
    seqs = []
    for k in range(n):
        rng = random.Random(seed * 1000 + k)
        sid = f"{tag}-{k}"
        L, root = client.prefill(sid, [rng.randrange(vocab) for _ in range(PROMPT)])
        seqs.append(Sequence(sid, rng, vocab, L, root))
    return seqs


def run_clients(address: str, seqs: list[Sequence], warmup: int, steps: int, metrics_url: str) -> dict:
    """One thread and one channel per sequence; every thread times its own calls."""
    from treeserve.v1 import treeserve_pb2 as pb
    from verifier_service.client import VerifierClient

    n = len(seqs)
    totals: list[dict[str, float]] = []  # server totals as each phase starts (the last: measuring)
    gate = threading.Barrier(n, action=lambda: totals.append(call_totals(metrics_url)))
    samples: list[list[tuple[float, float, int]]] = [[] for _ in range(n)]
    spans: list[tuple[float, float]] = [(0.0, 0.0)] * n
    errors: list[BaseException] = []

    def loop(k: int) -> None:
        try:
            with VerifierClient(address, timeout=600) as c:
                seq = seqs[k]
                for phase, count in (("warm", warmup), ("measure", steps)):
                    gate.wait(600)
                    t_start = time.perf_counter()
                    for _ in range(count):
                        req = pb.VerifyRequest(items=[seq.item()])
                        t = time.perf_counter()
                        resp = c.verify_raw(req)
                        wall = (time.perf_counter() - t) * 1e3
                        seq.advance(resp.results[0])
                        if phase == "measure":
                            samples[k].append((wall, resp.forward_ms, resp.batch_sequences))
                    spans[k] = (t_start, time.perf_counter())
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)
            gate.abort()

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    elapsed = max(s[1] for s in spans) - min(s[0] for s in spans)
    flat = [x for s in samples for x in s]
    return summarise(flat, n * steps * TREE_NODES / elapsed, totals[-1], call_totals(metrics_url))


def run_batched(verify, seqs: list[Sequence], warmup: int, steps: int, metrics_url: str) -> dict:
    """One request per step with every sequence in it; `verify(request) -> response` is a unary
    Verify call (`batched`) or one message pair on an open VerifyStream (`stream`)."""
    from treeserve.v1 import treeserve_pb2 as pb

    samples = []
    t_start = 0.0
    before: dict[str, float] = {}
    for i in range(warmup + steps):
        if i == warmup:
            before = call_totals(metrics_url)
            t_start = time.perf_counter()
        req = pb.VerifyRequest(items=[s.item() for s in seqs])
        t = time.perf_counter()
        resp = verify(req)
        wall = (time.perf_counter() - t) * 1e3
        for s, r in zip(seqs, resp.results):
            s.advance(r)
        if i >= warmup:
            samples.append((wall, resp.forward_ms, resp.batch_sequences))
    elapsed = time.perf_counter() - t_start
    return summarise(samples, len(seqs) * steps * TREE_NODES / elapsed, before, call_totals(metrics_url))


def summarise(samples: list[tuple[float, float, int]], nodes_per_s: float, before: dict[str, float],
              after: dict[str, float]) -> dict:
    """Medians of the calls (wall, the server's forward_ms, sequences per forward), and the
    server's stage split (means) between the `before` and `after` metric readings."""
    wall = [s[0] for s in samples]
    fwd = [s[1] for s in samples]
    over = [s[0] - s[1] for s in samples]
    step = statistics.median(wall)
    mean = statistics.fmean(wall)
    return {
        "nodes_per_s": nodes_per_s,
        "step_ms_median": step,
        "step_ms_mean": mean,
        "step_ms_p90": sorted(wall)[int(0.9 * (len(wall) - 1))],
        "forward_ms_median": statistics.median(fwd),
        "overhead_ms_median": statistics.median(over),
        "overhead_frac": statistics.median(over) / step,
        "batch_sequences_median": statistics.median(s[2] for s in samples),
        "batch_sequences_max": max(s[2] for s in samples),
        "samples": len(samples),
        "split_ms_mean": call_split(before, after, mean),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="mamba2-2.7b", choices=["mamba2-2.7b", "hybrid-8b", "mamba2-tiny"])
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers (the report says so)")
    ap.add_argument("--model", default=None, help="an existing checkpoint directory instead of random weights")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="bf16 on cuda, fp32 on cpu by default")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--server-args", default="", help="more `treeserve verifier` options, e.g. '--cuda-graphs off'")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    levels = [int(x) for x in args.concurrency.split(",")]
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown mode(s) {', '.join(unknown)}; choose from {', '.join(MODES)}")
    dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    t0 = time.time()
    tmp = tempfile.TemporaryDirectory(prefix="verifier-bench-")
    model = pathlib.Path(args.model) if args.model else pathlib.Path(tmp.name) / "model"
    if not args.model:
        model.mkdir()
        write_checkpoint(args.shape, model, layers=args.layers, device=args.device)
    report = {
        "shape": args.shape if not args.model else None,
        "model": str(model) if args.model else None,
        "layers": args.layers or "all",
        "device": args.device,
        "dtype": dtype,
        "tree_nodes": TREE_NODES,
        "prompt": PROMPT,
        "server_args": args.server_args,
        "checkpoint_s": time.time() - t0,
    }
    try:
        import torch

        if args.device.startswith("cuda"):
            report["gpu"] = torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 - informational only
        pass
    max_seq = max(levels)
    max_len = PROMPT + (args.warmup + args.steps + 2) * MAX_COMMIT * len(modes) + 2 * TREE_NODES
    t = time.time()
    server = Server(model, args.device, dtype, max_seq, max_len, os.path.join(tmp.name, "verifier.log"),
                    args.server_args.split())
    report["server_start_s"] = time.time() - t
    rows = []
    try:
        from verifier_service.client import VerifierClient

        with VerifierClient(server.address, timeout=600) as client:
            vocab = client.stats().vocab_size
            for mode in modes:
                for n in levels:
                    seqs = prefill_all(client, n, vocab, f"{mode}{n}", seed=n)
                    if mode == "clients":
                        r = run_clients(server.address, seqs, args.warmup, args.steps, server.metrics_url)
                    elif mode == "stream":
                        with client.verify_stream() as stream:
                            r = run_batched(stream.send, seqs, args.warmup, args.steps, server.metrics_url)
                    elif mode == "direct":
                        with client.verify_stream_direct(server.direct_address) as stream:
                            r = run_batched(stream.send, seqs, args.warmup, args.steps, server.metrics_url)
                    else:
                        r = run_batched(client.verify_raw, seqs, args.warmup, args.steps, server.metrics_url)
                    for s in seqs:
                        client.release(s.sid)
                    r.update(mode=mode, sequences=n)
                    rows.append(r)
                    print(json.dumps(r), flush=True)
            report["stats"] = {
                k: getattr(client.stats(), k) for k in ("forward_passes", "verified_nodes", "mean_forward_ms")
            }
    finally:
        server.stop()
        if os.path.exists(server.log_path):
            report["server_log_tail"] = open(server.log_path).read()[-2000:]
    report["results"] = rows
    solo = [r for r in rows if r["sequences"] == 1]
    if solo:
        report["overhead_frac_batch1"] = min(r["overhead_frac"] for r in solo)
        report["overhead_target_met"] = report["overhead_frac_batch1"] <= 0.10
    report["total_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{'mode':8s} {'seqs':>4s} {'nodes/s':>10s} {'step ms':>8s} {'p90 ms':>8s} {'fwd ms':>8s} "
          f"{'overhead ms':>11s} {'ovh %':>6s} {'batch':>5s}")
    for r in rows:
        print(f"{r['mode']:8s} {r['sequences']:4d} {r['nodes_per_s']:10.0f} {r['step_ms_median']:8.2f} "
              f"{r['step_ms_p90']:8.2f} {r['forward_ms_median']:8.2f} {r['overhead_ms_median']:11.3f} "
              f"{100 * r['overhead_frac']:5.1f}% {r['batch_sequences_median']:5.0f}")
    print(f"\nwhere a call's time goes (means, ms; grpc = call wall - server handler):\n{'mode':8s} {'seqs':>4s} "
          f"{'call':>7s} {'grpc':>7s} " + " ".join(f"{st:>8s}" for st in STAGES) + f" {'inline':>6s}")
    for r in rows:
        sp = r["split_ms_mean"]
        if sp:
            print(f"{r['mode']:8s} {r['sequences']:4d} {r['step_ms_mean']:7.2f} {sp['grpc']:7.3f} "
                  + " ".join(f"{sp[st]:8.3f}" for st in STAGES) + f" {100 * sp['inline_share']:5.0f}%")
    if solo:
        print(f"overhead at one sequence: {100 * report['overhead_frac_batch1']:.1f}% of the step "
              f"(target <= 10%: {'met' if report['overhead_target_met'] else 'NOT met'})")


if __name__ == "__main__":
    main()
