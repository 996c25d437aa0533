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

import torch

PROMPT = 128


def build_hf(shape: str, layers: int | None):
    from transformers import AutoModelForCausalLM, BambaConfig, Mamba2Config

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
    else:
        raise SystemExit(f"unknown shape {shape}")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


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
        state += 2 * (pool.ssm[0].numel() * 4 + pool.conv[0].numel() * pool.conv.element_size())
    kv = 0
    if pool.n_attn:
        a = pool.attention
        kv = 2 * pool.n_attn * length * a.n_kv_heads * a.head_dim * pool.k.element_size()
    return {"weights": weights, "state_read_write": state, "kv_read": kv, "total": weights + state + kv}


def balanced_tree(n: int, rng: random.Random, vocab: int):
    """A random tree of n nodes, parents among the last few nodes (bushy, depth ~ n / 3)."""
    from treeserve.tree import TokenTree

    parents = [-1] + [rng.randrange(max(0, i - 3), i) for i in range(1, n)]
    return TokenTree(tuple(rng.randrange(vocab) for _ in range(n)), tuple(parents))


def bench_runtime(lm, graphs: bool, sizes, rng, vocab: int, max_decode: int) -> dict:
    from models.graphs import GraphRunner

    lm.graphs = GraphRunner(lm) if graphs else None
    prompt = [rng.randrange(vocab) for _ in range(PROMPT)]
    slot = lm.pool.alloc()
    lm.prefill([slot], [prompt])
    steps = iter(range(10**9))
    dec_ms = median_ms(lambda: lm.decode([slot], [next(steps) % vocab]), 5, max_decode)
    out = {"decode_ms": dec_ms, "verify_ms": {}, "verify_ratio": {}, "verify_commit_ms": {}}
    for n in sizes:
        tree = balanced_tree(n, rng, vocab)
        ms = median_ms(lambda: lm.verify([slot], [tree]), 3, 15)
        out["verify_ms"][n] = ms
        out["verify_ratio"][n] = ms / dec_ms
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


def check_logits(lm, model, rng, vocab: int) -> dict:
    """Our bf16 prefill + decode logits against transformers' bf16 ones (same weights)."""
    ids = [rng.randrange(vocab) for _ in range(64)]
    with torch.no_grad():
        ref = model(torch.tensor([ids], device="cuda"), use_cache=False).logits[0].float()
    slot = lm.pool.alloc()
    a = lm.prefill([slot], [ids[:-1]])[0]
    b = lm.decode([slot], [ids[-1]])[0]
    lm.pool.free(slot)
    scale = ref.abs().max().item()
    return {
        "prefill_max_abs_diff": (a - ref[-2]).abs().max().item(),
        "decode_max_abs_diff": (b - ref[-1]).abs().max().item(),
        "logit_scale": scale,
        "argmax_agrees": int(a.argmax() == ref[-2].argmax()) + int(b.argmax() == ref[-1].argmax()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=["mamba2-2.7b", "hybrid-8b"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    ap.add_argument("--sizes", default="1,4,8,16,32,64,128")
    ap.add_argument("--hf-tokens", type=int, default=8, help="new tokens for the transformers baseline (0: skip)")
    args = ap.parse_args()
    from models import HybridLM

    sizes = [int(s) for s in args.sizes.split(",")]
    rng = random.Random(0)
    t0 = time.time()
    model = build_hf(args.shape, args.layers)
    vocab = model.config.vocab_size
    lm = HybridLM.from_hf_model(model, max_slots=2, max_len=PROMPT + 256, cuda_graphs=False)
    report = {
        "shape": args.shape,
        "layers": args.layers or "all",
        "device": torch.cuda.get_device_name(),
        "config": lm.config.describe(),
        "params": sum(p.numel() for p in lm.parameters()),
        "prompt": PROMPT,
        "build_s": time.time() - t0,
    }
    print(json.dumps(report), flush=True)
    bw = copy_bandwidth()
    moved = decode_bytes(lm, PROMPT + 64)
    report["copy_bandwidth_GBps"] = bw / 1e9
    report["decode_bytes"] = moved
    report["decode_floor_ms"] = moved["total"] / bw * 1e3
    report["check"] = check_logits(lm, model, rng, vocab)
    print("check", report["check"], flush=True)
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
    print("decode ms eager %.3f graphs %.3f floor %.3f" % (report["eager"]["decode_ms"], report["graphs"]["decode_ms"], report["decode_floor_ms"]))
    for n in sizes:
        print(f"N={n:4d} verify ratio eager {report['eager']['verify_ratio'][n]:.2f} graphs {report['graphs']['verify_ratio'][n]:.2f}")


if __name__ == "__main__":
    main()
