"""A Mamba2 layer's verify pass between its projections: one launch (`kernels.conv_ssd_tree`) against
the three it replaces (tree conv, tree scan, stash copy), at the layer shapes of design §9.

    python -m bench.conv_scan --out FILE.json [--reps 200]

Two timings per row, both medians of CUDA-event times:
- `cold`: one call after evicting L2 and with the host's launches queued behind a GPU sleep
  (`bench.ssm_kernels.Timer`): every input comes from HBM, no launch overhead;
- `graph`: a CUDA graph of 32 back-to-back calls (programmatic dependent launch on, as in the model),
  replay time / 32: inputs hot in L2, as they are after the layer's in_proj.
Rows: batch 1 at 1, 4, 8, 16, 32, 64 nodes and batches of 4, 16, 64 16-node trees; the one launch
is timed at 4 and 8 warps and, past 16 nodes, at any size (`FUSED_MAX_NODES` raised) to show why
it stops there.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics

import torch

from bench.ssm_kernels import ACT, DEV, SHAPES, Timer, layer, randn, random_tree
from kernels import conv_ssd_tree
from kernels.tree_struct import ancestor_bits

W = 4
ROWS = [(1, 1), (1, 4), (1, 8), (1, 16), (1, 32), (1, 64), (4, 16), (16, 16), (64, 16)]
GRAPH_CALLS = 32


def inputs(shape: str, batch: int, nodes: int, gen, rng) -> dict:
    H, P, N, G = SHAPES[shape]
    conv_dim = H * P + 2 * G * N
    trees = [random_tree(nodes, rng) for _ in range(batch)]
    T = batch * nodes
    A, D, dt_bias = layer(H, gen)
    cu = torch.arange(0, T + 1, nodes, dtype=torch.int32, device=DEV)
    parents = torch.tensor([p for t in trees for p in t], dtype=torch.int32, device=DEV)
    slots = batch + 1
    return dict(
        xbc_dt=randn(gen, T, conv_dim + H), conv_weight=randn(gen, conv_dim, W) * 0.5, conv_bias=randn(gen, conv_dim),
        conv_state=randn(gen, slots, conv_dim, W - 1), A=A, D=D, dt_bias=dt_bias,
        ssm_state=randn(gen, slots, H, P, N, dtype=torch.float32), parents=parents, cu_seqlens=cu,
        slot_idx=torch.arange(batch, dtype=torch.int32, device=DEV), max_nodes=nodes, dt_limit=(0.0, float("inf")),
        stash_raw=torch.empty(T, conv_dim + H, dtype=ACT, device=DEV),
        stash_xB=torch.empty(T, H * P + G * N, dtype=ACT, device=DEV),
        ancestors=ancestor_bits(parents, cu, nodes),
    )


def in_graph_us(fn, reps: int = 15) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(GRAPH_CALLS):
            fn()
    for _ in range(3):
        g.replay()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        g.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1e3 / GRAPH_CALLS)
    return statistics.median(times)


def variants(nodes: int):
    """(name, FUSED_MAX_NODES, num_warps) to time at this tree size."""
    out = [("separate", 0, None)]
    for warps in (4, 8):
        out.append((f"one launch, {warps} warps", 64, warps))
    return out if nodes <= 64 else out[:1]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="conv_scan.json")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args(argv)
    timer = Timer(args.reps, args.warmup)
    gen = torch.Generator(device=DEV).manual_seed(0)
    rng = random.Random(0)
    rows = []
    default_limit = conv_ssd_tree.FUSED_MAX_NODES
    try:
        for shape in SHAPES:
            for batch, nodes in ROWS:
                a = inputs(shape, batch, nodes, gen, rng)
                outs = {}
                for name, limit, warps in variants(nodes):
                    conv_ssd_tree.FUSED_MAX_NODES = limit

                    def call(a=a, warps=warps):
                        return conv_ssd_tree.tree_conv_ssd_scan(**a, num_warps=warps)

                    outs[name] = (call(), a["stash_xB"].clone())
                    row = dict(shape=shape, batch=batch, nodes=nodes, variant=name, cold_us=timer(call),
                               graph_us=in_graph_us(call))
                    rows.append(row)
                    print(f"{shape:12s} batch {batch:3d} nodes {nodes:3d}  {name:22s} cold {row['cold_us']:7.2f} us  "
                          f"graph {row['graph_us']:7.2f} us", flush=True)
                base_y, base_xB = outs["separate"]
                for name, (y, xB) in outs.items():
                    # same inputs, same rounding of the conv: the outputs agree to the scan's own noise
                    err = ((y.float() - base_y.float()).abs().max() / base_y.float().abs().max()).item()
                    same_xB = torch.equal(xB, base_xB)
                    for r in rows:
                        if (r["shape"], r["batch"], r["nodes"], r["variant"]) == (shape, batch, nodes, name):
                            r.update(max_rel_diff_vs_separate=err, stash_identical=same_xB)
    finally:
        conv_ssd_tree.FUSED_MAX_NODES = default_limit
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)
    with open(args.out, "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps([{k: r[k] for k in ("shape", "batch", "nodes", "variant", "max_rel_diff_vs_separate",
                                         "stash_identical")} for r in rows if r["variant"] != "separate"]))


if __name__ == "__main__":
    main()
