"""Drafter benchmark: draft time per tree against the node budget, and draft-ahead in a real loop.

    python -m bench.drafter --model DRAFT_DIR --device cuda --out drafter.json
    python -m bench.drafter --model DRAFT_DIR --target TARGET_DIR --device cuda --out drafter.json
    python -m bench.drafter --random mamba2-130m --device cuda --out drafter.json   # no checkpoint
    python -m bench.drafter --model DRAFT_DIR --device cpu --out drafter-cpu.json  # fp32 on the CPU

The draft model runs through CUDA graphs on CUDA (as `treeserve drafter` does by default);
`--no-cuda-graphs` measures it eagerly. `--trim-vocab FILE` drafts over a trimmed vocabulary
(`treeserve trim-vocab`); `--random` with `--trim-size K` keeps the K lowest ids instead (random
weights have no token frequencies), which measures the cost of the head alone.

Part 1 (always): for each shape (chain, static, dynamic, ngram) and budget, a sequence is drafted
step after step through `drafter_service.engine.Drafter` (draft-ahead off), each step accepting the
root and its first child, so every timed request also advances the draft state as in serving.
Reported per (shape, budget): median and mean request time (ms, host-measured, device work
included), nodes and depth of the trees.

Part 2 (with --target): a greedy speculative loop in this process: the target (`models.HybridLM`)
verifies each tree, `treeserve.acceptance.follow_target` picks the outcome, the target commits it
and the drafter gets the outcome with the next request. Run once with draft-ahead and once without:
hit rate, saved drafting ms, tokens per target forward (tau), ms per step, and a check that the
output equals the target's own greedy decoding token for token. The draft-ahead worker runs while
the target verifies, as it would in serving.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n",
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n    parser.add_argument(",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        self.items.append(item)\n\n    def pop(self):\n",
    "for i in range(10):\n    for j in range(10):\n        if (i + j) % 3 == 0:\n            print(i, j)\n",
]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_draft_model(shape: str, device: str, dtype, max_slots: int, max_len: int, graphs: bool,
                       trim_size: int = 0):
    from transformers import Mamba2Config

    from drafter_service.draftlm import DraftModel
    from drafter_service.vocab import TrimmedVocab
    from models import HybridLM

    if shape != "mamba2-130m":
        raise SystemExit(f"unknown --random shape {shape}")
    cfg = Mamba2Config(hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64, state_size=128, n_groups=1,
                       expand=2, conv_kernel=4, vocab_size=50288, tie_word_embeddings=True, chunk_size=256)
    lm = HybridLM.from_config(cfg, device=device, dtype=dtype, max_slots=max_slots, max_len=max_len, cuda_graphs=False)
    trim = TrimmedVocab(tuple(range(trim_size)), cfg.vocab_size) if trim_size else None
    model = DraftModel(lm, name="random-mamba2-130m", trim=trim)
    if graphs:
        model.use_graphs()
    return model


def prompts_for(model, n: int, length: int, seed: int) -> list[list[int]]:
    tok = model.lm.tokenizer
    if tok is not None:
        out = []
        for i in range(n):
            ids = tok(PROMPTS[i % len(PROMPTS)] * 8)["input_ids"]
            out.append([t for t in ids if t < model.vocab_size][:length])
        return out
    rng = random.Random(seed)
    return [[rng.randrange(model.vocab_size) for _ in range(length)] for _ in range(n)]


# ---- part 1 ---------------------------------------------------------------------------------------
def draft_times(model, shapes, budgets, depth: int, trees: int, warmup: int, prompt: list[int]) -> list[dict]:
    from drafter_service.engine import DraftCall, Drafter, Options

    rows = []
    for shape in shapes:
        for budget in budgets:
            d = Drafter(model, Options(shape, budget, budget - 1 if shape == "chain" else depth, False), ahead=None,
                        max_nodes=max(budgets))
            d.start("b", prompt)
            length, root, appended = len(prompt), prompt[-1], ()
            ms, nodes, depths = [], [], []
            for step in range(warmup + trees):
                reply = d.draft(DraftCall("b", length, appended, root))
                tree = reply.tree
                if step >= warmup:
                    ms.append(reply.draft_ms)
                    nodes.append(tree.size)
                    depths.append(max(tree.depths()))
                path = [0] + list(tree.children(0)[:1])
                appended = tuple(tree.tokens_along(path))
                length += len(path)
                root = prompt[(length * 7) % len(prompt)]
            d.close()
            row = {"shape": shape, "budget": budget, "median_ms": statistics.median(ms), "mean_ms": statistics.mean(ms),
                   "nodes": statistics.mean(nodes), "depth": statistics.mean(depths)}
            rows.append(row)
            print(f"{shape:8s} budget {budget:3d}: {row['median_ms']:7.2f} ms median, {row['mean_ms']:7.2f} mean, "
                  f"{row['nodes']:5.1f} nodes, depth {row['depth']:.1f}", flush=True)
    return rows


# ---- part 2 ---------------------------------------------------------------------------------------
def greedy_reference(target, prompt: list[int], n: int) -> list[int]:
    slot = target.pool.alloc()
    try:
        logits = target.prefill([slot], [prompt])
        out = [int(logits[0].argmax())]
        while len(out) < n:
            out.append(int(target.decode([slot], [out[-1]])[0].argmax()))
        return out
    finally:
        target.pool.free(slot)


def speculative_loop(model, target, prompts, steps: int, shape: str, budget: int, depth: int, ahead) -> dict:
    from drafter_service.engine import DraftCall, Drafter, Options
    from treeserve.acceptance import Outcome, follow_target

    d = Drafter(model, Options(shape, budget, depth, ahead is not None), ahead=ahead)
    device = target.device
    draft_ms, verify_ms, step_ms, taus, outputs = [], [], [], [], []
    forwards = emitted_total = 0
    for i, prompt in enumerate(prompts):
        sid = f"p{i}"
        slot = target.pool.alloc()
        logits = target.prefill([slot], [prompt])
        root = int(logits[0].argmax())
        d.start(sid, prompt)
        length, appended, outcome, out = len(prompt), (), None, [root]
        while len(out) < steps:
            t0 = time.perf_counter()
            reply = d.draft(DraftCall(sid, length, appended, root, outcome))
            t1 = time.perf_counter()
            tree = reply.tree
            res = target.verify([slot], [tree])
            target_tokens = res.logits.argmax(-1).tolist()
            sync(device)
            t2 = time.perf_counter()
            o = follow_target(tree, target_tokens)
            target.commit([(res.pending[0], list(o.accepted_nodes))])
            out += o.emitted(tree)
            appended = tuple(tree.tokens_along(o.accepted_nodes))
            length += len(o.accepted_nodes)
            root, outcome = o.bonus, Outcome(o.accepted_nodes, o.bonus)
            sync(device)
            t3 = time.perf_counter()
            draft_ms.append(reply.draft_ms)
            verify_ms.append((t2 - t1) * 1e3)
            step_ms.append((t3 - t0) * 1e3)
            forwards += 1
            emitted_total += len(o.accepted_nodes)
        taus.append(len(out) / max(1, forwards))
        outputs.append(out[:steps])
        d.end(sid)
        target.pool.free(slot)
    m = d.metrics
    d.close()
    return {
        "draft_ahead": ahead is not None, "shape": shape, "budget": budget, "depth": depth,
        "tau": emitted_total / max(1, forwards), "target_forwards": forwards,
        "draft_ms_median": statistics.median(draft_ms), "draft_ms_mean": statistics.mean(draft_ms),
        "verify_ms_median": statistics.median(verify_ms), "step_ms_median": statistics.median(step_ms),
        "step_ms_mean": statistics.mean(step_ms),
        "ahead_hits": m.ahead_hits, "ahead_misses": m.ahead_misses, "hit_rate": m.hit_rate, "saved_ms": m.saved_ms,
        "_outputs": outputs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="draft checkpoint directory")
    src.add_argument("--random", help="random draft weights of a known shape (mamba2-130m)")
    p.add_argument("--target", help="target checkpoint directory: run the greedy speculative loop too")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA graphs for the draft model (default: on with a CUDA device)")
    p.add_argument("--trim-vocab", default=None, metavar="FILE", help="trimmed draft vocabulary file (--model)")
    p.add_argument("--trim-size", type=int, default=0, help="with --random: keep this many token ids (0: all)")
    p.add_argument("--shapes", default="chain,static,dynamic,ngram")
    p.add_argument("--budgets", default="4,8,16,32,64")
    p.add_argument("--depth", type=int, default=8, help="depth limit of dynamic trees")
    p.add_argument("--trees", type=int, default=30, help="timed trees per (shape, budget)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--prompts", type=int, default=4, help="prompts for the speculative loop")
    p.add_argument("--steps", type=int, default=96, help="tokens generated per prompt in the loop")
    p.add_argument("--loop-shape", default="dynamic")
    p.add_argument("--loop-budget", type=int, default=16)
    p.add_argument("--loop-depth", type=int, default=6)
    p.add_argument("--ahead-trees", type=int, default=4)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from drafter_service.ahead import AheadConfig
    from drafter_service.draftlm import DraftModel

    device = torch.device(args.device)
    names = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    dtype = names[args.dtype] if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    budgets = [int(b) for b in args.budgets.split(",")]
    # slots: one per sequence plus one per prepared outcome
    slots = 2 + args.ahead_trees
    max_len = args.prompt_len + max(args.steps, (args.trees + args.warmup) * 2) + max(budgets) + 64
    graphs = args.cuda_graphs if args.cuda_graphs is not None else device.type == "cuda"
    if args.model:
        model = DraftModel.load(args.model, device=str(device), dtype=dtype, max_slots=slots, max_len=max_len,
                                cuda_graphs=graphs, trim=args.trim_vocab)
    else:
        model = random_draft_model(args.random, str(device), dtype, slots, max_len, graphs, args.trim_size)
    prompts = prompts_for(model, max(1, args.prompts), args.prompt_len, seed=0)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "draft_model": model.name, "dtype": str(dtype), "cuda_graphs": model.lm.graphs is not None,
        "draft_vocab": model.head.describe(), "torch_threads": torch.get_num_threads(),
        "prompt_len": len(prompts[0]),
        "draft_time": draft_times(model, args.shapes.split(","), budgets, args.depth, args.trees, args.warmup, prompts[0]),
    }
    if args.target:
        from models import HybridLM

        target = HybridLM.from_pretrained(args.target, device=device, dtype=dtype, max_slots=2, max_len=max_len)
        runs = []
        for ahead in (AheadConfig(trees=args.ahead_trees), None):
            run = speculative_loop(model, target, prompts, args.steps, args.loop_shape, args.loop_budget,
                                   args.loop_depth, ahead)
            runs.append(run)
        refs = [greedy_reference(target, pr, args.steps) for pr in prompts]
        for run in runs:
            run["lossless"] = all(o == r for o, r in zip(run.pop("_outputs"), refs))
            print(f"loop draft-ahead={run['draft_ahead']}: tau {run['tau']:.2f}, step {run['step_ms_median']:.2f} ms "
                  f"(draft {run['draft_ms_median']:.2f}, verify {run['verify_ms_median']:.2f}), hit rate "
                  f"{run['hit_rate']:.2f}, saved {run['saved_ms']:.1f} ms, lossless {run['lossless']}", flush=True)
        result["loop"] = runs
        result["target_model"] = args.target
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
