"""`treeserve demo`: start everything on the embedded demo pair, complete a few Python prompts
greedily with and without speculation, show them (they must be identical) with the measured
speedup and tokens per target forward pass (tau), then shut down. Works offline.

Speculative runs: a fixed tree or chain (what the drafter achieves), and by default also the
adaptive policy, which may shrink the trees, draft them by n-gram lookup instead of the draft
model, or turn speculation off where it does not pay; the demo then says what the policy chose and
why."""
from __future__ import annotations

import argparse
import logging
import sys
import time

import grpc

from orchestrator.cli_serve import LaunchFailed, SetupError, launch_or_say_why, plan_from
from orchestrator.client import GenerationClient, Result, request
from orchestrator.generation import FrontLimits
from orchestrator.procs import stop_all
from orchestrator.runtime import OrchestratorConfig
from treeserve.server import count_argument

# the speculative runs per --speculation choice: (label, mode); explicit modes are not adaptive
RUNS = {
    "auto": (("fixed tree", "tree"), ("adaptive", "auto")),
    "tree": (("fixed tree", "tree"),),
    "chain": (("fixed chain", "chain"),),
}

PROMPTS = [
    "def fibonacci(n):\n",
    "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n",
    "def merge_sorted(a, b):\n    result = []\n",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="DIR", help="target checkpoint (default: the embedded demo model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--drafter-model", default=None, metavar="DIR", help="draft checkpoint (default: the demo drafter)")
    src.add_argument("--ngram", action="store_true", help="model-free n-gram drafting")
    p.add_argument("--device", default="auto", help="auto (cuda when available), cpu, cuda or cuda:N")
    p.add_argument("--max-new-tokens", type=count_argument(1, FrontLimits.max_new_tokens), default=64)
    p.add_argument("--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} built-in prompts to run")
    p.add_argument("--speculation", choices=("auto", "chain", "tree"), default="auto",
                   help="auto: a fixed tree and adaptive tree speculation; chain / tree: that fixed shape only")
    p.add_argument("--log-dir", default=None, help="where the services write their logs (default: temp files)")


def _args_for_plan(args: argparse.Namespace) -> argparse.Namespace:
    return argparse.Namespace(model=args.model, drafter_model=args.drafter_model, ngram=args.ngram, no_drafter=False,
                              device=args.device, drafter_device="cpu", verifier_replicas=1, max_sequences=None)


def run(args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    logging.getLogger().setLevel(logging.WARNING)  # the demo's output is the completions
    try:
        plan = plan_from(_args_for_plan(args))
    except SetupError as exc:
        print(f"treeserve demo: {exc}", file=sys.stderr)
        return 2
    drafting = "n-gram lookup" if plan.drafter is None else plan.drafter.name
    print(f"starting: target {plan.target.name} on {plan.device}, drafter {drafting} ...", flush=True)
    config = OrchestratorConfig(verifiers=[], port=0, tokenizer=str(plan.target), quiet=True)
    try:
        children, orch = launch_or_say_why(plan, config, args.log_dir)
    except LaunchFailed as exc:
        print(f"treeserve demo: {exc}", file=sys.stderr)
        return 1
    try:
        print(f"ready in {time.perf_counter() - t_start:.0f} s\n", flush=True)
        with GenerationClient(f"127.0.0.1:{orch.port}") as client:
            return _compare(client, PROMPTS[:max(1, args.prompts)], args)
    except grpc.RpcError as exc:  # a service refused a request, or failed midway
        print(f"treeserve demo: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    finally:
        orch.stop()
        stop_all(children)
        print(f"\n(done in {time.perf_counter() - t_start:.0f} s)", flush=True)


def speculative_requests(prompt: str, max_new_tokens: int, speculation: str) -> list[tuple[str, object]]:
    """(label, request) of each speculative run for one prompt. Only `auto` is adaptive: a named
    mode gets exactly that tree every step, so its tau is the drafter's."""
    return [(label, request(prompt, max_new_tokens=max_new_tokens, speculation=mode, adaptive=mode == "auto"))
            for label, mode in RUNS[speculation]]


def _decode_steps(results: list[Result]) -> list[tuple[int, int, float]]:
    """(tree nodes, tokens, ms) of each verify step of `results` (the prefill message has no tree)."""
    return [s for r in results for s in r.steps if s[0] > 0]


def _rate(results: list[Result]) -> float:
    """Tokens per second after each request's first token, over all of them."""
    span = sum(r.seconds - r.first_token_s for r in results)
    tokens = sum(max(0, len(r.token_ids) - 1) for r in results)
    return tokens / span if span > 0 else 0.0


def _ms_per_token(results: list[Result]) -> float:
    steps = _decode_steps(results)
    tokens = sum(t for _, t, _ in steps)
    return sum(ms for _, _, ms in steps) / tokens if tokens else 0.0


def adaptive_note(plain: list[Result], fixed: list[Result], adaptive: list[Result], fixed_label: str) -> str:
    """What the adaptive policy chose, and the measurements that explain it."""
    steps = _decode_steps(adaptive)
    trees = sorted(n for n, _, _ in steps if n > 1)
    if not steps:
        return "adaptive policy: no decode steps"
    plain_ms, fixed_ms = _ms_per_token(plain), _ms_per_token(fixed)
    fixed_tau = sum(r.mean_accepted for r in fixed) / len(fixed)
    cost = (f"a {fixed_label} step cost {fixed_ms:.1f} ms per token emitted (tau {fixed_tau:.2f}, drafting "
            f"included),\n  plain decoding {plain_ms:.1f} ms per token")
    if len(trees) * 2 < len(steps):
        off = (f"adaptive policy: speculation off on {len(steps) - len(trees)} of {len(steps)} steps (the rest: "
               f"its first trees and periodic probes)")
        if fixed_ms >= plain_ms:
            return f"{off}, because\n  {cost}: drafting costs more than it saves on this machine"
        return f"{off}, although\n  {cost}: too few steps for the policy to learn that trees pay"
    tau = sum(r.mean_accepted for r in adaptive) / len(adaptive)
    return (f"adaptive policy: trees on {len(trees)} of {len(steps)} steps, typically {trees[len(trees) // 2]} "
            f"nodes, tau {tau:.2f} (each tree the drafter's default shape or an n-gram lookup, whichever pays);\n"
            f"  {cost}")


def _compare(client: GenerationClient, prompts: list[str], args: argparse.Namespace) -> int:
    n = args.max_new_tokens
    # one short request first, so one-time costs (first forward, allocations) stay out of the timings
    client.generate(request(prompts[0], max_new_tokens=4, speculation="off"), timeout=600)
    labels = [label for label, _ in RUNS[args.speculation]]
    width = max(len("plain decoding"), *map(len, labels))
    plain_runs: list[Result] = []
    spec_runs: dict[str, list[Result]] = {label: [] for label in labels}
    mismatches = 0
    for prompt in prompts:
        plain = client.generate(request(prompt, max_new_tokens=n, speculation="off"), timeout=600)
        plain_runs.append(plain)
        print("─" * 72)
        print(prompt + plain.text)
        print("─" * 72)
        print(f"  {'plain decoding':<{width}} : {plain.tokens_per_s:7.1f} tokens/s")
        for label, req in speculative_requests(prompt, n, args.speculation):
            spec = client.generate(req, timeout=600)
            spec_runs[label].append(spec)
            same = plain.token_ids == spec.token_ids
            mismatches += not same
            print(f"  {label:<{width}} : {spec.tokens_per_s:7.1f} tokens/s   tau = {spec.mean_accepted:.2f} tokens per "
                  f"target forward   output {'identical' if same else 'DIFFERENT'}", flush=True)
        print()
    plain_rate = _rate(plain_runs)
    print("overall:")
    print(f"  {'plain decoding':<{width}} : {plain_rate:7.1f} tokens/s")
    for label, runs in spec_runs.items():
        rate = _rate(runs)
        print(f"  {label:<{width}} : {rate:7.1f} tokens/s -> speedup {rate / plain_rate if plain_rate else 0.0:.2f}x, "
              f"mean tau {sum(r.mean_accepted for r in runs) / len(runs):.2f}")
    if "adaptive" in spec_runs:
        fixed_label = labels[0]
        print(adaptive_note(plain_runs, spec_runs[fixed_label], spec_runs["adaptive"], fixed_label))
    if mismatches:
        print(f"{mismatches} completion(s) differ from plain decoding: this is a bug", file=sys.stderr)
        return 1
    print("every speculative completion is token-for-token identical to plain greedy decoding")
    return 0
