"""How long a verifier takes to be ready: load, HybridLM.warm_up, results.warm_up, capture_all,
each timed (run once with an empty TRITON_CACHE_DIR, once with the filled one)."""
import json, os, sys, time
t00 = time.perf_counter()
import torch
import pathlib; sys.path.insert(0, str(pathlib.Path(__file__).parent)); from shapes import load
from verifier_service import results
t_import = time.perf_counter() - t00
model, graphs = sys.argv[1], sys.argv[2]  # graphs: lazy | startup
phases = {"import": t_import}
def ph(name, fn):
    t = time.perf_counter(); r = fn(); torch.cuda.synchronize(); phases[name] = round(time.perf_counter() - t, 3); return r
lm = ph("load", lambda: load(model, max_slots=64, max_len=4096))
ph("model_warm_up", lm.warm_up)
ph("sampling_warm_up", lambda: results.warm_up(lm.config.vocab_size, lm.device))
if graphs == "startup":
    ph("capture_all", lm.graphs.capture_all)
phases["total"] = round(time.perf_counter() - t00, 3)
print(json.dumps({"model": model, "graphs": graphs, "cache": os.environ.get("TRITON_CACHE_DIR"), "phases": phases}), flush=True)
