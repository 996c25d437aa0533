"""How long does the drafter take to catch up on k committed tokens (prefill after a slot's history)?
Times DraftModel.advance(slot, None, tokens) for several k, first use and again, on the demo drafter."""
import json, sys, time, os
import torch
from drafter_service.draftlm import DraftModel

dev = "cuda"
m = DraftModel.load("models/demo/drafter", device=dev)
lm = m.lm
V = lm.config.vocab_size if hasattr(lm, "config") else 256
g = torch.Generator().manual_seed(0)
rows = []
def tok(k):
    return torch.randint(0, 200, (k,), generator=g).tolist()
slots = [m.open(tok(40)) for _ in range(3)]
torch.cuda.synchronize()
for rep in range(3):
    for k in [1, 2, 3, 5, 7, 9, 16, 17, 24, 31, 32, 33, 48, 63, 64, 65, 100, 127]:
        s = slots[rep]
        torch.cuda.synchronize(); t0 = time.perf_counter()
        m.advance(s, None, tok(k))
        torch.cuda.synchronize(); ms = (time.perf_counter() - t0) * 1e3
        rows.append((rep, k, round(ms, 2)))
        print(rep, k, round(ms, 2), flush=True)
        if lm.pool.length(s) > 1500:
            m.free(s); slots[rep] = m.open(tok(40))
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "catchup.json"), "w"))
