"""Is a GEMM's first-call cost at a new row count per shape or per call? which BLAS back end? does
padding rows to a warmed bucket avoid it, and at what price?"""
import json, os, pathlib, time
import torch
import torch.nn.functional as F
out = pathlib.Path(os.environ.get("OUT", "/tmp")) / "cublas_probe.json"
dev, dt = "cuda", torch.bfloat16
shapes = {"in_proj": (10576, 2560), "out_proj": (2560, 5120), "lm_head": (50288, 2560)}
W = {k: [torch.randn(n, kk, device=dev, dtype=dt) * 0.02 for _ in range(3)] for k, (n, kk) in shapes.items()}
def t(fn):
    torch.cuda.synchronize(); a = time.perf_counter(); fn(); torch.cuda.synchronize(); return round((time.perf_counter() - a) * 1e3, 3)
res = {}
for k in shapes: t(lambda: F.linear(torch.randn(64, shapes[k][1], device=dev, dtype=dt), W[k][0]))  # load kernels
def per_call(tag, Ms):
    r = {}
    for M in Ms:
        for k, (n, kk) in shapes.items():
            x = torch.randn(M, kk, device=dev, dtype=dt)
            r[f"{k} M={M}"] = [t(lambda: F.linear(x, w)) for w in W[k]] + [t(lambda: F.linear(x, W[k][0]))]
    res[tag] = r; print(tag, json.dumps(r, indent=0), flush=True)
per_call("default backend", [100, 101, 257, 1000])
print("preferred", torch.backends.cuda.preferred_blas_library(), flush=True)
torch.backends.cuda.preferred_blas_library("cublaslt"); per_call("cublaslt", [102, 103, 258])
torch.backends.cuda.preferred_blas_library("cublas"); per_call("cublas", [104, 105, 259])
torch.backends.cuda.preferred_blas_library("default")
# fp32
W32 = {k: [w.float() for w in W[k][:1]] for k in ("in_proj",)}
r = {}
for M in (106, 107):
    x = torch.randn(M, 2560, device=dev)
    r[f"fp32 in_proj M={M}"] = [t(lambda: F.linear(x, W32["in_proj"][0])) for _ in range(3)]
res["fp32"] = r; print(r, flush=True)
# the price of padding to a bucket (warm both shapes first), in-graph-free host+device timing of 100 calls
def pad_rows(x, m):
    return F.pad(x, (0, 0, 0, m - x.shape[0]))
price = {}
for M, B in ((100, 112), (1000, 1024), (3000, 3072)):
    x = torch.randn(M, 2560, device=dev, dtype=dt); w = W["in_proj"][0]
    for _ in range(3): F.linear(x, w); F.linear(pad_rows(x, B), w)[:M]
    torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    ev[0].record()
    for _ in range(50): F.linear(x, w)
    ev[1].record()
    for _ in range(50): F.linear(pad_rows(x, B), w)[:M]
    ev[2].record(); torch.cuda.synchronize()
    price[f"M={M} pad {B}"] = {"plain_us": round(ev[0].elapsed_time(ev[1]) * 20, 2), "padded_us": round(ev[1].elapsed_time(ev[2]) * 20, 2)}
res["pad price"] = price; print(price, flush=True)
out.write_text(json.dumps(res, indent=1))
