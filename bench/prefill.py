"""Prefill latency on one GPU, host time included: each prompt length three ways, on a checkpoint
directory or a benchmark shape with random bf16 weights (`bench.model_runtime`'s shapes):
- packed: the eager prefill over the prompt;
- chains: through the CUDA graphs as chains only (verify and commit replays), as the thirty-first
  round's code ran prompts of up to 512 tokens;
- pieces: what `HybridLM.prefill` runs with graphs (`GraphRunner.prefill`) for prompts of up to
  `models.graphs.PREFILL_GRAPH_TOKENS` tokens (timed here past that too): prefill chunks of
  `models.graphs.PREFILL_CHUNKS` tokens while they fit, then chains.

    python -m bench.prefill --shape mamba2-2.7b --out prefill_mamba2.json
    python -m bench.prefill --model models/demo/target --out prefill_demo.json

Per length: each way's median wall time over fresh slots (the device synchronised before and
after, as a request sees it), the packed prefill's device time (the profiler's sum of its
kernels: the rest is host time the device waits through), and the largest difference of the
chains' and the pieces' logits from the packed prefill's. The model is warmed up first
(`HybridLM.warm_up`, which captures the chunks and chains), so no call compiles or captures
anything.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time
from contextlib import contextmanager

import torch

from bench import report

LENGTHS = (1, 3, 17, 64, 90, 128, 129, 266, 512, 1024, 2048)


@contextmanager
def fresh_slot(lm):
    """A slot taken for one call and given back after it (its state zeroed before the call)."""
    slot = lm.pool.alloc()
    try:
        yield slot
    finally:
        lm.pool.free(slot)


def wall_ms(lm, run, prompt: list[int], repeats: int) -> float:
    """Median ms of `run(slot, prompt)` on a fresh slot each time."""
    times = []
    for _ in range(repeats):
        with fresh_slot(lm) as slot:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            run(slot, prompt)
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def once(lm, run, prompt: list[int]) -> torch.Tensor:
    with fresh_slot(lm) as slot:
        return run(slot, prompt)


def device_ms(lm, run, prompt: list[int]) -> float:
    """The profiler's sum of the kernels of `run(slot, prompt)` on a fresh slot."""
    from torch.profiler import ProfilerActivity, profile

    with fresh_slot(lm) as slot, profile(activities=[ProfilerActivity.CUDA]) as prof:
        run(slot, prompt)
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3


def prefill_as(lm, way: str):
    """`lm.prefill` of one prompt the given way: packed, chains or pieces (see the module's text)."""
    chunks, cap = lm.graphs.prefill_chunks, lm.graphs.prefill_tokens

    def run(slot: int, prompt: list[int]) -> torch.Tensor:
        lm.graphs.prefill_tokens = 0 if way == "packed" else len(prompt)  # past the default cap too
        lm.graphs.prefill_chunks = () if way == "chains" else chunks
        try:
            return lm.prefill([slot], [prompt])
        finally:
            lm.graphs.prefill_chunks, lm.graphs.prefill_tokens = chunks, cap
    return run


@torch.no_grad()
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="checkpoint directory")
    where.add_argument("--shape", help="a bench.model_runtime shape (mamba2-2.7b, hybrid-8b, ...), random weights")
    p.add_argument("--layers", type=int, default=None, help="with --shape: keep the first N layers")
    p.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.prefill: needs a CUDA device", file=sys.stderr)
        return 2

    from models import HybridLM

    max_len = max(args.lengths) + 64
    if args.model:
        lm = HybridLM.from_pretrained(args.model, device="cuda", dtype=torch.bfloat16, max_slots=2, max_len=max_len)
        what = str(pathlib.Path(args.model).resolve())
    else:
        from bench.model_runtime import hf_config

        lm = HybridLM.from_config(hf_config(args.shape, args.layers), device="cuda", dtype=torch.bfloat16,
                                  max_slots=2, max_len=max_len)
        what = args.shape + (f" ({args.layers} layers)" if args.layers else "")
    if lm.graphs is None:
        print("bench.prefill: this model runs without CUDA graphs: its prompts are always packed", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    lm.warm_up()
    warm_up_s = time.perf_counter() - t0
    ways = {way: prefill_as(lm, way) for way in ("packed", "chains", "pieces")}
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{what}: warm-up {warm_up_s:.1f} s; prefill chunks {list(lm.graphs.prefill_chunks)}, "
          f"node buckets {list(lm.graphs.node_buckets)}")
    heads = ("tokens", "packed ms", "its device ms", "chains ms", "pieces ms", "pieces/packed", "max |dlogit|")
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, (7, 10, 14, 10, 10, 14, 13))))
    for n in args.lengths:
        prompt = torch.randint(0, lm.config.vocab_size, (n,), generator=gen).tolist()
        for run in ways.values():  # once each before timing: allocator, cuBLAS heuristics
            wall_ms(lm, run, prompt, 1)
        ms = {way: wall_ms(lm, run, prompt, args.repeats) for way, run in ways.items()}
        logits = {way: once(lm, run, prompt) for way, run in ways.items()}
        row = {"tokens": n, **{f"{way}_ms": round(t, 3) for way, t in ms.items()},
               "packed_device_ms": round(device_ms(lm, ways["packed"], prompt), 3),
               "pieces_over_packed": round(ms["pieces"] / ms["packed"], 3),
               **{f"{way}_max_abs_logit_diff": (logits[way] - logits["packed"]).abs().max().item()
                  for way in ("chains", "pieces")},
               "logit_scale": logits["packed"].abs().max().item()}
        rows.append(row)
        print(f"{n:>7} {ms['packed']:>10.2f} {row['packed_device_ms']:>14.2f} {ms['chains']:>10.2f} "
              f"{ms['pieces']:>10.2f} {row['pieces_over_packed']:>14.2f} {row['pieces_max_abs_logit_diff']:>13.3g}",
              flush=True)
    result = {
        "kind": "treeserve.bench.prefill", "version": 2, "model": what, "device": torch.cuda.get_device_name(),
        "dtype": "bf16", "versions": report.versions(),
        "prefill_chunks": list(lm.graphs.prefill_chunks), "node_buckets": list(lm.graphs.node_buckets),
        "warm_up_s": round(warm_up_s, 2), "command": " ".join(sys.argv), "rows": rows,
    }
    report.write(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
