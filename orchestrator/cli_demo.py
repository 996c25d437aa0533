"""`treeserve demo`: start everything on the embedded demo pair, complete a few Python prompts
greedily with and without speculation, show both (they must be identical) with the measured
speedup and tokens per target forward pass (tau), then shut down. Works offline."""
from __future__ import annotations

import argparse
import logging
import sys
import time

from orchestrator.cli_serve import SetupError, launch, plan_from
from orchestrator.client import GenerationClient, request
from orchestrator.procs import stop_all
from orchestrator.runtime import OrchestratorConfig

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
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--prompts", type=int, default=3, help=f"how many of the {len(PROMPTS)} built-in prompts to run")
    p.add_argument("--speculation", choices=("auto", "chain", "tree"), default="auto",
                   help="auto: adaptive tree speculation")
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
    children, orch = launch(plan, config, args.log_dir)
    try:
        print(f"ready in {time.perf_counter() - t_start:.0f} s\n", flush=True)
        with GenerationClient(f"127.0.0.1:{orch.port}") as client:
            return _compare(client, PROMPTS[:max(1, args.prompts)], args)
    finally:
        orch.stop()
        stop_all(children)
        print(f"\n(done in {time.perf_counter() - t_start:.0f} s)", flush=True)


def _compare(client: GenerationClient, prompts: list[str], args: argparse.Namespace) -> int:
    n = args.max_new_tokens
    # one short request first, so one-time costs (first forward, allocations) stay out of the timings
    client.generate(request(prompts[0], max_new_tokens=4, speculation="off"), timeout=600)
    plain_time = spec_time = 0.0
    plain_tokens = spec_tokens = 0
    taus, mismatches = [], 0
    for prompt in prompts:
        plain = client.generate(request(prompt, max_new_tokens=n, speculation="off"), timeout=600)
        spec = client.generate(request(prompt, max_new_tokens=n, speculation=args.speculation,
                                       adaptive=args.speculation != "auto"), timeout=600)
        same = plain.token_ids == spec.token_ids
        mismatches += not same
        print("─" * 72)
        print(prompt + spec.text)
        print("─" * 72)
        print(f"  plain decoding : {plain.tokens_per_s:7.1f} tokens/s")
        print(f"  speculative    : {spec.tokens_per_s:7.1f} tokens/s   tau = {spec.mean_accepted:.2f} tokens per "
              f"target forward   output {'identical' if same else 'DIFFERENT'}\n", flush=True)
        plain_time += plain.seconds - plain.first_token_s
        spec_time += spec.seconds - spec.first_token_s
        plain_tokens += max(0, len(plain.token_ids) - 1)
        spec_tokens += max(0, len(spec.token_ids) - 1)
        taus.append(spec.mean_accepted)
    plain_rate = plain_tokens / plain_time if plain_time > 0 else 0.0
    spec_rate = spec_tokens / spec_time if spec_time > 0 else 0.0
    speedup = spec_rate / plain_rate if plain_rate > 0 else 0.0
    print(f"overall: plain {plain_rate:.1f} tokens/s, speculative {spec_rate:.1f} tokens/s "
          f"-> speedup {speedup:.2f}x, mean tau {sum(taus) / len(taus):.2f}")
    if mismatches:
        print(f"{mismatches} completion(s) differ from plain decoding: this is a bug", file=sys.stderr)
        return 1
    print("every speculative completion is token-for-token identical to plain greedy decoding")
    return 0
