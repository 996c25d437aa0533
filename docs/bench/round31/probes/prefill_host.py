"""Where a warm prefill's host time goes: wall vs GPU kernel time, then cProfile of repeats."""
import cProfile, io, json, os, pathlib, pstats, sys, time
import torch
sys.path.insert(0, str(pathlib.Path(__file__).parent)); from shapes import load
spec = sys.argv[1]; tag = sys.argv[2]
OUT = pathlib.Path(os.environ.get("OUT", "/tmp"))
lm = load(spec, max_slots=8, max_len=4096)
lm.warm_up()
gen = torch.Generator().manual_seed(0)
def toks(n): return torch.randint(0, lm.config.vocab_size, (n,), generator=gen).tolist()
def run(lengths):
    slots = [lm.pool.alloc() for _ in lengths]
    lm.prefill(slots, [toks(n) for n in lengths])
    for s in slots: lm.pool.free(s)
res = {"spec": spec}
for lengths in ([90], [90, 120, 60, 200], [3], [2000]):
    for _ in range(3): run(lengths)
    ws = []
    for _ in range(5):
        torch.cuda.synchronize(); t = time.perf_counter(); run(lengths); torch.cuda.synchronize(); ws.append((time.perf_counter() - t) * 1e3)
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(lengths); torch.cuda.synchronize()
    gpu_us = sum(e.self_device_time_total for e in prof.key_averages())
    res[str(lengths)] = {"wall_ms": sorted(ws)[2], "gpu_kernels_ms": round(gpu_us / 1e3, 3)}
    print(lengths, res[str(lengths)], flush=True)
pr = cProfile.Profile()
pr.enable()
for _ in range(5): run([90])
torch.cuda.synchronize()
pr.disable()
s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("tottime").print_stats(45)
st.sort_stats("cumulative").print_stats(60)
(OUT / f"prefill_host_{tag}.txt").write_text(json.dumps(res, indent=1) + "\n" + s.getvalue())
print(s.getvalue()[:6000])
