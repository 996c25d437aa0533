"""A few 64-node batch-1 tree scans and one-token decode updates at a layer shape, for Nsight
Compute (BENCHMARKS.md, third round):

    ncu --clock-control none --kernel-name regex:"_tree_ssd_kernel|_chain_update" --launch-skip 4 \\
        --launch-count 3 --section SpeedOfLight --section WarpStateStats --section LaunchStats \\
        --section Occupancy python3 -m bench.scan_probe mamba2-2.7b
"""
import random
import sys

import torch

from bench.ssm_kernels import chain_inputs, random_tree, tree_inputs
from kernels.ssd_tree import tree_ssd_scan
from kernels.ssm_decode import ssm_chain_update


def main(shapes) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rng = random.Random(0)
    for shape in shapes:
        args = tree_inputs(shape, [random_tree(64, rng)], gen, slots=4)
        for _ in range(6):
            tree_ssd_scan(**args)
        step = chain_inputs(shape, 1, 1, gen, slots=4)
        for _ in range(6):
            ssm_chain_update(**step)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:] or ["mamba2-2.7b"])
