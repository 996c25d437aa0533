"""`treeserve bench verify-cost`: what a tree verification costs at realistic model sizes, and the
speedup the measured acceptance would give there.

    treeserve bench verify-cost --shapes mamba2-2.7b hybrid-8b --tau runs/e2e/e2e.json --out verify_cost.json
    treeserve bench verify-cost --ratios runtime_mamba2-2.7b.json --tau 3.2          # no GPU needed

1. Verify cost ratio r(n) = time to verify an n-node tree / time of one decode step, batch 1, CUDA
   graphs, random bf16 weights at the DESIGN.md §9 shapes. Measured with `bench.model_runtime`'s
   builders and timing (`build_hf`, `bench_runtime`), or read from an earlier `bench.model_runtime`
   or `verify-cost` JSON (`--ratios`). r(n) is interpolated linearly between measured sizes.
2. Projection: speedup over plain decoding = tau / r(mean tree nodes), with tau and the mean tree
   size of each method measured by `bench e2e` on the trained demo pair (`--tau e2e.json`), or a
   given tau at every measured size (`--tau X`). It is a PROJECTION, not a measurement: it takes
   the small pair's acceptance as if a large pair accepted alike, and counts the target's
   verification alone — drafting and RPC time are taken as zero (a drafter that is cheap next to
   the target, or fully hidden by draft-ahead). The `+commit` column uses the cost of verify plus
   committing the accepted path, the full per-round work of the target.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Optional

SHAPES = ("mamba2-2.7b", "hybrid-8b")
DEFAULT_SIZES = (1, 4, 8, 13, 16, 32, 64)
LABEL = ("PROJECTION (not a measurement): tau measured by `bench e2e` on the trained demo pair divided by the "
         "verify cost ratio measured at the realistic shape with random weights; drafting and RPC time count as zero")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES), help="shapes to measure on the GPU")
    p.add_argument("--tau", default=None,
                   help="an e2e.json from `bench e2e` (tau and tree size per method), or one number")
    p.add_argument("--ratios", nargs="+", default=[], metavar="JSON",
                   help="take the ratios from `bench.model_runtime` / `verify-cost` JSON files instead of measuring "
                        "(shapes found there are not measured again)")
    p.add_argument("--sizes", type=int, nargs="+", default=list(DEFAULT_SIZES), help="tree sizes to measure")
    p.add_argument("--layers", type=int, default=None, help="keep only the first N layers (faster; stated in the output)")
    p.add_argument("--out", default=None, help="JSON output file")


# ---- arithmetic (pure) -----------------------------------------------------------------------------
def interpolate(ratios: dict[int, float], n: float) -> tuple[float, bool]:
    """r(n) from measured {size: ratio}: linear between neighbours. Outside the measured range the
    nearest end is used; the flag says so."""
    sizes = sorted(ratios)
    if not sizes:
        raise ValueError("no verify cost ratios")
    if n <= sizes[0]:
        return ratios[sizes[0]], n < sizes[0]
    if n >= sizes[-1]:
        return ratios[sizes[-1]], n > sizes[-1]
    for a, b in zip(sizes, sizes[1:]):
        if a <= n <= b:
            w = (n - a) / (b - a)
            return ratios[a] + w * (ratios[b] - ratios[a]), False
    raise AssertionError("unreachable")


def tau_rows(e2e: dict) -> list[dict]:
    """(method, path, temperature, tau, mean nodes) of every successful row of our own stack."""
    out = []
    for r in e2e.get("rows", []):
        if r.get("error") or r["path"] == "hf" or not r.get("steps"):
            continue
        out.append({"method": r["method"], "path": r["path"], "temperature": r["temperature"], "shape": r["shape"],
                    "tau": r["tau"], "mean_nodes": r["mean_nodes"], "measured_speedup_vs_plain": r.get("speedup_vs_plain")})
    return out


def project(rows: list[dict], ratios: dict[int, float], round_ratios: Optional[dict[int, float]] = None) -> list[dict]:
    """Projected speedup of each row: tau / r(mean nodes); against chain: the same quotient divided
    by the chain row's (same path and temperature)."""
    out = []
    for r in rows:
        ratio, outside = interpolate(ratios, r["mean_nodes"])
        p = dict(r, verify_ratio=ratio, outside_measured=outside, projected_speedup=r["tau"] / ratio)
        if round_ratios:
            rr, _ = interpolate(round_ratios, r["mean_nodes"])
            p["round_ratio"], p["projected_speedup_with_commit"] = rr, r["tau"] / rr
        out.append(p)
    for p in out:
        chain = next((c for c in out if c["shape"] == "chain" and c["path"] == p["path"]
                      and c["temperature"] == p["temperature"]), None)
        p["projected_vs_chain"] = p["projected_speedup"] / chain["projected_speedup"] if chain else None
    return out


def project_fixed_tau(tau: float, ratios: dict[int, float]) -> list[dict]:
    """A given tau at every measured tree size."""
    return [{"nodes": n, "tau": tau, "verify_ratio": r, "projected_speedup": tau / r} for n, r in sorted(ratios.items())]


def ratios_from_file(path: str) -> dict[str, dict]:
    """{shape: entry} from a `bench.model_runtime` JSON (its CUDA-graph ratios) or a verify-cost JSON."""
    data = json.loads(pathlib.Path(path).read_text())
    if data.get("kind") == "treeserve.bench.verify-cost":
        return {s: dict(e, source=path) for s, e in data["shapes"].items()}
    g = data["graphs"]
    entry = {
        "source": path, "device": data.get("device"), "layers": data.get("layers", "all"),
        "decode_ms": g["decode_ms"],
        "verify_ms": {int(k): v for k, v in g["verify_ms"].items()},
        "ratios": {int(k): v for k, v in g["verify_ratio"].items()},
    }
    if g.get("verify_commit_ms"):
        entry["round_ratios"] = {int(k): v / g["decode_ms"] for k, v in g["verify_commit_ms"].items()}
    return {data["shape"]: entry}


def _int_keys(entry: dict) -> dict:
    """JSON turns int keys into strings; undo that for the ratio tables."""
    out = dict(entry)
    for key in ("verify_ms", "ratios", "round_ratios", "verify_commit_ms"):
        if isinstance(out.get(key), dict):
            out[key] = {int(k): v for k, v in out[key].items()}
    return out


# ---- measurement (GPU) -----------------------------------------------------------------------------
def measure(shape: str, sizes: list[int], layers: Optional[int]) -> dict:
    """Random bf16 weights at `shape`: decode step and verify times with CUDA graphs, batch 1."""
    import random

    import torch

    from bench.model_runtime import PROMPT, bench_runtime, build_hf
    from models import HybridLM

    model = build_hf(shape, layers)
    vocab = model.config.vocab_size
    lm = HybridLM.from_hf_model(model, max_slots=2, max_len=PROMPT + 256 + max(sizes), cuda_graphs=False)
    del model
    torch.cuda.empty_cache()
    r = bench_runtime(lm, True, sorted(set(sizes)), random.Random(0), vocab, max_decode=30)
    entry = {
        "source": "measured", "device": torch.cuda.get_device_name(), "layers": layers or "all",
        "params": sum(p.numel() for p in lm.parameters()), "decode_ms": r["decode_ms"],
        "verify_ms": r["verify_ms"], "ratios": r["verify_ratio"],
        "round_ratios": {n: ms / r["decode_ms"] for n, ms in r["verify_commit_ms"].items()},
        "verify_commit_ms": r["verify_commit_ms"],
    }
    del lm
    torch.cuda.empty_cache()
    return entry


# ---- the command -------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    shapes: dict[str, dict] = {}
    for f in args.ratios:
        shapes.update({s: _int_keys(e) for s, e in ratios_from_file(f).items()})
    todo = [s for s in args.shapes if s not in shapes]
    if todo:
        import torch

        if not torch.cuda.is_available():
            print(f"verify-cost: measuring {', '.join(todo)} needs a CUDA GPU (or pass --ratios JSON)", file=sys.stderr)
            return 2
        for s in todo:
            print(f"measuring {s} ...", flush=True)
            shapes[s] = measure(s, args.sizes, args.layers)
    report: dict = {"kind": "treeserve.bench.verify-cost", "version": 1, "shapes": shapes}
    for s, e in shapes.items():
        print(f"\n{s} ({e.get('device')}, layers {e.get('layers', 'all')}, source {e['source']}): "
              f"decode step {e['decode_ms']:.2f} ms")
        print("  tree nodes   " + "".join(f"{n:>7d}" for n in sorted(e["ratios"])))
        print("  verify/decode" + "".join(f"{e['ratios'][n]:7.2f}" for n in sorted(e["ratios"])))
        if e.get("round_ratios"):
            print("  +commit      " + "".join(f"{e['round_ratios'][n]:7.2f}" for n in sorted(e["round_ratios"])))
    if args.tau is not None:
        report["label"] = LABEL
        report["projection"] = _projection(args.tau, shapes)
        if report["projection"] is None:
            return 2
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(report, indent=1))
        print(f"\nwrote {args.out}")
    return 0


def _projection(tau_arg: str, shapes: dict[str, dict]) -> Optional[dict]:
    try:
        fixed = float(tau_arg)
    except ValueError:
        fixed = None
    print(f"\n{LABEL}.")
    out: dict = {}
    if fixed is not None:
        out["tau"] = fixed
        for s, e in shapes.items():
            rows = project_fixed_tau(fixed, e["ratios"])
            out[s] = rows
            print(f"\n{s}: tau = {fixed:g}")
            print("  tree nodes          " + "".join(f"{r['nodes']:>7d}" for r in rows))
            print("  projected speedup   " + "".join(f"{r['projected_speedup']:7.2f}" for r in rows))
        return out
    path = pathlib.Path(tau_arg)
    if not path.is_file():
        print(f"verify-cost: --tau {tau_arg!r} is neither a number nor a file", file=sys.stderr)
        return None
    e2e = json.loads(path.read_text())
    rows = tau_rows(e2e)
    cfg = e2e.get("config", {})
    out["tau_source"] = {"file": str(path), "device": cfg.get("device_name"), "target": cfg.get("target"),
                         "drafter": cfg.get("drafter"), "dtype": cfg.get("dtype")}
    print(f"tau from {path} ({cfg.get('device_name')}, {cfg.get('dtype')}, target {cfg.get('target')})")
    for s, e in shapes.items():
        proj = project(rows, e["ratios"], e.get("round_ratios"))
        out[s] = proj
        print(f"\n{s} (verify cost from {e.get('device')}):")
        print(f"  {'method':<20} {'path':<7} {'T':>3} {'tau':>6} {'nodes':>6} {'ratio':>6} {'PROJ x plain':>12} "
              f"{'+commit':>8} {'PROJ x chain':>12} {'measured x plain (demo)':>24}")
        for p in proj:
            flag = "*" if p["outside_measured"] else " "
            print(f"  {p['method']:<20} {p['path']:<7} {p['temperature']:>3g} {p['tau']:6.2f} {p['mean_nodes']:6.1f} "
                  f"{p['verify_ratio']:6.2f}{flag}{p['projected_speedup']:12.2f} "
                  f"{_f(p.get('projected_speedup_with_commit')):>8} {_f(p['projected_vs_chain']):>12} "
                  f"{_f(p['measured_speedup_vs_plain']):>24}")
    print("\n(* tree size outside the measured sizes: nearest measured ratio used)")
    return out


def _f(x) -> str:
    return "—" if x is None else f"{x:.2f}"
