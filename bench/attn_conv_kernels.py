"""Timings of the tree conv and tree attention kernels against their memory floor.

    python -m bench.attn_conv_kernels --out attn_conv.json [--sweep]

Every kernel is timed with CUDA events around CUDA-graph replays of `--inner` back-to-back calls
(so Python launch overhead is excluded), after warm-up; the median over `--reps` replays is reported.
The floor of a kernel is the bytes it must move (each input read once, each output written once)
divided by the device-to-device copy bandwidth measured in the same run (bytes read + written per
second), and `ratio = time / floor`. Kernels whose floor is below a few microseconds are latency
bound (launch and tail effects dominate); the table marks them.

Tree attention runs at N = 1, 16, 64 nodes, prefix 512 and 2048, batch 1 and 16 (32 q / 8 kv heads x
128, bf16), next to one-token decode attention (`torch.nn.functional.scaled_dot_product_attention`
with GQA on a (B, Hkv, L, Dh) cache, one query per sequence). `--sweep` also times a grid of
`num_splits` x `block_kv` x `num_warps` (x `block_m` for big trees) for each attention case and
reports the best.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics

import torch
import torch.nn.functional as F

from kernels import conv_tree as ct
from kernels import tree_attention as ta
from tests.kernels.tree_cases import packed_batch

DEV = "cuda"
BF = torch.bfloat16
LATENCY_BOUND_US = 5.0


def _events_ms(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def time_us(fn, reps: int = 30, inner: int = 20, warmup: int = 3) -> tuple[float, bool]:
    """(median microseconds per call, whether a CUDA graph was used)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            fn()  # warm the graph pool's allocations on the capture stream
            with torch.cuda.graph(graph, stream=stream):
                for _ in range(inner):
                    fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
        return 1000.0 * statistics.median(_events_ms(graph.replay, reps)) / inner, True
    except Exception:  # capture unsupported: fall back to eager launches (includes launch overhead)
        torch.cuda.synchronize()

        def loop():
            for _ in range(inner):
                fn()

        return 1000.0 * statistics.median(_events_ms(loop, reps)) / inner, False


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth, bytes (read + written) per second, on a 1 GiB buffer."""
    n = 1 << 29
    src = torch.empty(n, dtype=torch.int16, device=DEV).random_()
    dst = torch.empty_like(src)
    us, _ = time_us(lambda: dst.copy_(src), reps=20, inner=5)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / (us * 1e-6)


class Table:
    def __init__(self, bandwidth: float):
        self.bw = bandwidth
        self.rows: list[dict] = []

    def add(self, kernel: str, params: dict, us: float, nbytes: int, graphed: bool, **extra) -> dict:
        floor = nbytes / self.bw * 1e6
        row = dict(kernel=kernel, params=params, time_us=round(us, 3), bytes=int(nbytes), floor_us=round(floor, 3),
                   ratio=round(us / floor, 2) if floor > 0 else None, latency_bound=floor < LATENCY_BOUND_US,
                   cuda_graph=graphed, **extra)
        self.rows.append(row)
        p = " ".join(f"{k}={v}" for k, v in params.items())
        tag = " (latency-bound)" if row["latency_bound"] else ""
        more = "".join(f"  {k}={v}" for k, v in extra.items())
        print(f"{kernel:<22} {p:<44} {us:9.2f} us  floor {floor:8.2f} us  x{row['ratio']:<7}{tag}{more}", flush=True)
        return row


def _trees(batch: int, nodes: int, seed: int):
    kind = "single" if nodes == 1 else "random"
    return packed_batch([(nodes, kind)] * batch, random.Random(seed), device=DEV)


# ------------------------------------------------------------------------------------------ conv


def bench_conv(tab: Table, D: int, W: int = 4):
    e = 2
    gen = torch.Generator(device=DEV).manual_seed(D)
    S = 16
    weight = torch.randn(D, W, generator=gen, device=DEV).to(BF)
    bias = torch.randn(D, generator=gen, device=DEV).to(BF)
    state = torch.randn(S, D, W, generator=gen, device=DEV).to(BF)  # conv rings
    for batch in (1, 16):
        slots = torch.arange(batch, dtype=torch.int32, device=DEV)
        lens = torch.full((batch,), 130, dtype=torch.int32, device=DEV)
        for nodes in (1, 16, 64):
            parents, cu, max_nodes, _ = _trees(batch, nodes, nodes)
            T = int(cu[-1])
            xbc = torch.randn(T, D, generator=gen, device=DEV).to(BF)
            out = torch.empty_like(xbc)
            us, g = time_us(lambda: ct.tree_conv1d(xbc, weight, bias, state, parents, cu, slots, lens, max_nodes,
                                                   out=out))
            nbytes = 2 * T * D * e + D * (W + 1) * e + batch * D * (W - 1) * e
            tab.add("tree_conv1d", dict(D=D, B=batch, N=nodes), us, nbytes, g)
        K = 8
        xbc_rows = torch.randn(batch * K, D, generator=gen, device=DEV).to(BF)  # a verify's stash rows
        rows = torch.arange(batch * K, device=DEV).view(batch, K)
        path_len = torch.full((batch,), 5, dtype=torch.int32, device=DEV)
        us, g = time_us(lambda: ct.conv_state_commit(state, slots, xbc_rows, rows, path_len, lens))
        nbytes = batch * D * 4 * e * 2  # read the last min(5, W) path rows, write them into the ring
        tab.add("conv_state_commit", dict(D=D, B=batch, K=K), us, nbytes, g)
    L = 2048
    x = torch.randn(L, D, generator=gen, device=DEV).to(BF)
    start = torch.tensor([130], dtype=torch.int32, device=DEV)  # as the model passes it (no fill launch)
    us, g = time_us(lambda: ct.conv1d_prefill(x, weight, bias, state[0], start))
    tab.add("conv1d_prefill", dict(D=D, L=L), us, 2 * L * D * e + D * (W + 1 + 2 * W) * e, g)
    us, g = time_us(lambda: ct.conv1d_prefill_ref(x, weight, bias, state[0], 130))
    tab.add("conv1d_prefill_ref", dict(D=D, L=L), us, 2 * L * D * e, g)


# ------------------------------------------------------------------------------------- attention

HQ, HKV, DH = 32, 8, 128
LMAX = 4096


def _attn_setup(batch: int, nodes: int, prefix: int, seed: int):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    parents, cu, max_nodes, _ = _trees(batch, nodes, seed)
    T = int(cu[-1])
    k_cache = torch.randn(batch, LMAX, HKV, DH, generator=gen, device=DEV).to(BF)
    v_cache = torch.randn(batch, LMAX, HKV, DH, generator=gen, device=DEV).to(BF)
    q = torch.randn(T, HQ, DH, generator=gen, device=DEV).to(BF)
    slots = torch.arange(batch, dtype=torch.int32, device=DEV)
    lens = torch.full((batch,), prefix, dtype=torch.int32, device=DEV)
    return parents, cu, max_nodes, T, k_cache, v_cache, q, slots, lens


def _attn_bytes(batch: int, nodes: int, prefix: int) -> int:
    kv = 2 * batch * (prefix + nodes) * HKV * DH * 2
    return kv + 2 * batch * nodes * HQ * DH * 2


def _sweep_configs(nodes: int):
    for block_kv in (32, 64, 128):
        for warps in (4, 8):
            for splits in ((1, 4, 16) if nodes <= 16 else (1, 2, 4)):
                yield dict(num_splits=splits, block_kv=block_kv, num_warps=warps)
            if nodes >= 32:
                for splits in (1, 2):
                    yield dict(num_splits=splits, block_kv=block_kv, num_warps=warps, block_m=128)


def bench_attention(tab: Table, sweep: bool):
    scale = 1.0 / math.sqrt(DH)
    for batch in (1, 16):
        for prefix in (512, 2048):
            # one-token decode attention in torch (flash / efficient SDPA backend, GQA without repeats)
            gen = torch.Generator(device=DEV).manual_seed(prefix)
            qd = torch.randn(batch, HQ, 1, DH, generator=gen, device=DEV).to(BF)
            kd = torch.randn(batch, HKV, prefix + 1, DH, generator=gen, device=DEV).to(BF)
            vd = torch.randn_like(kd)
            us_sdpa, g = time_us(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale, enable_gqa=True))
            tab.add("sdpa_decode", dict(B=batch, L=prefix, N=1), us_sdpa, _attn_bytes(batch, 1, prefix), g)
            del qd, kd, vd
            decode_us = None
            for nodes in (1, 16, 64):
                parents, cu, max_nodes, T, kc, vc, q, slots, lens = _attn_setup(batch, nodes, prefix, nodes)
                out = torch.empty_like(q)

                def run(**kw):
                    return ta.tree_attention(q, kc, vc, parents, cu, slots, lens, max_nodes, scale, out=out, **kw)

                us, g = time_us(run)
                if nodes == 1:
                    decode_us = us
                tab.add("tree_attention", dict(B=batch, L=prefix, N=nodes), us, _attn_bytes(batch, nodes, prefix), g,
                        vs_decode=round(us / decode_us, 2), vs_sdpa_decode=round(us / us_sdpa, 2))
                if sweep:
                    best = None
                    for cfg in _sweep_configs(nodes):
                        try:
                            t, _ = time_us(lambda: run(**cfg), reps=10, inner=10)
                        except Exception as exc:  # an illegal config (e.g. too much shared memory) is skipped
                            print(f"  skip {cfg}: {type(exc).__name__}")
                            continue
                        if best is None or t < best[0]:
                            best = (t, cfg)
                    t, cfg = best
                    tab.add("tree_attention_best", dict(B=batch, L=prefix, N=nodes), t,
                            _attn_bytes(batch, nodes, prefix), True, **cfg)
                del kc, vc
                torch.cuda.empty_cache()


def bench_kv_writes(tab: Table):
    for batch in (1, 16):
        nodes = 64
        parents, cu, max_nodes, T, kc, vc, q, slots, lens = _attn_setup(batch, nodes, 1024, 3)
        k = torch.randn(T, HKV, DH, device=DEV).to(BF)
        v = torch.randn_like(k)
        us, g = time_us(lambda: ta.write_tree_kv(kc, vc, k, v, cu, slots, lens))
        tab.add("write_tree_kv", dict(B=batch, N=nodes), us, 4 * T * HKV * DH * 2, g)
        K = 8
        path_nodes = torch.arange(0, 2 * K, 2, dtype=torch.int32, device=DEV)[None].expand(batch, K).contiguous()
        path_len = torch.full((batch,), K, dtype=torch.int32, device=DEV)
        us, g = time_us(lambda: ta.kv_commit(kc, vc, slots, lens, path_nodes, path_len))
        tab.add("kv_commit", dict(B=batch, K=K), us, 4 * batch * (K - 1) * HKV * DH * 2, g)
        del kc, vc
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file for the results")
    ap.add_argument("--sweep", action="store_true", help="also search attention tuning knobs")
    ap.add_argument("--only", choices=["conv", "attention", "kv"], default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    bw = copy_bandwidth()
    name = torch.cuda.get_device_name()
    print(f"{name}: device-to-device copy {bw / 1e12:.3f} TB/s (read + write)")
    tab = Table(bw)
    if args.only in (None, "conv"):
        for D in (5376, 6144):
            bench_conv(tab, D)
    if args.only in (None, "attention"):
        bench_attention(tab, args.sweep)
    if args.only in (None, "kv"):
        bench_kv_writes(tab)
    memory_bound = [r for r in tab.rows if not r["latency_bound"] and r["ratio"] is not None]
    if memory_bound:
        worst = max(memory_bound, key=lambda r: r["ratio"])
        print(f"worst memory-bound ratio: x{worst['ratio']} ({worst['kernel']} {worst['params']})")
    with open(args.out, "w") as fh:
        json.dump(dict(device=name, copy_bandwidth_Bps=bw, torch=torch.__version__, results=tab.rows), fh, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
