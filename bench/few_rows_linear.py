"""Few-row projections on CUDA: our weight-streaming kernels (kernels/few_rows_linear.py) against
cuBLAS (F.linear) at the projection shapes of the benchmark models, with a sweep of their launch
configurations.

    python -m bench.few_rows_linear --out FILE.json [--reps 30]

Method as bench.ssm_kernels (its Timer: L2 evicted before every timed call, host launch hidden,
medians). Floor = weight bytes / the copy bandwidth measured in the same run (x and y are
negligible). The one-row kernel is swept at 1 row, the dot kernel at 16 rows (its tile; the row
count is not compiled in, so fewer rows cost the same); each sweep's summary names the
configuration with the lowest geometric-mean time over the shapes, which is then timed at 2, 4
and 8 rows beside cuBLAS.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import torch.nn.functional as F

from bench.ssm_kernels import Timer, copy_bandwidth
from kernels.few_rows_linear import few_rows_linear, few_rows_linear_ref

DEV = "cuda"
# (name, K in, N out): bench.model_runtime's two models
SHAPES = [
    ("2.7b in_proj", 2560, 10576), ("2.7b out_proj", 5120, 2560), ("2.7b lm_head", 2560, 50288),
    ("8b mamba in_proj", 4096, 10272), ("8b square (out_proj, q, o)", 4096, 4096), ("8b kv", 4096, 1024),
    ("8b mlp gate_up", 4096, 28672), ("8b mlp down", 14336, 4096),
]
# one-row kernel: (BN, BK, warps, -) with 32-64 fp32 partial sums per thread
ROW_CONFIGS = [(bn, bk, w, 0) for bn, bk, w in itertools.product((4, 8, 16), (256, 512, 1024), (2, 4, 8))
               if 32 <= bn * bk // (w * 32) <= 64]
# dot kernel: (BN, BK, warps, stages)
DOT_CONFIGS = list(itertools.product((16, 32, 64), (64, 128, 256), (4, 8), (3, 4)))


def knobs(cfg):
    bn, bk, w, st = cfg
    return dict(block_n=bn, block_k=bk, num_warps=w, num_stages=st or None)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    timer = Timer(args.reps, warmup=3)
    bw = copy_bandwidth(timer)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    gen = torch.Generator(device=DEV).manual_seed(0)
    weights = {name: (torch.randn(N, K, device=DEV, generator=gen) * K ** -0.5).to(torch.bfloat16)
               for name, K, N in SHAPES}
    floors = {name: N * K * 2 / bw * 1e6 for name, K, N in SHAPES}
    inputs = {(name, M): torch.randn(M, K, device=DEV, generator=gen).to(torch.bfloat16)
              for (name, K, _), M in itertools.product(SHAPES, (1, 2, 4, 8, 16))}
    report = dict(copy_bandwidth_GBps=bw / 1e9, floors_us=floors, cublas_us={}, sweeps={}, chosen={}, rows=[])

    def ours(name, M, cfg):
        x, W = inputs[(name, M)], weights[name]
        try:
            got = few_rows_linear(x, W, **knobs(cfg))
        except Exception as e:  # a configuration that does not fit (shared memory): not a candidate
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:80]}")
            return math.inf
        want = few_rows_linear_ref(x, W)
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2, f"{name} M={M} {cfg}: relative error {err:.2e}"
        return timer(lambda: few_rows_linear(x, W, **knobs(cfg)))

    for label, M, configs in (("one-row", 1, ROW_CONFIGS), ("dot", 16, DOT_CONFIGS)):
        times = {cfg: [ours(name, M, cfg) for name, _, _ in SHAPES] for cfg in configs}
        score = {cfg: math.exp(sum(map(math.log, ts)) / len(ts)) for cfg, ts in times.items()}
        best = min(score, key=score.get)
        report["sweeps"][label] = {str(cfg): ts for cfg, ts in times.items()}
        report["chosen"][label] = best
        print(f"{label} kernel at {M} row(s): best {best} of {len(configs)}")
        for M2 in ((1,) if M == 1 else (2, 4, 8, 16)):
            for i, (name, _, _) in enumerate(SHAPES):
                t = times[best][i] if M2 == M else ours(name, M2, best)
                x, W = inputs[(name, M2)], weights[name]
                c = report["cublas_us"][f"{name} M={M2}"] = timer(lambda: F.linear(x, W))
                report["rows"].append(dict(kernel=label, shape=name, rows=M2, ours_us=t, cublas_us=c,
                                           floor_us=floors[name]))
                print(f"  {name:28s} M={M2:2d} floor {floors[name]:7.2f}  cuBLAS {c:7.2f} ({c / floors[name]:4.2f}x)"
                      f"  ours {t:7.2f} ({t / floors[name]:4.2f}x)  ours/cuBLAS {t / c:4.2f}", flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1, default=str)


if __name__ == "__main__":
    main()
