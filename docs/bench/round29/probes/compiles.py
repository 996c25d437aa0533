"""Which Triton kernels compile a new variant on which drafter/target call (prompt prefill at several
lengths, catch-up prefill after a history, decode)? Prints kernel name and the new cache keys."""
import importlib, pkgutil, sys, time, os
import torch
from triton.runtime.jit import JITFunction
import kernels
from drafter_service.draftlm import DraftModel

def jit_functions():
    out = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        mod = importlib.import_module(f"kernels.{info.name}")
        for name, obj in vars(mod).items():
            f = obj
            while f is not None and not isinstance(f, JITFunction):
                f = getattr(f, "fn", None)
            if isinstance(f, JITFunction):
                out[f"{info.name}.{name}"] = f
    return out

FNS = jit_functions()
def snapshot():
    snap = {}
    for n, f in FNS.items():
        keys = set()
        for dev, caches in f.device_caches.items():
            keys |= set(map(str, caches[0].keys()))
        snap[n] = keys
    return snap

path = sys.argv[1] if len(sys.argv) > 1 else "models/demo/drafter"
m = DraftModel.load(path, device="cuda")
g = torch.Generator().manual_seed(0)
tok = lambda k: torch.randint(0, 200, (k,), generator=g).tolist()
before = snapshot()
def call(label, fn):
    global before
    torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    now = snapshot()
    new = {n: sorted(now[n] - before[n]) for n in FNS if now[n] - before[n]}
    before = now
    print(f"{label}: {ms:.1f} ms, {sum(len(v) for v in new.values())} new variants", flush=True)
    for n, keys in new.items():
        for k in keys:
            print(f"    {n}: {k[:400]}")
slots = []
for L in (90, 96, 131, 266, 200, 64, 65, 17):
    call(f"open {L}", lambda: slots.append(m.open(tok(L))))
s = slots[0]
for k in (1, 2, 3, 5, 16, 17, 31, 32, 65, 127, 9, 100):
    call(f"advance {k} at {m.lm.pool.length(s)}", lambda: m.advance(s, None, tok(k)))
