"""Why does a prefill at a new length cost more than a repeat? Demo target bf16 (or a given model).
Times first and repeat calls at new lengths, the allocator's cudaMalloc count per call, and a
profiler's per-op CPU and CUDA time for one first call and its repeat."""
import json, os, pathlib, sys, time
import torch

model = sys.argv[1] if len(sys.argv) > 1 else "models/demo/target"
out = pathlib.Path(os.environ.get("OUT", "/tmp")) / (sys.argv[2] if len(sys.argv) > 2 else "prefill_first.json")
sys.path.insert(0, str(pathlib.Path(__file__).parent)); from shapes import load
lm = load(model, max_slots=4, max_len=4096)
t0 = time.perf_counter(); lm.warm_up(); torch.cuda.synchronize()
print(f"warm_up {time.perf_counter()-t0:.1f} s", flush=True)
gen = torch.Generator().manual_seed(0)
def toks(n): return torch.randint(0, lm.config.vocab_size, (n,), generator=gen).tolist()
def stats(): 
    s = torch.cuda.memory_stats(); return s.get("segment.all.allocated", 0), s.get("num_alloc_retries", 0)
def call(n):
    slot = lm.pool.alloc(); p = toks(n)
    seg0 = stats(); torch.cuda.synchronize(); t = time.perf_counter()
    lm.prefill([slot], [p]); torch.cuda.synchronize()
    ms = (time.perf_counter() - t) * 1e3; seg1 = stats()
    lm.pool.free(slot)
    return round(ms, 3), seg1[0] - seg0[0]
rows = []
lengths = [90, 96, 131, 266, 200, 64, 65, 17, 300, 301, 302, 150, 151]
for n in lengths:
    a = call(n); b = call(n); c = call(n)
    rows.append({"len": n, "first_ms": a[0], "first_mallocs": a[1], "second_ms": b[0], "third_ms": c[0]})
    print(rows[-1], flush=True)
# which part: profile a first call and its repeat
from torch.profiler import profile, ProfilerActivity
tables = {}
for n in (333, 333):
    key = "first" if "first" not in tables else "repeat"
    slot = lm.pool.alloc(); p = toks(n)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        lm.prefill([slot], [p]); torch.cuda.synchronize()
    lm.pool.free(slot)
    tables[key] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    print(key, tables[key], flush=True)
# cuBLAS alone: a new M on each weight shape
res = {}
for K, N in ((256, 1000), (512, 256), (256, 768)):
    W = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    ts = []
    for M in (77, 78, 77, 79, 79):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16); torch.cuda.synchronize()
        t = time.perf_counter(); torch.nn.functional.linear(x, W); torch.cuda.synchronize()
        ts.append(round((time.perf_counter() - t) * 1e3, 3))
    res[f"{K}x{N}"] = ts
print("linear at M=77,78,77,79,79:", res, flush=True)
out.write_text(json.dumps({"rows": rows, "profile": tables, "linear": res}, indent=1))
