"""First-use costs of a model on CUDA: what a prompt, a catch-up (a prefill after a sequence's
history, as a drafter does after speculation was off) and a decode cost the first time a length is
seen and after, and which Triton programs each compiles.

    python -m bench.first_use --model models/demo/target --out first_use.json
    python -m bench.first_use --model models/demo/drafter --no-warm-up --out first_use_cold.json

Triton keeps compiled programs on disk (~/.triton/cache): a second run on the same machine loads
them instead (milliseconds, still listed as compiled). To see cold compiles, point TRITON_CACHE_DIR
at an empty directory.

Without `--no-warm-up` the model runs `HybridLM.warm_up` first (as the verifier and the drafter do at
start-up) and its time and programs are reported; every later call should then compile nothing.
Reported per call: host-measured ms (device synchronised) and the kernels that compiled a program
during it. The model runs as a verifier runs it: decode through CUDA graphs (its first call
captures the one-sequence graph), prompts of up to `models.graphs.PREFILL_GRAPH_TOKENS` tokens in
pieces through the graphs (prefill chunks and chains, which the warm-up captures), longer ones
eagerly. A drafter builds its graphs otherwise
(`DraftModel.load`), so `--model` with a drafter's checkpoint times it as a target.
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time

import torch

from bench import report

DEMO = pathlib.Path(__file__).resolve().parents[1] / "models" / "demo"
PROMPTS = (90, 96, 131, 266, 200, 64, 65, 17)  # the HumanEval prompts of `bench e2e` are 90-266 tokens
CATCH_UPS = (1, 2, 3, 5, 16, 17, 31, 32, 65, 127, 9, 100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.first_use", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(DEMO / "target"), help="checkpoint directory (default: the demo target)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--no-warm-up", action="store_true", help="skip HybridLM.warm_up (what a model paid before it)")
    p.add_argument("--repeat", type=int, default=2, help="passes over the same lengths (the first pays compiles)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.first_use: needs a CUDA device (Triton compiles nothing on the CPU)", file=sys.stderr)
        return 2

    from kernels.compiled import compiled, jit_functions
    from models import HybridLM

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    lm = HybridLM.from_pretrained(args.model, device="cuda", dtype=dtype, max_slots=len(PROMPTS), max_len=4096)
    fns = jit_functions()
    seen = compiled(fns)
    calls = []

    def timed(what: str, run) -> None:
        nonlocal seen
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        run()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        now = compiled(fns)
        new = sorted({name for name, _ in now - seen})
        seen = now
        calls.append({"call": what, "ms": round(ms, 3), "kernels_compiled": new})
        print(f"{what:>28}: {ms:9.2f} ms  {', '.join(new) if new else '-'}", flush=True)

    if not args.no_warm_up:
        timed("warm_up", lm.warm_up)
    gen = torch.Generator().manual_seed(0)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, lm.config.vocab_size, (n,), generator=gen).tolist()

    for rep in range(args.repeat):
        slots = []
        for n in PROMPTS:
            slot, prompt = lm.pool.alloc(), tokens(n)
            slots.append(slot)
            timed(f"pass {rep} prompt {n}", lambda: lm.prefill([slot], [prompt]))
        for n in CATCH_UPS:
            appended = tokens(n)
            timed(f"pass {rep} catch-up {n} at {lm.pool.length(slots[0])}", lambda: lm.prefill([slots[0]], [appended]))
        timed(f"pass {rep} decode", lambda: lm.decode([slots[0]], [1]))
        for slot in slots:
            lm.pool.free(slot)
    result = {
        "kind": "treeserve.bench.first-use", "version": 1, "model": str(pathlib.Path(args.model).resolve()),
        "device": torch.cuda.get_device_name(), "dtype": args.dtype, "warm_up": not args.no_warm_up,
        "versions": report.versions(),
        "command": " ".join(sys.argv), "calls": calls,
    }
    report.write(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
