"""SSM kernel benchmark on CUDA at the Mamba2-2.7B and 8B-hybrid layer shapes (design §9).

    python -m bench.ssm_kernels --out FILE.json [--reps 200] [--warmup 20]

Method. Every number is the median over `--reps` timed calls, after `--warmup` untimed ones. Each
timed call is bracketed by CUDA events and preceded by (1) writing a 256 MiB buffer, which evicts
the 50 MB L2 so the state is read from HBM as it is in a 64-layer model, and (2) a GPU sleep long
enough that the host has queued the events and the kernel before the GPU reaches them, so host
launch overhead is not measured. The *floor* of a kernel is the bytes it must move (unique
reads + writes; bf16 activations, fp32 state) divided by the device-to-device copy bandwidth
measured in the same run (a 1 GiB `copy_`, counted as read + write). `x floor` = time / floor.

Rows: one-token decode and K = 4 chain updates; the tree scan at N = 1, 4, 16, 64, 128 nodes (and
a batch of 16 64-node trees) as the model calls it, with the per-forward ancestor bits passed in,
its ratio to a one-token decode of the same layer and batch counting 1/layers of the bits' build
(the build is also timed on its own, and so is a standalone scan that builds its own bits); a small
sweep of the scan's launch configuration (headdim block, warps, register cap); the PyTorch twin;
verifying every root-to-leaf path of the same tree as separate chains (state copied to one scratch
slot per leaf, then one chain update over all leaves); commit; prefill.
Targets: memory-bound kernels within 1.5x of the floor; a 64-node tree scan within 1.2x of decode.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import triton

from kernels.ssd_prefill import ssd_prefill, ssd_prefill_ref
from kernels.ssd_tree import tree_ssd_scan, tree_ssd_scan_ref
from kernels.ssm_commit import ssm_state_commit
from kernels.ssm_decode import ssm_chain_update
from kernels.tree_struct import ancestor_bits

SHAPES = {"mamba2-2.7b": (80, 64, 128, 1), "hybrid-8b": (32, 128, 128, 32)}  # (H, P, N, G)
MAMBA_LAYERS = {"mamba2-2.7b": 64, "hybrid-8b": 16}  # Mamba2 layers per forward (bench.model_runtime's shapes)
# tree-scan launch configurations timed next to the default, (headdim block, warps, register cap or 0),
# at these (batch, nodes)
SCAN_CONFIGS = [(32, 8, 0), (32, 8, 128), (64, 8, 0), (32, 4, 0), (64, 4, 0), (64, 16, 0), (32, 16, 0)]
SWEEP_AT = {(1, 16), (1, 64), (1, 128), (16, 64)}
TREE_SIZES = (1, 4, 16, 64, 128)
PREFILL_LEN = 2048
LIMIT = (0.0, float("inf"))
DEV = "cuda"
ACT = torch.bfloat16
ACT_BYTES = 2
STATE_BYTES = 4


class Timer:
    """Median GPU time of a callable, L2 flushed and host overhead hidden (see module docstring)."""

    def __init__(self, reps: int, warmup: int, sleep_cycles: int = 200_000):
        self.reps = reps
        self.warmup = warmup
        self.sleep_cycles = sleep_cycles
        self.flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=DEV)

    def __call__(self, fn, reps: int | None = None) -> float:
        reps = reps or self.reps
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for s, e in zip(starts, ends):
            self.flush.zero_()
            torch.cuda._sleep(self.sleep_cycles)
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3  # microseconds


def copy_bandwidth(timer: Timer) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the read and the write."""
    n = 2**30
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    us = timer(lambda: dst.copy_(src), reps=30)
    del src, dst
    return 2 * n / (us * 1e-6)


def start(reps: int, warmup: int) -> tuple[Timer, "Report"]:
    """The timer of a run and its report, against the copy bandwidth measured now (printed)."""
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    timer = Timer(reps, warmup)
    bw = copy_bandwidth(timer)
    print(f"{torch.cuda.get_device_name()}: device-to-device copy {bw / 1e12:.3f} TB/s (read + write)\n")
    return timer, Report(bw)


def layer(H: int, gen: torch.Generator):
    A = -(torch.rand(H, generator=gen, device=DEV) * 3 + 0.5)
    D = torch.randn(H, generator=gen, device=DEV)
    dt_bias = torch.randn(H, generator=gen, device=DEV) * 0.5 - 2.0
    return A, D, dt_bias


def randn(gen, *shape, dtype=ACT):
    return torch.randn(*shape, generator=gen, device=DEV).to(dtype)


def random_tree(n: int, rng: random.Random) -> list[int]:
    """Parents of a random recursive tree of n nodes (node i hangs under a uniform earlier node)."""
    return [-1] + [rng.randrange(i) for i in range(1, n)]


def root_to_leaf_paths(parents: list[int]) -> list[list[int]]:
    has_child = set(p for p in parents if p >= 0)
    paths = []
    for leaf in (i for i in range(len(parents)) if i not in has_child):
        path, i = [], leaf
        while i >= 0:
            path.append(i)
            i = parents[i]
        paths.append(path[::-1])
    return paths


def tree_inputs(shape, trees: list[list[int]], gen, slots: int):
    H, P, N, G = SHAPES[shape]
    T = sum(len(t) for t in trees)
    A, D, dt_bias = layer(H, gen)
    cu = [0]
    for t in trees:
        cu.append(cu[-1] + len(t))
    return dict(
        x=randn(gen, T, H, P), dt=randn(gen, T, H), A=A, B=randn(gen, T, G, N), C=randn(gen, T, G, N), D=D,
        dt_bias=dt_bias, ssm_state=randn(gen, slots, H, P, N, dtype=torch.float32),
        parents=torch.tensor([p for t in trees for p in t], dtype=torch.int32, device=DEV),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=DEV),
        slot_idx=torch.arange(len(trees), dtype=torch.int32, device=DEV),
        max_nodes=max(len(t) for t in trees), dt_limit=LIMIT, z=randn(gen, T, H, P),
    )


def chain_inputs(shape, nb: int, K: int, gen, slots: int):
    H, P, N, G = SHAPES[shape]
    A, D, dt_bias = layer(H, gen)
    return dict(
        ssm_state=randn(gen, slots, H, P, N, dtype=torch.float32),
        slot_idx=torch.arange(nb, dtype=torch.int32, device=DEV), x=randn(gen, nb, K, H, P),
        dt=randn(gen, nb, K, H), A=A, B=randn(gen, nb, K, G, N), C=randn(gen, nb, K, G, N), D=D, dt_bias=dt_bias,
        dt_limit=LIMIT, z=randn(gen, nb, K, H, P),
    )


def state_bytes(shape, n_states: int) -> int:
    H, P, N, _ = SHAPES[shape]
    return n_states * H * P * N * STATE_BYTES


def token_bytes(shape, tokens: int, with_c: bool = True, with_y: bool = True) -> int:
    """Activation bytes of `tokens` tokens: x, z (and y written), dt, B (and C)."""
    H, P, N, G = SHAPES[shape]
    per = (2 + with_y) * H * P + H + (1 + with_c) * G * N
    return tokens * per * ACT_BYTES


class Report:
    def __init__(self, bandwidth: float):
        self.bandwidth = bandwidth
        self.rows: list[dict] = []

    def add(self, shape, kernel, batch, size, us, nbytes, **extra) -> dict:
        floor = nbytes / self.bandwidth * 1e6 if nbytes else None
        row = dict(shape=shape, kernel=kernel, batch=batch, size=size, time_us=round(us, 2),
                   bytes=nbytes, floor_us=None if floor is None else round(floor, 2),
                   x_floor=None if floor is None else round(us / floor, 2), **extra)
        self.rows.append(row)
        return row

    def print(self) -> None:
        head = (f"{'shape':<12} {'kernel':<22} {'batch':>5} {'size':>5} {'time us':>9} {'MB':>8} {'floor us':>9} "
                f"{'x floor':>8}  note")
        print(head)
        print("-" * len(head))
        for r in self.rows:
            mb = f"{r['bytes'] / 1e6:8.2f}" if r["bytes"] else f"{'':>8}"
            fl = f"{r['floor_us']:9.2f}" if r["floor_us"] is not None else f"{'':>9}"
            xf = f"{r['x_floor']:8.2f}" if r["x_floor"] is not None else f"{'':>8}"
            print(f"{r['shape']:<12} {r['kernel']:<22} {r['batch']:>5} {r['size']:>5} {r['time_us']:9.2f} {mb} {fl} {xf}  "
                  f"{r.get('note', '')}")


def bench_shape(shape: str, timer: Timer, rep: Report, seed: int) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(seed)
    rng = random.Random(seed)
    summary = {}

    # decode (K = 1) and K = 4 chain updates
    decode_us = {}
    for nb in (1, 16):
        for K in (1, 4):
            a = chain_inputs(shape, nb, K, gen, slots=nb)
            us = timer(lambda: ssm_chain_update(**a))
            nbytes = 2 * state_bytes(shape, nb) + token_bytes(shape, nb * K)
            rep.add(shape, "decode" if K == 1 else "chain_update", nb, K, us, nbytes)
            if K == 1:
                decode_us[nb] = us

    # tree scan at several sizes, batch 1, and a batch of 16 64-node trees, timed as the model runs it:
    # the ancestor bits are built once per forward and shared by every Mamba layer, so a layer pays
    # the scan plus 1/layers of the build (both also reported on their own)
    layers = MAMBA_LAYERS[shape]
    for nb, n in [(1, n) for n in TREE_SIZES] + [(16, 64)]:
        trees = [random_tree(n, rng) for _ in range(nb)]
        a = tree_inputs(shape, trees, gen, slots=nb)
        struct = (a["parents"], a["cu_seqlens"], a["max_nodes"])
        bits = ancestor_bits(*struct)
        build_us = timer(lambda: ancestor_bits(*struct))
        rep.add(shape, "ancestor_bits", nb, n, build_us, None,
                note=f"once per forward = {build_us / layers:.2f} us per layer over {layers} Mamba layers")
        us = timer(lambda: tree_ssd_scan(**a, ancestors=bits))
        per_layer = us + build_us / layers
        nbytes = state_bytes(shape, nb) + token_bytes(shape, nb * n)
        ratio = per_layer / decode_us[nb]
        note = f"{ratio:.2f}x decode with build/{layers}"
        if n == 64:
            note += " (target <= 1.2)"
            summary[f"tree64_vs_decode_batch{nb}"] = round(ratio, 3)
        rep.add(shape, "tree_ssd_scan", nb, n, us, nbytes, per_layer_us=round(per_layer, 2), x_decode=round(ratio, 3),
                note=note)
        alone_us = timer(lambda: tree_ssd_scan(**a))
        rep.add(shape, "scan building its bits", nb, n, alone_us, None,
                note="a standalone call: build + scan, two launches")
        for bp, warps, regs in SCAN_CONFIGS if (nb, n) in SWEEP_AT else ():
            cfg_us = timer(lambda: tree_ssd_scan(**a, ancestors=bits, block_p=bp, num_warps=warps, maxnreg=regs))
            rep.add(shape, f"scan bp{bp} w{warps} regs{regs or '-'}", nb, n, cfg_us, None,
                    x_default=round(cfg_us / us, 3), note=f"tuning sweep: {cfg_us / us:.2f}x the default launch")

        if nb == 1 and n in (16, 64, 128):
            ref_us = timer(lambda: tree_ssd_scan_ref(**a, ancestors=bits), reps=max(5, timer.reps // 20))
            rep.add(shape, "tree_ssd_scan_ref", nb, n, ref_us, None, x_triton=round(ref_us / us, 2),
                    note=f"{ref_us / us:.1f}x the Triton scan")
            # the same tree verified as one chain per root-to-leaf path (fresh state copy per path)
            paths = root_to_leaf_paths(trees[0])
            K = max(len(p) for p in paths)
            rows = torch.tensor([p + [p[-1]] * (K - len(p)) for p in paths], device=DEV).long()
            H, P, N, G = SHAPES[shape]
            scratch = torch.empty(len(paths), H, P, N, device=DEV)
            slots = torch.arange(len(paths), dtype=torch.int32, device=DEV)
            px, pdt, pB, pC, pz = (a[k][rows] for k in ("x", "dt", "B", "C", "z"))

            def per_path():
                scratch.copy_(a["ssm_state"][0].expand_as(scratch))
                ssm_chain_update(scratch, slots, px, pdt, a["A"], pB, pC, a["D"], a["dt_bias"], LIMIT, z=pz)

            path_us = timer(per_path)
            rep.add(shape, "paths_as_chains", nb, n, path_us, None, leaves=len(paths), max_depth=K,
                    x_tree=round(path_us / us, 3),
                    note=f"{len(paths)} paths, depth {K}: {path_us / us:.2f}x the tree scan")
            summary[f"paths_vs_tree_{n}"] = round(path_us / us, 3)

    # commit of accepted paths (K = 8 slots, 6 accepted)
    for nb in (1, 16):
        H, P, N, G = SHAPES[shape]
        K, acc = 8, 6
        pool = randn(gen, nb, H, P, N, dtype=torch.float32)
        A, _, dt_bias = layer(H, gen)
        args = (pool, torch.arange(nb, dtype=torch.int32, device=DEV), randn(gen, nb * K, H, P),
                randn(gen, nb * K, H), randn(gen, nb * K, G, N), torch.arange(nb * K, device=DEV).view(nb, K),
                torch.full((nb,), acc, dtype=torch.int32, device=DEV), A, dt_bias, LIMIT)
        us = timer(lambda: ssm_state_commit(*args))
        nbytes = 2 * state_bytes(shape, nb) + nb * acc * (H * P + H + G * N) * ACT_BYTES
        rep.add(shape, "ssm_state_commit", nb, acc, us, nbytes)

    # prefill of one 2048-token prompt
    H, P, N, G = SHAPES[shape]
    L = PREFILL_LEN
    A, D, dt_bias = layer(H, gen)
    pf = dict(x=randn(gen, L, H, P), dt=randn(gen, L, H), A=A, B=randn(gen, L, G, N), C=randn(gen, L, G, N), D=D,
              dt_bias=dt_bias, dt_limit=LIMIT, initial_state=randn(gen, H, P, N, dtype=torch.float32),
              z=randn(gen, L, H, P))
    us = timer(lambda: ssd_prefill(**pf), reps=max(20, timer.reps // 5))
    nbytes = token_bytes(shape, L) + 2 * state_bytes(shape, 1)
    rep.add(shape, "ssd_prefill", 1, L, us, nbytes, note="floor: inputs/outputs only (compute-bound)")
    ref_us = timer(lambda: ssd_prefill_ref(**pf), reps=10)
    rep.add(shape, "ssd_prefill_ref", 1, L, ref_us, None, note=f"{ref_us / us:.1f}x the Triton prefill")
    return summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="JSON file to write")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    timer, rep = start(args.reps, args.warmup)
    bw = rep.bandwidth
    summary = {}
    t0 = time.time()
    for shape in args.shapes.split(","):
        summary[shape] = bench_shape(shape, timer, rep, args.seed)
    rep.print()
    print("\nsummary:", json.dumps(summary))

    result = dict(
        device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
        copy_bandwidth_bytes_per_s=bw, reps=args.reps, warmup=args.warmup, seconds=round(time.time() - t0, 1),
        method=__doc__.split("\n\n")[2], rows=rep.rows, summary=summary,
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
