"""Packed prefill wall time, the slot/start read on the device (new) against host ints (old), with
graphs off and on (captured), on the 2.7B shape; and what the allocator does."""
import json, os, statistics, sys, time, types
import torch
from bench.model_runtime import hf_config
from models import HybridLM
from models.layers import mamba as M
from kernels import ops

def old_prefill(self, h, batch, pool):
    s = self.spec
    _, z, xbc, dt = self._project(h)
    ssm, conv = pool.ssm_layer(self.layer), pool.conv_layer(self.layer)
    ys = []
    start = 0
    for n, slot, L in zip(batch.sizes, batch.slots, batch.lens):
        rows = slice(start, start + n)
        start += n
        conv_out, conv_state = ops.conv1d_prefill(xbc[rows], self.conv_weight, self.conv_bias, conv[slot] if L > 0 else None, L)
        conv[slot] = conv_state
        x, B, C = s.split_conv(conv_out)
        y, final = ops.ssd_prefill(x, dt[rows], self.A, B, C, self.D, self.dt_bias, s.dt_limit,
                                   initial_state=ssm[slot] if L > 0 else None)
        ssm[slot] = final
        ys.append(y)
    return self._finish(torch.cat(ys, 0), z)

new_prefill = M.MambaMixer.prefill
out = {}
for graphs in (False, None):
    lm = HybridLM.from_config(hf_config("mamba2-2.7b", None), device="cuda", dtype=torch.bfloat16, max_slots=2,
                              max_len=2200, cuda_graphs=graphs)
    lm.warm_up()
    gen = torch.Generator().manual_seed(0)
    for n in (90, 512, 1024, 2048):
        prompt = torch.randint(0, lm.config.vocab_size, (n,), generator=gen).tolist()
        for name, fn in (("new", new_prefill), ("old", old_prefill), ("new", new_prefill), ("old", old_prefill)):
            M.MambaMixer.prefill = fn
            ts = []
            for r in range(6):
                slot = lm.pool.alloc()
                torch.cuda.synchronize(); t0 = time.perf_counter()
                lm._prefill_packed([slot], [prompt])
                torch.cuda.synchronize(); ts.append((time.perf_counter() - t0) * 1e3)
                lm.pool.free(slot)
            key = f"graphs={graphs is None} n={n} {name}"
            out.setdefault(key, []).append(round(statistics.median(ts[1:]), 2))
            print(key, [round(t, 1) for t in ts], flush=True)
    st = torch.cuda.memory_stats()
    print("allocs", st["num_alloc_retries"], st["num_device_alloc"], st["num_device_free"], torch.cuda.memory_reserved() / 2**30)
    del lm
    torch.cuda.empty_cache()
M.MambaMixer.prefill = new_prefill
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "packed_probe.json"), "w"), indent=1)
