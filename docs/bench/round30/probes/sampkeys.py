"""CPU (interpreted): specialisation keys (int classes, pointer alignment, constexprs) of the sampling
kernels during results.warm_up and during the GPU test's queries; prints keys not seen in the warm-up.

    V=4099 PYTHONPATH=$PWD python docs/bench/round30/probes/sampkeys.py   (from the repository root)
"""
import os, inspect, random
os.environ.update(TRITON_INTERPRET="1", TREESERVE_KERNELS="triton")
import torch
from tests.kernels import interpret_compat; interpret_compat.install()
from kernels import gumbel_argmax as ga, node_acceptance as na
from verifier_service import results
from treeserve.sampling import Sampling
from tests.verifier.trees import random_tree, with_drafts
seen = {"phase": "warm", "warm": set(), "test": set()}
def cls(v):
    if isinstance(v, bool): return v
    if isinstance(v, int): return "1" if v == 1 else ("D" if v % 16 == 0 else "")
    if isinstance(v, float): return "f"
    if torch.is_tensor(v): return (str(v.dtype), "D" if v.data_ptr() % 16 == 0 else "")
    return repr(v)
class Rec:
    def __init__(self, name, k, dns):
        self.name, self.k, self.dns = name, k, dns
        ps = inspect.signature(k.fn).parameters
        self.names = list(ps); self.const = {n for n, p in ps.items() if "constexpr" in str(p.annotation)}
    def __getitem__(self, grid):
        def launch(*args, **kw):
            key = tuple((n, v if n in self.const else cls(v)) for n, v in list(zip(self.names, args)) + sorted(kw.items())
                        if n not in self.dns and n in self.names)
            seen[seen["phase"]].add((self.name, key))
            return self.k[grid](*args, **kw)
        return launch
ga._gumbel_max_kernel = Rec("gumbel", ga._gumbel_max_kernel, {"key", "floor_ptr", "pos_ptr"})
na._accept_nodes_kernel = Rec("accept", na._accept_nodes_kernel, {"accept_key", "M", "child_ptr", "pos_ptr"})
vocab = int(os.environ.get("V", "4096"))
results.warm_up(vocab, "cpu")
seen["phase"] = "test"
rng = random.Random(3)
settings = [Sampling(temperature=0.6, seed=1), Sampling(temperature=1.0, top_k=40, seed=2),
            Sampling(temperature=1.3, top_p=0.8, seed=3), Sampling(temperature=0.9, top_k=7, top_p=0.95, seed=4)]
for batch in range(6):
    queries = []
    for i in range(1 + batch % 3):
        tree = random_tree(rng, rng.randrange(vocab), vocab, rng.choice([1, 2, 5, 9, 16, 23, 64]))
        if rng.random() < 0.7:
            tree = with_drafts(rng, tree, vocab)
        queries.append(results.NodeQuery(tree, rng.randrange(1, 900), rng.choice(settings), rng.choice([0, 3])))
    offsets = [0]
    for q in queries: offsets.append(offsets[-1] + q.tree.size)
    results.compute(torch.randn(offsets[-1], vocab) * 3, offsets, queries)
for name, key in sorted(seen["test"] - seen["warm"]):
    diffs = [[(a[0], a[1], b[1]) for a, b in zip(w, key) if a != b] for n, w in seen["warm"] if n == name]
    print(name, "new; nearest warm diff (arg, warm, new):", min(diffs, key=len))
