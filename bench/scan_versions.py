"""The tree scan against an earlier version of itself, on the same inputs in one run.

    git show REV:kernels/ssd_tree.py > /tmp/ssd_tree_old.py     # where git is (the GPU host may lack it)
    python -m bench.scan_versions --old /tmp/ssd_tree_old.py --out FILE.json

Both layer shapes of bench.ssm_kernels, trees of 1..128 nodes at batch 1 and batches of 16 trees of
16 and 64 nodes; each row gives both times (µs, bench.ssm_kernels' Timer: L2 evicted, host launch
hidden, median), their ratios to a one-token decode update of the same layer and batch, and the
relative L2 difference of the two outputs (the old version is the reference).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import random

import torch

from bench.ssm_kernels import SHAPES, Timer, chain_inputs, copy_bandwidth, random_tree, tree_inputs
from kernels import ssd_tree
from kernels.ssm_decode import ssm_chain_update
from kernels.tree_struct import ancestor_bits

CASES = [(1, 1), (1, 4), (1, 16), (1, 32), (1, 64), (1, 128), (16, 16), (16, 64)]  # (trees, nodes each)


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("ssd_tree_old", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="a copy of an earlier kernels/ssd_tree.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    old = load_module(args.old)
    timer = Timer(args.reps, 20)
    bw = copy_bandwidth(timer)
    print(f"{torch.cuda.get_device_name()}: copy {bw / 1e12:.3f} TB/s")
    rows = []
    for shape in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(0)
        rng = random.Random(0)
        decode = {}
        for nb in (1, 16):
            a = chain_inputs(shape, nb, 1, gen, slots=nb)
            decode[nb] = timer(lambda: ssm_chain_update(**a))
        for nb, n in CASES:
            t = tree_inputs(shape, [random_tree(n, rng) for _ in range(nb)], gen, slots=nb)
            bits = ancestor_bits(t["parents"], t["cu_seqlens"], t["max_nodes"])
            y_old = old.tree_ssd_scan(**t, ancestors=bits).float()
            y_new = ssd_tree.tree_ssd_scan(**t, ancestors=bits).float()
            us_old = timer(lambda: old.tree_ssd_scan(**t, ancestors=bits))
            us_new = timer(lambda: ssd_tree.tree_ssd_scan(**t, ancestors=bits))
            row = dict(shape=shape, trees=nb, nodes=n, old_us=round(us_old, 2), new_us=round(us_new, 2),
                       decode_us=round(decode[nb], 2), old_x_decode=round(us_old / decode[nb], 3),
                       new_x_decode=round(us_new / decode[nb], 3),
                       rel_diff=((y_new - y_old).norm() / y_old.norm()).item())
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), copy_bandwidth_bytes_per_s=bw, old=args.old, rows=rows),
                  f, indent=1)


if __name__ == "__main__":
    main()
