"""Commits as CUDA graph replays against eager commits, in one process: two copies of one model, one
committing through graphs (`GraphRunner.commit`) and one eagerly (the same program, launched op by
op), the same calls alternated. Per tree size: verify alone, and verify + commit of a path of up
to 4 nodes (one speculation round), host wall time to a synchronize, median after warm-up.

    python -m bench.commit_graphs --shape mamba2-2.7b      # random bf16 weights (written to a temp dir)
    python -m bench.commit_graphs --model DIR               # an existing checkpoint
"""
from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import tempfile
import time

import torch

from bench.model_runtime import balanced_tree
from bench.random_checkpoint import write_checkpoint


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="mamba2-2.7b", choices=["mamba2-2.7b", "hybrid-8b"])
    ap.add_argument("--model", default=None, help="an existing checkpoint directory instead of random weights")
    ap.add_argument("--sizes", default="4,16,64", help="tree sizes, comma-separated")
    ap.add_argument("--pairs", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    from models import HybridLM

    tmp = tempfile.TemporaryDirectory(prefix="commit-bench-")
    model = pathlib.Path(args.model) if args.model else pathlib.Path(tmp.name)
    if not args.model:
        write_checkpoint(args.shape, model, device="cuda")
    lms = {}
    for name in ("graph", "eager"):
        lm = HybridLM.from_pretrained(model, device=torch.device("cuda"), dtype=torch.bfloat16, max_slots=2, max_len=4096)
        if name == "eager":
            lm.graphs.commit = lambda items, paths: False  # GraphRunner.commit's "does not fit": eager
        lms[name] = lm
    rng = random.Random(0)
    vocab = lms["graph"].config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(128)]
    slots = {}
    for name, lm in lms.items():
        slots[name] = lm.pool.alloc()
        lm.prefill([slots[name]], [prompt])
    report = {"model": str(model) if args.model else args.shape, "gpu": torch.cuda.get_device_name(), "sizes": {}}
    warmup = 10
    for n in map(int, args.sizes.split(",")):
        tree = balanced_tree(n, rng, vocab)
        path = tree.path_to(min(n - 1, 3))
        ms = {(name, what): [] for name in lms for what in ("verify", "verify_commit")}
        for i in range(warmup + args.pairs):
            for name in (("graph", "eager") if i % 2 else ("eager", "graph")):
                lm, s = lms[name], slots[name]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                lm.verify([s], [tree])
                torch.cuda.synchronize()
                t1 = time.perf_counter()
                res = lm.verify([s], [tree])
                lm.commit([(res.pending[0], path)])
                torch.cuda.synchronize()
                t2 = time.perf_counter()
                if i >= warmup:
                    ms[(name, "verify")].append((t1 - t0) * 1e3)
                    ms[(name, "verify_commit")].append((t2 - t1) * 1e3)
                if lm.pool.length(s) > 3900:  # start the sequence over before the slot fills
                    lm.pool.free(s)
                    slots[name] = lm.pool.alloc()
                    lm.prefill([slots[name]], [prompt])
        row = {f"{name}_{what}_ms": statistics.median(v) for (name, what), v in ms.items()}
        report["sizes"][n] = row
        print(f"{n:4d} nodes  verify: graph {row['graph_verify_ms']:.3f} eager {row['eager_verify_ms']:.3f}   "
              f"verify+commit: graph {row['graph_verify_commit_ms']:.3f} eager {row['eager_verify_commit_ms']:.3f} ms",
              flush=True)
    for lm in lms.values():
        assert not lm.graphs.failures, lm.graphs.failures
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
