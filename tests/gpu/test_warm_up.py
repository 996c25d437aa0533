"""`HybridLM.warm_up` compiles every Triton program that a prefill of any length, a one-sequence
decode and a one-sequence verify and commit of up to 16 steps launch: after it, prompts and
continuations of other lengths at other positions, alone or packed together, and chains of other
lengths verified and committed, compile nothing new.

Compiled programs are counted in each kernel's in-memory cache (`kernels.compiled`), which the
test empties first so that programs compiled by earlier tests in the process cannot hide one the
warm-up misses. Skipped without CUDA."""
from __future__ import annotations

import pathlib

import pytest
import torch

from kernels.compiled import compiled, forget, jit_functions
from models import HybridLM
from tests.gpu.marks import compiled_triton, gpu  # noqa: F401 (fixture)
from treeserve.tree import TokenTree

DEMO = pathlib.Path(__file__).resolve().parents[2] / "models" / "demo"


@gpu
@pytest.mark.parametrize("model", ["target", "drafter"])  # a hybrid with attention, a pure Mamba2
def test_nothing_compiles_after_warm_up(model):
    lm = HybridLM.from_pretrained(DEMO / model, device="cuda", dtype=torch.bfloat16, max_slots=4, max_len=2048,
                                  cuda_graphs=False)
    fns = jit_functions()
    forget(fns)
    lm.warm_up()
    warm = compiled(fns)
    assert warm, "the warm-up compiled nothing"
    assert lm.pool.in_use() == [], "the warm-up kept a slot"

    gen = torch.Generator().manual_seed(1)

    def tokens(n):
        return torch.randint(0, lm.config.vocab_size, (n,), generator=gen).tolist()

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
    lm.prefill(slots, [tokens(5), tokens(19), tokens(40)])  # several prompts packed in one prefill
    torch.cuda.synchronize()
    new = sorted(compiled(fns) - warm)
    assert not new, "compiled after the warm-up:\n" + "\n".join(f"{name}: {key[:300]}" for name, key in new)
