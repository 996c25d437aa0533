"""Few-row projections on CUDA: our weight-streaming kernels (kernels/few_rows_linear.py) against
cuBLAS (F.linear) at the projection shapes of the benchmark models, with a sweep of their launch
configurations.

    python -m bench.few_rows_linear --out FILE.json [--reps 30]
    python -m bench.few_rows_linear --in-graph --out FILE.json   # one-row tiles, timed as decode runs them
    python -m bench.few_rows_linear --in-graph --rows 16,64 --out FILE.json   # dot tiles and cuBLAS, as verify runs them

Method as bench.ssm_kernels (its Timer: L2 evicted before every timed call, host launch hidden,
medians). Floor = weight bytes / the copy bandwidth measured in the same run (x and y are
negligible). The one-row kernel is swept at 1 row, the dot kernel at 16 rows (its smallest row
tile; fewer rows cost the same); each sweep's summary names the configuration with the lowest
geometric-mean time over the shapes, which is then timed at 2, 4 and 8 rows beside cuBLAS.

`--in-graph` times one-row tiles (or, with `--rows M[,M2...]`, dot tiles next to cuBLAS, and the tile
with the best geometric mean over the shapes) the way a decode step runs them instead: a CUDA graph of GRAPH_CHAIN
back-to-back launches on distinct weights (programmatic dependent launch as configured, see
kernels/pdl.py), replay time / GRAPH_CHAIN, median of 15 replays; the floor assumes the copy
bandwidth measured first. Isolated launches overstate small layers (a launch's fixed cost) and miss
what PDL overlaps, which is why kernels/few_rows_linear.ROW_TILES and DOT_TILES come from this mode.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math

import torch
import torch.nn.functional as F

from bench.ssm_kernels import Timer, copy_bandwidth
from kernels.few_rows_linear import DotTile, few_rows_linear, few_rows_linear_ref

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
DOT_CONFIGS = [DotTile(*c, 264) for c in itertools.product((64, 128, 256), (64, 128), (4, 8), (3, 4))]


# one-row tiles of the in-graph sweep: (BN, BK, warps) with 16-64 fp32 partial sums per thread
GRAPH_CONFIGS = [(bn, bk, w) for bn, bk, w in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (1, 2, 4, 8))
                 if 16 <= bn * bk // (w * 32) <= 64]
GRAPH_CHAIN = 48  # launches per graph (12 for layers over 60 M weights, to bound memory)


# dot-path tiles of the in-graph sweep (--rows > 1): DotTile fields (BN, BK, warps, stages, programs the
# reduction is split for)
GRAPH_DOT_CONFIGS = ([DotTile(*c) for c in itertools.product((64,), (64, 128), (4,), (3, 4), (132, 198, 264, 396))]
                     + [DotTile(128, 128, 4, 3, 264), DotTile(128, 64, 8, 3, 264)])


def graph_time(step, n_launches: int) -> float:
    """µs per launch of `step` (which makes n_launches launches) replayed in a CUDA graph: median of 15."""
    step()  # compile
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()
        with torch.cuda.graph(graph, stream=stream):
            step()
    torch.cuda.synchronize()
    times = []
    for _ in range(15):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / n_launches)
    return sorted(times)[len(times) // 2]


def in_graph_sweep(bw: float, rows: int) -> dict:
    """{shape: {"floor_us", "us": {config: µs per launch}}} over GRAPH_CONFIGS (one row) or
    GRAPH_DOT_CONFIGS plus cuBLAS ("cublas") for more rows; prints each shape's five best."""
    out = {}
    configs = ([(bn, bk, w, 0, 0) for bn, bk, w in GRAPH_CONFIGS] if rows == 1 else GRAPH_DOT_CONFIGS)
    for name, K, N in SHAPES:
        weights = [(torch.randn(N, K, device=DEV) * K ** -0.5).to(torch.bfloat16)
                   for _ in range(GRAPH_CHAIN if N * K < 60e6 else 12)]
        x = torch.randn(rows, K, device=DEV).to(torch.bfloat16)
        res = {}
        for cfg in configs:
            def chain():
                for W in weights:
                    few_rows_linear(x, W, **knobs(cfg))
            try:
                t = graph_time(chain, len(weights))
            except Exception as e:  # a configuration that does not fit (shared memory): not a candidate
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:80]}")
                continue
            res[config_name(cfg)] = t
        if rows > 1:
            def chain_cublas():
                for W in weights:
                    F.linear(x, W)
            res["cublas"] = graph_time(chain_cublas, len(weights))
        floor = N * K * 2 / bw * 1e6
        best = sorted((v, k) for k, v in res.items())[:5]
        cublas = f"  cuBLAS {res['cublas']:.2f}" if rows > 1 else ""
        print(f"{name:28s} floor {floor:6.1f} us  best {[(k, round(v, 2)) for v, k in best]}{cublas}", flush=True)
        out[name] = dict(floor_us=floor, us=res)
    return out


def print_best_overall(sweep: dict) -> None:
    """The configurations with the lowest geometric mean over the shapes, each shape's time under
    the best of them, and cuBLAS's."""
    names = [k for k in next(iter(sweep.values()))["us"] if all(k in v["us"] for v in sweep.values())]
    score = {k: math.exp(sum(math.log(v["us"][k]) for v in sweep.values()) / len(sweep)) for k in names}
    ranked = sorted(names, key=score.get)
    print("best overall:", [(k, round(score[k], 2)) for k in ranked[:6]])
    best = next(k for k in ranked if k != "cublas")
    for name, v in sweep.items():
        print(f"  {name:28s} floor {v['floor_us']:6.1f}  {best} {v['us'][best]:6.2f}  cuBLAS {v['us']['cublas']:6.2f}")


def knobs(cfg) -> dict:
    """few_rows_linear's tile keywords for a sweep entry: a DotTile, or (BN, BK, warps, _, _) of the
    one-row kernel."""
    if isinstance(cfg, DotTile):
        return cfg._asdict()
    bn, bk, w = cfg[:3]
    return dict(block_n=bn, block_k=bk, warps=w)


def config_name(cfg) -> str:
    if isinstance(cfg, DotTile):
        return f"{cfg.block_n}x{cfg.block_k}w{cfg.warps}s{cfg.stages}p{cfg.programs}"
    return "{}x{}w{}".format(*cfg[:3])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--in-graph", action="store_true", help="sweep tiles inside CUDA graphs instead")
    ap.add_argument("--rows", default="1", help="rows of x in the in-graph sweep, comma-separated (> 1: the dot path and cuBLAS)")
    args = ap.parse_args(argv)
    timer = Timer(args.reps, warmup=3)
    bw = copy_bandwidth(timer)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    if args.in_graph:
        sweeps = {}
        for rows in map(int, args.rows.split(",")):
            print(f"--- {rows} row(s)")
            sweeps[rows] = in_graph_sweep(bw, rows)
            if rows > 1:
                print_best_overall(sweeps[rows])
        with open(args.out, "w") as f:
            json.dump(dict(copy_bandwidth_GBps=bw / 1e9, in_graph=sweeps), f, indent=1)
        return
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
