"""The kernel names a bf16 prefill's attention launches with SDPA's default backends (cuDNN first on
Hopper) and with the project's PREFILL_BACKENDS: shows the GPU test's name check can fail."""
import pathlib, torch
from torch.profiler import ProfilerActivity, profile
import models.layers.attention as att
from models import HybridLM
lm = HybridLM.from_pretrained(pathlib.Path("models/demo/target"), device="cuda", dtype=torch.bfloat16, max_slots=2, max_len=512, cuda_graphs=False)
for label, backends in (("default", tuple(att.SDPBackend.__members__[b] for b in ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"))), ("project", att.PREFILL_BACKENDS)):
    att.PREFILL_BACKENDS = backends
    slot = lm.pool.alloc()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        lm.prefill([slot], [list(range(1, 38))]); lm.prefill([slot], [list(range(1, 12))]); torch.cuda.synchronize()
    lm.pool.free(slot)
    names = sorted({e.name[:90] for e in prof.events() if e.device_type.name == "CUDA" and any(w in e.name.lower() for w in ("cudnn", "flash", "fmha", "sdpa", "attention"))})
    print(label, names)
