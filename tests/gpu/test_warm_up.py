"""`HybridLM.warm_up` compiles every Triton program that a prefill of any length, a one-sequence
decode and a one-sequence verify and commit of up to 16 steps launch: after it, prompts and
continuations of other lengths at other positions, alone or packed together, and chains of other
lengths verified and committed, compile nothing new, with and without graphs; `results.warm_up` does the same for sampled
requests; and a prompt's attention keeps off cuDNN (a plan built per prompt shape).

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
from tests.verifier.trees import random_tree, with_drafts
from treeserve.sampling import Sampling
from treeserve.tree import TokenTree
from verifier_service import results

DEMO = pathlib.Path(__file__).resolve().parents[2] / "models" / "demo"


@gpu
# a hybrid with attention and a pure Mamba2, eager; and the hybrid with graphs, whose prompts run in
# pieces (prefill chunks and chains, captured by the warm-up)
@pytest.mark.parametrize("model,graphs", [("target", False), ("drafter", False), ("target", None)],
                         ids=["target", "drafter", "target-graphs"])
def test_nothing_compiles_after_warm_up(model, graphs):
    lm = HybridLM.from_pretrained(DEMO / model, device="cuda", dtype=torch.bfloat16, max_slots=4, max_len=2048,
                                  cuda_graphs=graphs)
    assert (lm.graphs is not None) == (graphs is None)
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
    lm.prefill(slots, [tokens(5), tokens(19), tokens(40)])  # several prompts in one prefill (packed, or pieces)
    torch.cuda.synchronize()
    new = sorted(compiled(fns) - warm)
    assert not new, "compiled after the warm-up:\n" + "\n".join(f"{name}: {key[:300]}" for name, key in new)


@gpu
def test_a_prompts_attention_keeps_off_cudnn():
    """SDPA's cuDNN attention builds a plan at every new prompt shape (46-588 ms each on an H100);
    a bf16 prefill's attention, at a fresh prompt and after a prefix, launches none of its kernels."""
    from torch.profiler import ProfilerActivity, profile

    lm = HybridLM.from_pretrained(DEMO / "target", device="cuda", dtype=torch.bfloat16, max_slots=2, max_len=512,
                                  cuda_graphs=False)
    slot = lm.pool.alloc()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        lm.prefill([slot], [list(range(1, 38))])
        lm.prefill([slot], [list(range(1, 12))])
        torch.cuda.synchronize()
    kernels = {e.name for e in prof.events() if e.device_type.name == "CUDA"}
    assert kernels, "the profiler saw no GPU kernel"
    assert any("flash" in k.lower() or "fmha" in k.lower() or "attention" in k.lower() for k in kernels), sorted(kernels)
    assert not [k for k in kernels if "cudnn" in k.lower()], sorted(k for k in kernels if "cudnn" in k.lower())


@gpu
# the demo's vocabulary; one split over many programs; rows at any alignment (random offsets)
@pytest.mark.parametrize("vocab", [4096, 50304, 4099])
def test_no_sampled_request_compiles_after_the_warm_up(vocab):
    """After `results.warm_up`, sampled queries of other sizes, widths, truncations and positions,
    packed several to a batch, compile no Triton program."""
    import random

    fns = jit_functions()
    forget(fns)
    results.warm_up(vocab, "cuda")
    warm = compiled(fns)
    assert warm, "the warm-up compiled nothing"
    rng = random.Random(3)
    settings = [Sampling(temperature=0.6, seed=1), Sampling(temperature=1.0, top_k=40, seed=2),
                Sampling(temperature=1.3, top_p=0.8, seed=3), Sampling(temperature=0.9, top_k=7, top_p=0.95, seed=4)]
    for batch in range(6):
        queries = []
        for i in range(1 + batch % 3):
            tree = random_tree(rng, rng.randrange(vocab), vocab, rng.choice([1, 2, 5, 9, 16, 23, 64]))
            if rng.random() < 0.7:
                tree = with_drafts(rng, tree, vocab)
            queries.append(results.NodeQuery(tree, rng.randrange(1, 900), rng.choice(settings), rng.choice([0, 3])))
        offsets = [0]
        for q in queries:
            offsets.append(offsets[-1] + q.tree.size)
        logits = torch.randn(offsets[-1], vocab, device="cuda") * 3
        results.compute(logits, offsets, queries)
    torch.cuda.synchronize()
    new = sorted(compiled(fns) - warm)
    assert not new, "compiled after the warm-up:\n" + "\n".join(f"{name}: {key[:300]}" for name, key in new)
