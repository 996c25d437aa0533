"""What each op costs on the critical path of a decode step and of a tree verification, batch 1,
CUDA graphs under PDL.

    python -m bench.step_breakdown --shape mamba2-2.7b --sizes 1,16,64 --out breakdown.json

A kernel census (`bench.model_runtime`) times every kernel of an eager step on its own. Inside a
CUDA graph under programmatic dependent launch the short kernels overlap their neighbours' launches
and tails, so those times overstate what removing a kernel would save. Here each op is taken out
in turn instead: a stand-in that launches nothing and returns an uninitialised tensor of the
op's output shape. The graphs are captured again and decode and verify timed as
`bench.model_runtime` times them (CUDA events around the call, medians after warm-up). base minus
knocked out is what the op adds to the step. Knockouts do not add up: once one op is gone its
neighbours' latencies may surface.

The model's outputs are garbage while an op is out; only times are kept. Each op's stand-in counts
its calls: an op that no stand-in call replaced (not on this model's path) is reported as such,
not as free. `base` runs first, in the middle and last: its spread is the noise to read the
differences against.

Ops (`OPS`): the Mamba2 mixer's in_proj, tree conv, in_proj and tree conv in one launch (what a
verify of 2..32 nodes runs on CUDA instead of those two), tree scan, gated norm and out_proj, the
fused decode step (conv + state update + gated norm), the residual add + RMSNorm at block boundaries,
whole attention mixers and, within them, the qkv projection, RoPE, the K/V write into the cache
(and a verify's stash), the tree attention kernel (decode runs it too, as a one-node tree) and
o_proj; whole MLP / MoE mixers; and the LM head.

One entry is a what-if rather than a knockout: `few_rows_as_one` charges every projection of
2..DOT_ROWS rows what a one-row projection costs (the one-row kernel runs on the first row; the
other rows are left unwritten), with in_proj and the tree conv as two launches, as one row runs
them. base minus it is what a verify's few-row projections cost over the weight stream of a decode
step: what a perfect few-row projection kernel could save.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import time
from typing import Callable, Iterator

import torch

import kernels.ops as kernel_ops
import kernels.proj_conv as proj_conv_kernel
import models.layers.linear as linear_layer
import models.layers.mamba as mamba_layer
import models.runtime as runtime
from kernels.norms import SumOfSquares
from models.layers.attention import Attention
from models.layers.mamba import MambaMixer
from models.layers.mlp import MLP, MoE

OPS = ("in_proj", "tree_conv", "proj_conv", "tree_scan", "gated_norm", "out_proj", "decode_step", "add_norm", "attention",
       "qkv_proj", "rope", "write_kv", "tree_attention", "o_proj", "mlp", "lm_head", "few_rows_as_one")


def _blank(shape, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An op's stand-in output: uninitialised on a GPU (no kernel to time), NaN elsewhere (so that a
    replaced op shows in the result where tests look)."""
    dtype = dtype or like.dtype
    if like.is_cuda:
        return torch.empty(shape, dtype=dtype, device=like.device)
    return torch.full(shape, float("nan"), dtype=dtype, device=like.device)


@contextlib.contextmanager
def _swapped(owner, name: str, value) -> Iterator[None]:
    """owner.name = value within; a name owner had only through its class is dropped again after."""
    had = name in vars(owner)
    old = vars(owner).get(name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if had:
            setattr(owner, name, old)
        else:
            delattr(owner, name)


def _counted(fn: Callable, calls: list[int]) -> Callable:
    def stand_in(*args, **kwargs):
        calls[0] += 1
        return fn(*args, **kwargs)

    return stand_in


@contextlib.contextmanager
def knocked_out(lm, op: str) -> Iterator[list[int]]:
    """Within: `op` of `lm` replaced by a stand-in that launches nothing. Yields [calls], the number of
    times a stand-in ran (0 afterwards means the op is not on the path that was run)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; one of {', '.join(OPS)}")
    calls = [0]
    mixers = list(lm.modules())
    mamba = [m for m in mixers if isinstance(m, MambaMixer)]
    d_model = lm.config.d_model
    with contextlib.ExitStack() as stack:
        swap = stack.enter_context
        if op == "in_proj":
            for m in mamba:
                width = m.spec.in_proj_dim
                swap(_swapped(m.in_proj, "forward", _counted(lambda x, w=width: _blank((x.shape[0], w), x), calls)))
        elif op == "out_proj":
            for m in mamba:
                swap(_swapped(m.out_proj, "forward", _counted(lambda x: _blank((x.shape[0], d_model), x), calls)))
        elif op == "tree_conv":
            swap(_swapped(kernel_ops, "tree_conv1d", _counted(lambda *a, out=None, **k: out, calls)))
        elif op == "proj_conv":
            def proj_conv(h, weight, *a, conv_out=None, **k):
                return _blank((h.shape[0], weight.shape[0]), h), conv_out

            swap(_swapped(kernel_ops, "project_tree_conv", _counted(proj_conv, calls)))
        elif op == "tree_scan":  # with the deferred gated norm its epilogue goes too
            swap(_swapped(kernel_ops, "tree_ssd_scan", _counted(lambda x, *a, **k: _blank(x.shape, x), calls)))

            def deferred_scan(x, *a, **k):
                T, H, P = x.shape
                return _blank((T, H * P), x), SumOfSquares(_blank((T, 1), x, torch.float32), H * P, 1e-5)

            swap(_swapped(kernel_ops, "tree_ssd_scan_deferred_norm", _counted(deferred_scan, calls)))
        elif op == "gated_norm":
            swap(_swapped(mamba_layer, "gated_rms_norm", _counted(lambda y, z, *a: _blank(z.shape, z), calls)))
        elif op == "decode_step":
            for name in ("mamba_decode_step", "mamba_decode_step_deferred_norm", "mamba_decode_step_gate_only"):
                deferred = name.endswith("deferred_norm")

                def decode_step(zxbcdt, conv, ssm, *a, deferred=deferred, **k):
                    rows, d_inner = zxbcdt.shape[0], ssm.shape[1] * ssm.shape[2]
                    y = _blank((rows, d_inner), zxbcdt)
                    sums = SumOfSquares(_blank((rows, 1), zxbcdt, torch.float32), d_inner, 1e-5)
                    return (y, sums) if deferred else y

                swap(_swapped(kernel_ops, name, _counted(decode_step, calls)))
        elif op == "add_norm":
            swap(_swapped(runtime, "add_rms_norm",
                          _counted(lambda h, out, *a, **k: (h, _blank(h.shape, h, lm.dtype)), calls)))
        elif op == "attention":
            for m in mixers:
                if isinstance(m, Attention):
                    for mode in ("decode", "verify"):
                        swap(_swapped(m, mode, _counted(lambda h, *a: _blank((h.shape[0], d_model), h), calls)))
        elif op in ("qkv_proj", "o_proj"):
            for m in mixers:
                if isinstance(m, Attention):
                    proj = getattr(m, op)
                    width = proj.out_features
                    swap(_swapped(proj, "forward", _counted(lambda x, w=width: _blank((x.shape[0], w), x), calls)))
        elif op == "rope":
            swap(_swapped(kernel_ops, "rope_qk", _counted(lambda q, k, *a, **kw: (_blank(q.shape, q), _blank(k.shape, k)),
                                                          calls)))
        elif op == "write_kv":
            swap(_swapped(kernel_ops, "write_tree_kv", _counted(lambda *a, **k: None, calls)))
        elif op == "tree_attention":
            swap(_swapped(kernel_ops, "tree_attention", _counted(lambda q, *a, **k: _blank(q.shape, q), calls)))
        elif op == "mlp":
            for m in mixers:
                if isinstance(m, (MLP, MoE)):
                    swap(_swapped(m, "forward", _counted(lambda x: _blank(x.shape, x), calls)))
        elif op == "few_rows_as_one":
            every_row = linear_layer.linear

            def first_row_only(x, weight, bias=None):
                rows = x.shape[0]
                if x.dim() != 2 or rows == 1 or not linear_layer.runs_kernel(rows):  # the few-row rule's rows only
                    return every_row(x, weight, bias)
                calls[0] += 1
                y = _blank((rows, weight.shape[0]), x)
                if x.is_cuda and x.dtype == weight.dtype:  # straight into y: no copy launch to time
                    kernel_ops.few_rows_linear(x[:1], weight, bias, out=y[:1])
                else:
                    y[:1] = every_row(x[:1], weight, bias)
                return y

            swap(_swapped(linear_layer, "linear", first_row_only))
            swap(_swapped(runtime, "linear", first_row_only))
            swap(_swapped(proj_conv_kernel, "fits", lambda rows: False))
        elif op == "lm_head":
            vocab = lm.config.vocab_size
            swap(_swapped(lm, "logits",
                          _counted(lambda h, w=None: _blank((h.shape[0], vocab), h, torch.float32), calls)))
        yield calls


def time_steps(lm, sizes, vocab: int, rng: random.Random, decode_iters: int = 150, verify_iters: int = 60) -> dict:
    """Decode and verify at batch 1 through freshly captured graphs: median ms per call."""
    from bench.model_runtime import PROMPT, balanced_tree, median_ms

    lm.graphs = lm.use_graphs()
    try:
        slot = lm.pool.alloc()
        lm.prefill([slot], [[rng.randrange(vocab) for _ in range(PROMPT)]])
        steps = iter(range(10**9))
        out = {"decode": median_ms(lambda: lm.decode([slot], [next(steps) % vocab]), 10, decode_iters)}
        for n in sizes:
            tree = balanced_tree(n, rng, vocab)
            out[f"verify_{n}"] = median_ms(lambda: lm.verify([slot], [tree]), 5, verify_iters)
        lm.pool.free(slot)
        return out
    finally:
        lm.graphs = None
        torch.cuda.empty_cache()


def main() -> None:
    from bench.model_runtime import PROMPT, build_hf
    from kernels import pdl
    from models import HybridLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=["mamba2-2.7b", "hybrid-8b"], required=True)
    ap.add_argument("--sizes", default="1,16,64", help="verify tree sizes")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--rounds", type=int, default=1, help="times each op is knocked out (base runs between rounds)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    ops = [o for o in args.ops.split(",") if o]
    t0 = time.time()
    model = build_hf(args.shape, None)
    vocab = model.config.vocab_size
    lm = HybridLM.from_hf_model(model, max_slots=2, max_len=PROMPT + 512, cuda_graphs=False)
    del model
    torch.cuda.empty_cache()
    report = {"shape": args.shape, "device": torch.cuda.get_device_name(), "config": lm.config.describe(),
              "programmatic_dependent_launch": pdl.enabled(torch.device("cuda")), "runs": []}
    rng = random.Random(0)
    plan = ["base"]
    for _ in range(args.rounds):
        plan += ops[: len(ops) // 2] + ["base"] + ops[len(ops) // 2:] + ["base"]
    for op in plan:
        if op == "base":
            row = {"op": "base", **time_steps(lm, sizes, vocab, rng)}
        else:
            with knocked_out(lm, op) as calls:
                row = {"op": op, **time_steps(lm, sizes, vocab, rng)}
            row["stand_in_calls"] = calls[0]
        report["runs"].append(row)
        print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    report["summary"] = summarise(report["runs"])
    report["wall_s"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    for op, saved in report["summary"].items():
        print(f"{op:12s} " + "  ".join(f"{k} {v:+.3f}" if v is not None else f"{k} n/a" for k, v in saved.items()))


def summarise(runs: list[dict]) -> dict:
    """Per op: median over its runs of (median base - knocked out) ms per timed call; None where the
    op was never on the path (its stand-in never ran)."""
    import statistics

    keys = [k for k in runs[0] if k == "decode" or k.startswith("verify_")]
    base = {k: statistics.median(r[k] for r in runs if r["op"] == "base") for k in keys}
    out: dict[str, dict] = {"base": base}
    for op in dict.fromkeys(r["op"] for r in runs if r["op"] != "base"):
        mine = [r for r in runs if r["op"] == op]
        if not any(r["stand_in_calls"] for r in mine):
            out[op] = {k: None for k in keys}
            continue
        out[op] = {k: base[k] - statistics.median(r[k] for r in mine) for k in keys}
    return out


if __name__ == "__main__":
    main()
