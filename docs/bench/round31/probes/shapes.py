"""A checkpoint directory, or shape:NAME[:layers] for a `bench.model_runtime` shape with random
bf16 weights (as run, this file spelled out the two configs that `hf_config` now gives)."""
import torch

from bench.model_runtime import hf_config
from models import HybridLM


def load(spec, **kw):
    if not spec.startswith("shape:"):
        return HybridLM.from_pretrained(spec, device="cuda", dtype=torch.bfloat16, **kw)
    _, name, *rest = spec.split(":")
    return HybridLM.from_config(hf_config(name, int(rest[0]) if rest else None), device="cuda", dtype=torch.bfloat16, **kw)
