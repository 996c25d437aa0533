"""What the verifier's per-node results cost after the forward: `verifier_service.results.compute`
on random logits, greedy against sampled, with and without the multi-draft walk.

    python -m bench.sampled_results [--device cuda] [--vocab 4096 32000 151936] [--calls 50]
    python -m bench.sampled_results --profile 16 --vocab 4096   # where one sampled 16-node call goes

Each case is one verified tree of N nodes (a drafter-like tree: a few children per node, draft
distributions listing each node's children and a few more tokens, the target leaning towards the
children so that walks go several levels deep). A call is timed on the host from its start to the
tokens and outcomes on the host (`compute` ends with the one device-to-host copy), median of
`--calls` after warm-up. Prints one row per case: vocabulary, nodes, sampling, ms, and the mean
length of the accepted path.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from treeserve.sampling import Sampling
from treeserve.tree import SparseDist, TokenTree
from verifier_service import results

SAMPLINGS = {
    "greedy": Sampling(),
    "T=1": Sampling(temperature=1.0, seed=7),
    "T=0.8 top-k 50": Sampling(temperature=0.8, top_k=50, seed=7),
    "T=1 top-p 0.9": Sampling(temperature=1.0, top_p=0.9, seed=7),
}


def drafter_like_tree(n: int, vocab: int, rng: random.Random, with_drafts: bool) -> TokenTree:
    """n nodes, each new node under one of the last few (1-4 children a node, 4-6 levels at 16)."""
    tokens, parents = [rng.randrange(vocab)], [-1]
    kids: list[list[int]] = [[]]
    while len(tokens) < n:
        p = rng.randrange(max(0, len(tokens) - 4), len(tokens))
        t = rng.randrange(vocab)
        if any(tokens[c] == t for c in kids[p]):
            continue
        tokens.append(t)
        parents.append(p)
        kids[p].append(len(tokens) - 1)
        kids.append([])
    if not with_drafts:
        return TokenTree(tuple(tokens), tuple(parents))
    draft = []
    for i in range(n):
        if not kids[i]:
            draft.append(None)
            continue
        listed = [tokens[c] for c in kids[i]]
        listed += [t for t in rng.sample(range(vocab), 6) if t not in listed][:4]
        w = [rng.random() + 0.2 for _ in listed]
        draft.append(SparseDist(tuple(listed), tuple(0.95 * x / sum(w) for x in w), 0.05))
    return TokenTree(tuple(tokens), tuple(parents), tuple(draft))


def leaning_logits(tree: TokenTree, vocab: int, device) -> torch.Tensor:
    """(N, V) logits whose softmax puts most mass on the node's children."""
    logits = torch.randn(tree.size, vocab, generator=torch.Generator().manual_seed(tree.size))
    for i in range(1, tree.size):
        logits[tree.parents[i], tree.tokens[i]] += 6.0
    return logits.to(device)


def time_case(tree: TokenTree, logits: torch.Tensor, s: Sampling, calls: int) -> tuple[float, float]:
    """(median ms a call, mean accepted path length)."""
    offsets = [0, tree.size]
    times, accepted = [], []
    for i in range(calls + 5):
        q = [results.NodeQuery(tree, 100 + 13 * i, s)]  # fresh positions: fresh draws
        if logits.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = results.compute(logits, offsets, q)
        t1 = time.perf_counter()
        if i >= 5:
            times.append((t1 - t0) * 1e3)
            walk = out[0].walk
            accepted.append(len(walk.accepted_nodes) if walk is not None else 1)
    return statistics.median(times), statistics.mean(accepted)


def profile(n: int, vocab: int, device: str, rng: random.Random) -> None:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    tree = drafter_like_tree(n, vocab, rng, with_drafts=n > 1)
    logits = leaning_logits(tree, vocab, device)
    s = SAMPLINGS["T=1"]
    time_case(tree, logits, s, 10)  # warm-up: compiles and caches
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if logits.is_cuda else [])
    with torch_profile(activities=activities) as prof:
        time_case(tree, logits, s, 15)
    sort = "self_cuda_time_total" if logits.is_cuda else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30))
    print(prof.key_averages().table(sort_by=sort, row_limit=15))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, nargs="+", default=[4096, 32000, 151936])
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--profile", type=int, default=0, metavar="NODES",
                    help="instead: torch.profiler over 20 sampled (T=1) calls of one NODES-node tree, first vocabulary")
    args = ap.parse_args(argv)
    rng = random.Random(0)
    if args.profile:
        profile(args.profile, args.vocab[0], args.device, rng)
        return
    print(f"{'vocab':>7} {'nodes':>5} {'sampling':>16} {'ms':>8} {'path':>5}")
    for vocab in args.vocab:
        for n in args.nodes:
            for name, s in SAMPLINGS.items():
                tree = drafter_like_tree(n, vocab, rng, with_drafts=n > 1)
                logits = leaning_logits(tree, vocab, args.device)
                ms, path = time_case(tree, logits, s, args.calls)
                print(f"{vocab:>7} {n:>5} {name:>16} {ms:>8.3f} {path:>5.2f}", flush=True)


if __name__ == "__main__":
    main()
