"""On the CPU (interpreted Triton), record each launch's specialisation key of the attention kernels
during warm_up_calls and during the GPU warm-up test's calls; print keys the test sees that the
warm-up did not.

    PYTHONPATH=$PWD python docs/bench/round30/probes/speckeys.py [target|drafter]   (from the repository root)
"""
import os, inspect, sys, pathlib
os.environ.update(TRITON_INTERPRET="1")
import torch
from tests.kernels import interpret_compat; interpret_compat.install()
from kernels import tree_attention as ta, conv_tree, ssd_prefill, ssm_commit, few_rows_linear, norms, proj_conv, ssd_tree, tree_struct, mamba_decode
from models import HybridLM
from kernels import ops
import importlib
def implementation(name, device):
    module = importlib.import_module(ops._HOME[name])
    return getattr(module, name if module is ta else f"{name}_ref")
ops.implementation = implementation
from treeserve.tree import TokenTree

MODS = [ta]
seen = {"phase": "warm", "warm": set(), "test": set()}

def cls(v):
    if isinstance(v, bool): return v
    if isinstance(v, int): return "1" if v == 1 else ("D" if v % 16 == 0 else "")
    if isinstance(v, float): return "f"
    if torch.is_tensor(v): return str(v.dtype)
    return repr(v)

class Rec:
    def __init__(self, name, k):
        self.name, self.k = name, k
        self.names = list(inspect.signature(k.fn).parameters)
        self.const = {n for n, p in inspect.signature(k.fn).parameters.items() if "constexpr" in str(p.annotation)}
        self.dns = set(getattr(k, "do_not_specialize", ()) or ())
    def __getitem__(self, grid):
        def launch(*args, **kw):
            key = []
            for n, v in list(zip(self.names, args)) + sorted(kw.items()):
                if n in self.dns or n in ("num_warps", "num_stages", "launch_pdl"): continue
                key.append((n, v if n in self.const else cls(v)))
            seen[seen["phase"]].add((self.name, tuple(key)))
            return self.k[grid](*args, **kw)
        return launch
    def __getattr__(self, a): return getattr(self.k, a)
    def __call__(self, *a, **k): return self.k(*a, **k)

for m in MODS:
    for n, v in list(vars(m).items()):
        if type(v).__name__ in ("InterpretedFunction", "JITFunction") and n.endswith("_kernel"):
            # dns names may be stored as indices
            r = Rec(f"{m.__name__}.{n}", v)
            d = getattr(v, "do_not_specialize", None) or getattr(getattr(v, "fn", None), "do_not_specialize", None) or ()
            import re
            src = inspect.getsource(m)
            mm = re.search(r"@triton.jit\(do_not_specialize=\[([^\]]*)\]\)[^\n]*\n(?:#.*\n)*def " + n + r"\(", src)
            r.dns = set(re.findall(r'"(\w+)"', mm.group(1))) if mm else set()
            setattr(m, n, r)

DEMO = pathlib.Path("models/demo")
model = sys.argv[1] if len(sys.argv) > 1 else "target"
lm = HybridLM.from_pretrained(DEMO / model, device="cpu", dtype=torch.float32, max_slots=4, max_len=2048)
lm.warm_up_calls()
seen["phase"] = "test"
gen = torch.Generator().manual_seed(1)
def tokens(n): return torch.randint(0, lm.config.vocab_size, (n,), generator=gen).tolist()
for first in (1, 3, 17, 32, 63, 64, 65, 100, 131, 257):
    slot = lm.pool.alloc()
    lm.prefill([slot], [tokens(first)])
    for n in (1, 2, 3, 5, 7, 9, 15, 16, 17, 24, 31, 33, 48, 64, 65, 70):
        lm.prefill([slot], [tokens(n)])
    lm.decode([slot], [5])
    lm.pool.free(slot)
slot = lm.pool.alloc()
lm.prefill([slot], [tokens(30)])
for k in (2, 3, 5, 9, 13, 16):
    res = lm.verify([slot], [TokenTree.chain(tokens(k))])
    lm.commit([(res.pending[0], list(range(k)))])
lm.pool.free(slot)
slots = [lm.pool.alloc() for _ in range(3)]
lm.prefill(slots, [tokens(5), tokens(19), tokens(40)])
new = seen["test"] - seen["warm"]
for name, key in sorted(new):
    close = [k for n, k in seen["warm"] if n == name]
    diffs = [[(a, b[1]) for a, b in zip(c, key) if a != b] for c in close]
    print(name, "new; nearest warm diffs:", min(diffs, key=len) if diffs else "no warm launch")
print("new keys:", len(new), "warm keys:", len(seen["warm"]))
for name, key in sorted(new):
    if "attn" in name:
        print("NEW", [kv for kv in key if not kv[0].startswith("stride")])
        for n, k in sorted(seen["warm"]):
            if n == name: print("  WARM", [kv for kv in k if not kv[0].startswith("stride")])
