"""A Mamba2 layer's state kernels at serving batch sizes, on CUDA: what a verifier step pays per
layer besides the projections, at 1, 16 and 64 sequences with 16-node trees.

    python -m bench.batch_kernels --out FILE.json [--batches 1,16,64] [--shapes ...] [--sweep]

Rows, per shape (Mamba2-2.7B and the 8B hybrid's Mamba2 layers, DESIGN.md §9; the 8B layer has 8
groups, which its conv width of 6144 implies):
- `tree_conv1d`: the verify's tree conv as the model runs it, keeping the raw xBC | dt and
  writing its output into the stash rows of its layer;
- `tree_ssd_scan`: the verify's tree scan with its gate, ancestor bits passed in, in the launch the
  scan picks (persistent programs for serving batches, `ssd_tree.persistent_programs_per_sm`)
  and with one program per tile;
- `tree_ssd_scan_deferred_norm`: the same with the gated norm less its scale (what a Mamba2 verify
  runs), both launches;
- `ssm_state_commit` and `conv_state_commit`: a commit of paths of 1-4 accepted nodes of every
  Mamba2 layer in one launch, reading the stash rows in place as the model's commit does, reported
  per layer;
- `decode`: a one-token state update at the same batch, for scale.

Timing is `bench.ssm_kernels.Timer`: L2 evicted before each call, host launch hidden, median. The
floor is each kernel's unique bytes (state fp32 read, and written where it is updated; bf16
activations) over the copy bandwidth of the same run. `--sweep` adds launch-configuration variants.
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch
import triton

from bench.ssm_kernels import Report, Timer, layer, randn, start
from kernels.conv_tree import conv_state_commit, tree_conv1d
from kernels.ssd_tree import tree_ssd_scan, tree_ssd_scan_deferred_norm
from kernels.ssm_commit import ssm_state_commit
from kernels.ssm_decode import ssm_chain_update
from kernels.tree_struct import ancestor_bits

# (heads, headdim, d_state, groups, Mamba2 layers per forward)
SHAPES = {"mamba2-2.7b": (80, 64, 128, 1, 64), "hybrid-8b": (32, 128, 128, 8, 16)}
W = 4  # conv width
NODES = 16  # tree size of the verifier benchmark
PATH = 4  # commit path bucket: accepted paths of 1..4 nodes
LIMIT = (0.0, float("inf"))
KERNELS = ("conv", "scan", "decode", "commit")
DEV = "cuda"

SCAN_SWEEP = [(32, 64, 4, 0), (64, 128, 4, 0), (64, 64, 4, 96), (64, 64, 4, 80), (64, 64, 4, 64), (64, 128, 4, 96),
              (64, 32, 4, 64), (128, 64, 8, 0)]  # (headdim block, d_state block, warps, register cap or 0)
CONV_SWEEP = [(16, 128, 4), (16, 128, 2), (16, 64, 2), (16, 256, 4), (8, 128, 4), (8, 128, 2), (8, 256, 4), (8, 64, 2),
              (8, 128, 1), (4, 128, 2), (4, 256, 2), (4, 128, 1)]  # (node block, channel block, warps)
COMMIT_SWEEP = [(8, 4), (16, 4), (32, 4), (32, 8), (64, 8)]  # (headdim block, warps)


def bushy_tree(n: int, rng: random.Random) -> list[int]:
    """Parents of a random tree whose nodes hang under one of the last few (depth about n / 3)."""
    return [-1] + [rng.randrange(max(0, i - 3), i) for i in range(1, n)]


def bench_shape(shape: str, batches, timer: Timer, rep: Report, sweep: bool, seed: int, kernels=KERNELS) -> None:
    H, P, N, G, layers = SHAPES[shape]
    d_inner = H * P
    conv_dim = d_inner + 2 * G * N
    gen = torch.Generator(device=DEV).manual_seed(seed)
    rng = random.Random(seed)
    for nb in batches:
        T = nb * NODES
        parents = torch.tensor([p for _ in range(nb) for p in bushy_tree(NODES, rng)], dtype=torch.int32, device=DEV)
        cu = torch.arange(0, T + 1, NODES, dtype=torch.int32, device=DEV)
        slots = torch.arange(nb, dtype=torch.int32, device=DEV)
        lens = torch.full((nb,), 130, dtype=torch.int32, device=DEV)

        # tree conv writing the stash, as a verify runs it: xbc | dt in, kept raw, and the output
        # written into the stash rows of its layer
        xbc_dt = randn(gen, T, conv_dim + H)
        weight, bias = randn(gen, conv_dim, W), randn(gen, conv_dim)
        conv_state = randn(gen, nb, conv_dim, W)  # rings; a conv reads W-1 of the W columns
        out = torch.empty(T, 2, conv_dim, dtype=xbc_dt.dtype, device=DEV)[:, 1]
        raw = torch.empty(T, 2, conv_dim + H, dtype=xbc_dt.dtype, device=DEV)[:, 1]

        def conv(**kw):
            tree_conv1d(xbc_dt, weight, bias, conv_state, parents, cu, slots, lens, NODES, out=out, stash=raw, **kw)

        nbytes = 2 * (2 * xbc_dt.numel() + out.numel() + conv_state.numel() * (W - 1) // W)
        us = timer(conv) if "conv" in kernels else None
        if us is not None:
            rep.add(shape, "tree_conv1d", nb, NODES, us, nbytes)
        for bt, bd, warps in CONV_SWEEP if sweep and us is not None else ():
            cfg = timer(lambda: conv(block_t=bt, block_d=bd, num_warps=warps))
            rep.add(shape, f"conv t{bt} d{bd} w{warps}", nb, NODES, cfg, nbytes, x_default=round(cfg / us, 3))

        # tree scan with the gate, bits built once per forward
        A, D, dt_bias = layer(H, gen)
        scan_args = dict(
            x=randn(gen, T, H, P), dt=randn(gen, T, H), A=A, B=randn(gen, T, G, N), C=randn(gen, T, G, N), D=D,
            dt_bias=dt_bias, ssm_state=randn(gen, nb, H, P, N, dtype=torch.float32), parents=parents, cu_seqlens=cu,
            slot_idx=slots, max_nodes=NODES, dt_limit=LIMIT, z=randn(gen, T, H, P),
        )
        bits = ancestor_bits(parents, cu, NODES)
        state = nb * H * P * N * 4
        nbytes = state + T * (3 * d_inner + H + 2 * G * N) * 2
        us = timer(lambda: tree_ssd_scan(**scan_args, ancestors=bits)) if "scan" in kernels else None
        if us is not None:
            rep.add(shape, "tree_ssd_scan", nb, NODES, us, nbytes)
            one = timer(lambda: tree_ssd_scan(**scan_args, ancestors=bits, programs_per_sm=0))
            rep.add(shape, "scan, one program per tile", nb, NODES, one, nbytes, x_default=round(one / us, 3))
            # what a Mamba2 verify runs: the gated norm less its scale in the epilogue
            w = randn(gen, d_inner)
            norm_us = {ppsm: timer(lambda: tree_ssd_scan_deferred_norm(**scan_args, norm_weight=w, norm_eps=1e-5,
                                                                       ancestors=bits, programs_per_sm=ppsm))
                       for ppsm in (None, 0)}
            rep.add(shape, "tree_ssd_scan_deferred_norm", nb, NODES, norm_us[None], nbytes)
            rep.add(shape, "deferred norm, one program per tile", nb, NODES, norm_us[0], nbytes,
                    x_default=round(norm_us[0] / norm_us[None], 3))
        for bp, bn, warps, regs in [c for c in SCAN_SWEEP if c[0] <= P] if sweep and us is not None else ():
            cfg = timer(lambda: tree_ssd_scan(**scan_args, ancestors=bits, block_p=bp, block_n=bn, num_warps=warps,
                                              maxnreg=regs))
            rep.add(shape, f"scan p{bp} n{bn} w{warps} r{regs or '-'}", nb, NODES, cfg, nbytes,
                    x_default=round(cfg / us, 3))

        # one-token decode update at the same batch
        if "decode" in kernels:
            dec = dict(ssm_state=randn(gen, nb, H, P, N, dtype=torch.float32), slot_idx=slots,
                       x=randn(gen, nb, 1, H, P), dt=randn(gen, nb, 1, H), A=A, B=randn(gen, nb, 1, G, N),
                       C=randn(gen, nb, 1, G, N), D=D, dt_bias=dt_bias, dt_limit=LIMIT, z=randn(gen, nb, 1, H, P))
            us = timer(lambda: ssm_chain_update(**dec))
            rep.add(shape, "decode", nb, 1, us, 2 * state + nb * (3 * d_inner + H + 2 * G * N) * 2)
        if "commit" not in kernels:
            continue

        # the commit of every Mamba2 layer in one launch, reading a verify's stash rows in place, as
        # `models.verify.run_commit` calls it
        plen = torch.randint(1, PATH + 1, (nb,), generator=gen, device=DEV, dtype=torch.int32)
        pool = randn(gen, nb, layers, H, P, N, dtype=torch.float32)
        A_all = -(torch.rand(layers, H, generator=gen, device=DEV) * 3 + 0.5)
        bias_all = torch.randn(layers, H, generator=gen, device=DEV) * 0.5 - 2.0
        xBC = randn(gen, T, layers, conv_dim)  # the stash: a 16-node tree per sequence
        xbc_dt = randn(gen, T, layers, conv_dim + H)
        x, Bp = xBC[..., :d_inner].unflatten(-1, (H, P)), xBC[..., d_inner : d_inner + G * N].unflatten(-1, (G, N))
        xbc, dt = xbc_dt[..., :conv_dim], xbc_dt[..., conv_dim:]
        rows = (torch.arange(nb, device=DEV)[:, None] * NODES + torch.arange(PATH, device=DEV)[None, :])
        accepted = int(plen.sum())
        nbytes = 2 * nb * layers * H * P * N * 4 + accepted * layers * (d_inner + H + G * N) * 2

        def commit(**kw):
            ssm_state_commit(pool, slots, x, dt, Bp, rows, plen, A_all, bias_all, LIMIT, **kw)

        us = timer(commit, reps=max(10, timer.reps // 4))
        rep.add(shape, "ssm_state_commit", nb, PATH, us / layers, nbytes / layers,
                note=f"one launch over {layers} layers, per layer")
        for bp, warps in [c for c in COMMIT_SWEEP if c[0] <= P] if sweep else ():
            cfg = timer(lambda: commit(block_p=bp, num_warps=warps), reps=max(10, timer.reps // 4))
            rep.add(shape, f"commit p{bp} w{warps}", nb, PATH, cfg / layers, nbytes / layers,
                    x_default=round(cfg / us, 3))

        cstate = randn(gen, nb, layers, conv_dim, W)
        # the last min(k, W) accepted inputs read from the stash and written into the rings
        nbytes = 2 * 2 * sum(min(int(k), W) for k in plen.tolist()) * layers * conv_dim
        us = timer(lambda: conv_state_commit(cstate, slots, xbc, rows, plen, lens))
        rep.add(shape, "conv_state_commit", nb, PATH, us / layers, nbytes / layers,
                note=f"one launch over {layers} layers, per layer")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="also time launch-configuration variants")
    ap.add_argument("--kernels", default=",".join(KERNELS), help="which rows, of " + ",".join(KERNELS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    timer, rep = start(args.reps, args.warmup)
    t0 = time.time()
    batches = [int(b) for b in args.batches.split(",")]
    for shape in args.shapes.split(","):
        bench_shape(shape, batches, timer, rep, args.sweep, args.seed, args.kernels.split(","))
    rep.print()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  copy_bandwidth_bytes_per_s=rep.bandwidth, reps=args.reps, seconds=round(time.time() - t0, 1),
                  rows=rep.rows)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
