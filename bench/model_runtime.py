"""Model-runtime benchmark on one GPU: decode step vs its memory floor, verify cost ratio, CUDA graphs.

    python -m bench.model_runtime --shape mamba2-2.7b --out runtime_mamba2.json
    python -m bench.model_runtime --shape hybrid-8b --out runtime_hybrid.json

Random bf16 weights in memory (a transformers model built from a config, our runtime built from
its state dict), so transformers' own `generate` on the very same weights is the baseline.

Shapes (DESIGN.md §9):
  mamba2-2.7b  Mamba2: d_model 2560, 64 layers, 80 heads x 64, d_state 128, 1 group, vocab 50288 (untied).
  hybrid-8b    Bamba layout (each layer Mamba2 or attention, then a SwiGLU MLP): d_model 4096,
               16 Mamba2 + 16 attention layers alternating (32 q / 8 kv heads x 128), MLP 14336,
               Mamba2 32 heads x 128, d_state 128, 8 groups (conv_dim 6144), vocab 128256.
               `--layers N` keeps the first N layers (the report states it).
  falcon-h1    an 8.2 B-parameter FalconH1 (a Mamba2 mixer and an attention side by side in 44 layers
               of 3072, then a SwiGLU MLP; d_state 256, no gated norm), vocab 130048.
  zamba2-2.7b  Zamba2-2.7B's layout: 54 Mamba2 layers of 2560 (80 heads x 64, d_state 64), 9 of them
               with a shared transformer (two blocks in turn, low-rank adapters, RoPE, 32 heads x 160
               over 2 x 2560 inputs, MLP 10240), vocab 32000; 2.7 B parameters as transformers holds
               them, 3.8 B once our runtime folds each block's adapters into its own copy.

Logits check (`check` in the report): one 128-token sequence (prefill of 127, decode of the last),
measured against transformers in fp32 on the very same weights (the bf16 model upcast in place):
our bf16 runtime, transformers' own bf16 forward (the size of rounding error at this depth and
init), and our runtime in fp32 (what rounding cannot blur; skipped when the GPU lacks room for a
second fp32 copy). With transformers' default Mamba2 init (std 0.1, in_proj outputs of std ~5 at
d_model 2560) 64 random layers amplify bf16 rounding until bf16 and fp32 logits are unrelated, for
transformers as much as for us; only the fp32 comparison then separates a bug from rounding.
`--init-std 0.02` gives a tamer random model whose bf16 logits stay close to fp32 (timings do not
depend on the weights' values). `--check-only` stops after the check.

Timing: CUDA events around each call (host overhead included, as a server sees it), warm-up
first, medians. The floor is the bytes one decode step must move (weights read once; SSM/conv
state read and written; K/V read) divided by the measured device-to-device copy bandwidth
(read + write bytes per second).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from contextlib import contextmanager

import torch

PROMPT = 128


def build_hf(shape: str, layers: int | None, init_std: float | None = None):
    """transformers model, random bf16 weights on the GPU; `init_std` overrides the config's
    `initializer_range` (transformers' defaults: 0.1 for Mamba2, 0.02 for Bamba)."""
    from transformers import AutoModelForCausalLM

    cfg = hf_config(shape, layers)
    if init_std is not None:
        cfg.initializer_range = init_std
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def hf_config(shape: str, layers: int | None = None):
    """The transformers config of a benchmark shape (see the module docstring), `layers` of them."""
    from transformers import BambaConfig, Mamba2Config

    if shape == "mamba2-2.7b":
        cfg = Mamba2Config(
            hidden_size=2560, num_hidden_layers=layers or 64, num_heads=80, head_dim=64, state_size=128,
            n_groups=1, expand=2, conv_kernel=4, vocab_size=50288, tie_word_embeddings=False,
            chunk_size=256, eos_token_id=None, pad_token_id=0,
        )
    elif shape == "hybrid-8b":
        n = layers or 32
        cfg = BambaConfig(
            hidden_size=4096, num_hidden_layers=n, attn_layer_indices=list(range(1, n, 2)),
            num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
            mamba_n_heads=32, mamba_d_head=128, mamba_n_groups=8, mamba_d_state=128, mamba_expand=1,
            mamba_d_conv=4, mamba_chunk_size=256, vocab_size=128256, eos_token_id=None, pad_token_id=0,
            max_position_embeddings=8192,
        )
    elif shape == "falcon-h1":
        # a FalconH1 of about 8B parameters (its own choice of sizes, not a published checkpoint's):
        # every layer a Mamba2 mixer and an attention side by side, then an MLP; no gated norm
        from transformers import FalconH1Config

        cfg = FalconH1Config(
            hidden_size=3072, num_hidden_layers=layers or 44, num_attention_heads=24, num_key_value_heads=8,
            head_dim=128, intermediate_size=12288, mamba_n_heads=48, mamba_d_head=64, mamba_d_ssm=3072,
            mamba_d_state=256, mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=256, mamba_rms_norm=False,
            vocab_size=130048, eos_token_id=None, pad_token_id=0, max_position_embeddings=8192,
        )
    elif shape == "zamba2-2.7b":
        # the layout of Zyphra's Zamba2-2.7B (54 layers of 2560, a shared transformer over the stream
        # and the embeddings in 9 of them, two shared blocks in turn with low-rank adapters, RoPE);
        # its own choice where that layout leaves sizes open
        from transformers import Zamba2Config

        base = Zamba2Config()
        cfg = Zamba2Config(
            num_hidden_layers=layers or 54, layers_block_type=base.layers_block_type[: layers or 54],
            n_mamba_heads=80, mamba_d_state=64, mamba_ngroups=1, num_mem_blocks=2,
            use_shared_attention_adapter=True, adapter_rank=128, use_mem_rope=True, vocab_size=32000,
            eos_token_id=None, pad_token_id=0, max_position_embeddings=8192,
        )
    elif shape == "mamba2-tiny":  # smoke runs on a CPU
        cfg = Mamba2Config(
            hidden_size=128, num_hidden_layers=layers or 2, num_heads=8, head_dim=32, state_size=16,
            n_groups=1, expand=2, conv_kernel=4, vocab_size=512, tie_word_embeddings=False, chunk_size=64,
            eos_token_id=None, pad_token_id=0,
        )
    else:
        raise SystemExit(f"unknown shape {shape}")
    return cfg


def median_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.empty(512 * 2**20, dtype=torch.float16, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    ms = median_ms(lambda: y.copy_(x), 3, 20)
    return 2 * x.numel() * x.element_size() / (ms * 1e-3)


def decode_bytes(lm, length: int) -> dict:
    """Bytes one batch-1 decode step must move."""
    weights = sum(p.numel() * p.element_size() for n, p in lm.named_parameters() if not n.startswith("embed."))
    if lm.config.tie_embeddings:
        weights += lm.embed.weight.numel() * lm.embed.weight.element_size()
    pool = lm.pool
    state = 0
    if pool.n_mamba:
        # SSM state read and written; of each conv ring (W columns) W-1 read and one written
        state += 2 * pool.ssm[0].numel() * 4 + pool.conv[0].numel() * pool.conv.element_size()
    kv = 0
    if pool.n_attn:
        a = pool.attention
        kv = 2 * pool.n_attn * length * a.n_kv_heads * a.head_dim * pool.k.element_size()
    return {"weights": weights, "state_read_write": state, "kv_read": kv, "total": weights + state + kv}


CENSUS_SIZES = (16, 64)  # tree sizes whose verify kernels are listed (what the verify ratio is made of)


def balanced_tree(n: int, rng: random.Random, vocab: int):
    """A random tree of n nodes, parents among the last few nodes (bushy, depth ~ n / 3)."""
    from treeserve.tree import TokenTree

    parents = [-1] + [rng.randrange(max(0, i - 3), i) for i in range(1, n)]
    return TokenTree(tuple(rng.randrange(vocab) for _ in range(n)), tuple(parents))


def bench_runtime(lm, graphs: bool, sizes, rng, vocab: int, max_decode: int) -> dict:
    lm.graphs = lm.use_graphs() if graphs else None
    prompt = [rng.randrange(vocab) for _ in range(PROMPT)]
    slot = lm.pool.alloc()
    lm.prefill([slot], [prompt])
    steps = iter(range(10**9))
    dec_ms = median_ms(lambda: lm.decode([slot], [next(steps) % vocab]), 5, max_decode)
    out = {"decode_ms": dec_ms, "verify_ms": {}, "verify_ratio": {}, "verify_commit_ms": {}, "verify_kernels": {}}
    out["decode_kernels"] = kernel_census(lambda: lm.decode([slot], [next(steps) % vocab]))
    for n in sizes:
        tree = balanced_tree(n, rng, vocab)
        ms = median_ms(lambda: lm.verify([slot], [tree]), 3, 15)
        out["verify_ms"][n] = ms
        out["verify_ratio"][n] = ms / dec_ms
        if n in CENSUS_SIZES:
            out["verify_kernels"][n] = kernel_census(lambda: lm.verify([slot], [tree]), top=16)
        # one speculation round: verify, then commit a path of up to 4 nodes; state moves on
        path = tree.path_to(min(n - 1, 3))

        def round_trip():
            res = lm.verify([slot], [tree])
            lm.commit([(res.pending[0], path)])

        lm.pool.free(slot)
        slot = lm.pool.alloc()
        lm.prefill([slot], [prompt])
        out["verify_commit_ms"][n] = median_ms(round_trip, 2, 8)
    lm.pool.free(slot)
    if lm.graphs is not None:
        out["graph_failures"] = list(lm.graphs.failures)
    return out


def kernel_census(fn, top: int = 12) -> dict:
    """GPU kernels one call of `fn` runs (inside CUDA graphs too): how many, their summed time, and
    the `top` kernels by time as [name, count, total us]. What to fuse next is read off this."""
    from torch.profiler import ProfilerActivity, profile

    try:
        fn()  # warm (graph capture, compilation) outside the trace
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
            if us > 0:
                rows.append([e.key[:80], e.count, round(us, 1)])
    except Exception as e:  # the profiler is a diagnostic: never fail the benchmark for it
        return {"error": f"{type(e).__name__}: {e}"}
    rows.sort(key=lambda r: -r[2])
    return {"kernels": sum(r[1] for r in rows), "total_us": round(sum(r[2] for r in rows), 1), "top": rows[:top]}


def bench_hf_generate(model, rng, vocab: int, new_tokens: int) -> float:
    """transformers' generate on the same weights: ms per new token (difference of two lengths)."""
    x = torch.tensor([[rng.randrange(vocab) for _ in range(PROMPT)]], device="cuda")
    mask = torch.ones_like(x)

    def run(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(x, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    run(2)
    short, long = run(1), run(1 + new_tokens)
    return (long - short) / new_tokens * 1e3


@contextmanager
def upcast(model):
    """`model` in fp32, in place, for the duration; every parameter and buffer then returns to its own
    dtype. The round trip is exact for bf16 weights, so no second copy of the model is needed.
    TF32 is off meanwhile (cuDNN allows it by default, e.g. for transformers' conv1d): the fp32
    reference must be fp32 throughout, since 64 random layers magnify any rounding."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    dtypes = {name: t.dtype for name, t in tensors}
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    model.float()
    torch.cuda.empty_cache()
    try:
        yield model
    finally:
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            t.data = t.data.to(dtypes[name])
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.cuda.empty_cache()


def hf_rows(model, ids) -> torch.Tensor:
    """transformers' logits (2, V), as fp32, at the last two positions of `ids` (no cache)."""
    with torch.no_grad():
        return model(torch.tensor([ids], device=model.device), use_cache=False).logits[0, -2:].float()


def runtime_rows(lm, ids) -> torch.Tensor:
    """Our logits (2, V): prefill of `ids[:-1]` (its last position), then decode of `ids[-1]`."""
    slot = lm.pool.alloc()
    a = lm.prefill([slot], [ids[:-1]])[0]
    b = lm.decode([slot], [ids[-1]])[0]
    lm.pool.free(slot)
    return torch.stack([a, b])


def compare(x: torch.Tensor, ref: torch.Tensor) -> dict:
    """x, ref (2, V): row 0 the prefill position, row 1 the decoded one."""
    d = (x - ref).abs()
    return {
        "prefill_max_abs_diff": d[0].max().item(),
        "decode_max_abs_diff": d[1].max().item(),
        "rel_l2": ((x - ref).norm() / ref.norm()).item(),
        "argmax_agrees": int((x.argmax(-1) == ref.argmax(-1)).sum()),
    }


def reference_logits(model, ids) -> dict:
    """transformers' logits in bf16 and fp32 on the same (bf16) weights, and our runtime's in fp32
    when the GPU has room for a second fp32 copy; run before our bf16 runtime is built."""
    from models import HybridLM

    out = {"hf_bf16": hf_rows(model, ids)}
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    with upcast(model):
        out["hf_fp32"] = hf_rows(model, ids)
        free = torch.cuda.mem_get_info()[0] if model.device.type == "cuda" else float("inf")
        if free < fp32_bytes + 4 * 2**30:
            out["ours_fp32"] = f"skipped: {fp32_bytes / 2**30:.1f} GiB of fp32 weights, {free / 2**30:.1f} GiB free"
        else:
            try:
                lm32 = HybridLM.from_hf_model(model, dtype=torch.float32, max_slots=1, max_len=len(ids) + 8,
                                              cuda_graphs=False)
                out["ours_fp32"] = runtime_rows(lm32, ids)
                del lm32
            except torch.OutOfMemoryError:  # the build stacks layers: its temporaries need more than the estimate
                torch.cuda.empty_cache()
                out["ours_fp32"] = f"skipped: out of memory building {fp32_bytes / 2**30:.1f} GiB of fp32 weights"
    return out


def check_logits(lm, ids, ref: dict) -> dict:
    """Our bf16 logits against transformers fp32 on the same weights, beside transformers' own bf16
    error against that reference (the size of rounding error at this depth and init), and our fp32
    logits against it (the bug check that rounding cannot blur, when there was room to run it).

    `verdict`: "ok" when our bf16 error is within 3x transformers' bf16 error and our fp32 error is
    within max(1e-4, 5% of transformers' bf16 error) (relative L2 over the two rows); otherwise
    "MISMATCH". Depth amplifies fp32 rounding as it does bf16's (fp32-sized noise in every layer
    of the random 2.7B shape ends near 1e-4 relative), so fp32 stays far below that bound, while a
    real discrepancy grows like bf16's error.
    """
    ours = runtime_rows(lm, ids)
    base = ref["hf_fp32"]
    hf = compare(ref["hf_bf16"], base)
    rep = {
        "reference": "transformers fp32, same weights",
        "tokens": len(ids),
        "logit_scale": base.abs().max().item(),
        "ours_bf16": compare(ours, base),
        "hf_bf16": hf,
        "ours_bf16_vs_hf_bf16": compare(ours, ref["hf_bf16"]),
    }
    ok = rep["ours_bf16"]["rel_l2"] <= 3 * hf["rel_l2"] + 1e-6
    if isinstance(ref["ours_fp32"], str):
        rep["ours_fp32"] = ref["ours_fp32"]
    else:
        rep["ours_fp32"] = compare(ref["ours_fp32"], base)
        ok = ok and rep["ours_fp32"]["rel_l2"] <= max(1e-4, 0.05 * hf["rel_l2"])
    rep["verdict"] = "ok" if ok else "MISMATCH"
    if hf["rel_l2"] > 0.3:
        rep["note"] = (
            "transformers' own bf16 logits have drifted far from fp32 at this depth and init (chaotic "
            "random weights): the bf16 comparisons cannot tell a bug from rounding; ours_fp32 can"
        )
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=["mamba2-2.7b", "hybrid-8b", "falcon-h1", "zamba2-2.7b"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    ap.add_argument("--sizes", default="1,4,8,16,32,64,128")
    ap.add_argument("--hf-tokens", type=int, default=8, help="new tokens for the transformers baseline (0: skip)")
    ap.add_argument("--check-only", action="store_true", help="stop after the logits check")
    ap.add_argument("--init-std", type=float, default=None, help="initializer_range of the random weights")
    args = ap.parse_args()
    from kernels import pdl
    from models import HybridLM

    sizes = [int(s) for s in args.sizes.split(",")]
    rng = random.Random(0)
    t0 = time.time()
    model = build_hf(args.shape, args.layers, args.init_std)
    vocab = model.config.vocab_size
    # one sequence longer than our prefill chunk (64): the check covers the chunk-to-chunk state pass
    check_ids = [rng.randrange(vocab) for _ in range(PROMPT)]
    t_ref = time.time()
    ref = reference_logits(model, check_ids)  # before our runtime exists: room for the fp32 copies
    t_ref = time.time() - t_ref
    lm = HybridLM.from_hf_model(model, max_slots=2, max_len=PROMPT + 256, cuda_graphs=False)
    report = {
        "shape": args.shape,
        "layers": args.layers or "all",
        "init_std": model.config.initializer_range,
        "device": torch.cuda.get_device_name(),
        "programmatic_dependent_launch": pdl.enabled(torch.device("cuda")),  # TREESERVE_PDL=0 turns it off
        "config": lm.config.describe(),
        "params": sum(p.numel() for p in lm.parameters()),
        "prompt": PROMPT,
        "build_s": time.time() - t0 - t_ref,
        "reference_s": t_ref,
    }
    print(json.dumps(report), flush=True)
    report["check"] = check_logits(lm, check_ids, ref)
    print("check", json.dumps(report["check"]), flush=True)
    if args.check_only:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        return
    bw = copy_bandwidth()
    moved = decode_bytes(lm, PROMPT + 64)
    report["copy_bandwidth_GBps"] = bw / 1e9
    report["decode_bytes"] = moved
    report["decode_floor_ms"] = moved["total"] / bw * 1e3
    for mode in ("eager", "graphs"):
        t = time.time()
        r = bench_runtime(lm, mode == "graphs", sizes, rng, vocab, max_decode=60)
        r["decode_vs_floor"] = r["decode_ms"] / report["decode_floor_ms"]
        r["wall_s"] = time.time() - t
        report[mode] = r
        print(mode, json.dumps(r), flush=True)
    if args.hf_tokens:
        report["hf_generate_ms_per_token"] = bench_hf_generate(model, rng, vocab, args.hf_tokens)
        report["speedup_decode_vs_hf"] = report["hf_generate_ms_per_token"] / report["graphs"]["decode_ms"]
        print("hf", report["hf_generate_ms_per_token"], flush=True)
    report["total_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: report[k] for k in ("decode_floor_ms", "copy_bandwidth_GBps")}), flush=True)
    if report["programmatic_dependent_launch"]:
        print("(PDL on: a kernel's time includes its wait for the one before; TREESERVE_PDL=0 for kernel times)")
    print("decode ms eager %.3f graphs %.3f floor %.3f" % (report["eager"]["decode_ms"], report["graphs"]["decode_ms"], report["decode_floor_ms"]))
    census = report["graphs"]["decode_kernels"]
    if "kernels" in census:
        print(f"decode step (graphs): {census['kernels']} kernels, {census['total_us']:.0f} us of kernel time")
        for name, count, us in census["top"]:
            print(f"  {us:9.1f} us  {count:5d}x  {name}")
    for n, census in report["graphs"]["verify_kernels"].items():
        if "kernels" in census:
            print(f"verify, {n} nodes (graphs): {census['kernels']} kernels, {census['total_us']:.0f} us of kernel time")
            for name, count, us in census["top"]:
                print(f"  {us:9.1f} us  {count:5d}x  {name}")
    for n in sizes:
        print(f"N={n:4d} verify ratio eager {report['eager']['verify_ratio'][n]:.2f} graphs {report['graphs']['verify_ratio'][n]:.2f}")


if __name__ == "__main__":
    main()
