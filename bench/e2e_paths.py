"""The ways `bench e2e` generates text, each returning the same `Trace` per prompt.

- `HFPath`: transformers' own `generate` on the target checkpoint (the baseline a user would run).
- `InprocPath`: the verifier's and the drafter's engines (`verifier_service.engine.Engine`,
  `drafter_service.engine.Drafter`) in this process, driven by the orchestrator's step logic
  (`orchestrator.steps`: fit the tree, accept, advance the committed-token log) at batch 1. No
  gRPC, no threads: the cost of the model work and the step logic alone.
- `GrpcPath`: the orchestrator's engine loop (`orchestrator.engine.Engine`) in this process (no
  Ray), talking gRPC to a `treeserve verifier` and a `treeserve drafter` child process: the
  serving path, RPCs and draft-ahead included.

Every path generates exactly `max_new_tokens` tokens per prompt (end-of-sequence tokens do not
stop it), so all methods do the same amount of work. Times are wall-clock per prompt, prefill
included; CUDA work is finished before the clock stops (every step reads its tokens back).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from treeserve.sampling import Sampling

NO_EOS: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Method:
    """One row of the benchmark. shape None: plain decoding (one-node trees, speculation off).
    adaptive (gRPC only): the request names no speculation settings at all, as a client that leaves
    them to the server does, so the engine's adaptive policy picks each step's budget (or none) and
    the drafter its default shape; `shape` then names that default, and `budget` is 0."""

    name: str
    path: str  # "hf", "inproc" or "grpc"
    shape: Optional[str] = None  # chain, static, dynamic, ngram
    budget: int = 1  # nodes per tree, root included
    depth: int = 0  # most draft tokens on one path
    draft_ahead: bool = False
    adaptive: bool = False

    @property
    def speculative(self) -> bool:
        return self.shape is not None


@dataclass
class Trace:
    """One prompt's generation. `emitted[i]` / `nodes[i]`: tokens emitted (accepted drafts plus the
    bonus token) and tree nodes verified by target forward i after the prefill."""

    tokens: list[int]
    seconds: float
    emitted: list[int] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    draft_ms: float = 0.0  # drafting time, summed over steps (as the drafter measured it)
    verify_ms: float = 0.0  # target verification time, summed over steps (in-process only)
    trees: int = 0  # trees the drafter delivered
    ahead_hits: int = 0  # of which prepared ahead of time

    @property
    def steps(self) -> int:
        return len(self.emitted)


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# ---- transformers ---------------------------------------------------------------------------------
class HFPath:
    """transformers' `generate` (greedy, or multinomial sampling at the temperature) on the target."""

    def __init__(self, target_dir, device: str, dtype):
        import torch
        from transformers import AutoModelForCausalLM

        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=dtype).to(device).eval()
        gc = self.model.generation_config
        gc.eos_token_id = None  # generate exactly max_new_tokens, like the other paths
        gc.pad_token_id = 0 if gc.pad_token_id is None else gc.pad_token_id
        self._torch = torch

    def generate(self, prompt: Sequence[int], n: int, s: Sampling, method: Method, rid: str) -> Trace:
        torch = self._torch
        ids = torch.tensor([list(prompt)], device=self.device)
        kw = dict(max_new_tokens=n, do_sample=not s.greedy)
        if not s.greedy:
            torch.manual_seed(s.seed)
            kw.update(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p or 1.0)
        sync(self.device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        sync(self.device)
        seconds = time.perf_counter() - t0
        tokens = out[0, len(prompt):].tolist()
        # one forward per token, the first of them the prefill
        return Trace(tokens, seconds, emitted=[1] * (len(tokens) - 1), nodes=[1] * (len(tokens) - 1))

    def close(self) -> None:
        del self.model


# ---- in-process engines + the orchestrator's step logic -----------------------------------------------
class InprocPath:
    """`verifier` is a `verifier_service.engine.Engine`, `drafter` a `drafter_service.engine.Drafter`
    (None: plain decoding only). `max_tree_nodes` / `max_sequence_length` play the verifier's
    limits for `steps.tree_limits`."""

    def __init__(self, verifier, drafter, max_tree_nodes: int, max_sequence_length: int):
        self.verifier = verifier
        self.drafter = drafter
        self.max_tree_nodes = max_tree_nodes
        self.max_sequence_length = max_sequence_length

    def generate(self, prompt: Sequence[int], n: int, s: Sampling, method: Method, rid: str) -> Trace:
        from drafter_service.engine import DraftCall, Options
        from orchestrator.adaptive import FixedPolicy
        from orchestrator.request import RequestSpec, RequestState, Speculation
        from orchestrator.steps import accept, advance, fit_tree, in_original, take_output, tree_limits
        from treeserve.tree import TokenTree
        from verifier_service.engine import VerifyWork

        spec = RequestSpec(rid, tuple(prompt), s, n, Speculation(mode="tree" if method.speculative else "off"), rid)
        st = RequestState(spec, list(prompt), FixedPolicy(method.budget))
        trace = Trace([], 0.0)
        t0 = time.perf_counter()
        _, first = self.verifier.prefill(rid, tuple(prompt), s)
        st.started, st.needs_prefill = True, False
        st.tokens.append(first)
        out, finish = take_output(st, [first], NO_EOS)
        drafting = method.speculative and self.drafter is not None
        if drafting:
            self.drafter.start(rid, list(prompt), s, Options(method.shape, method.budget, method.depth, False))
        known = len(prompt)  # committed tokens the drafter has seen
        told = None  # last step's outcome, in the drafter's node indices
        try:
            while finish is None:
                tree, kept, drafted = TokenTree.single(st.root), None, False
                max_nodes, max_depth = tree_limits(st, self.max_tree_nodes, self.max_sequence_length)
                if drafting and max_depth > 0:
                    call = DraftCall(rid, st.committed, tuple(st.tokens[known:st.committed]), st.root, told)
                    reply = self.drafter.draft(call)
                    known = st.committed
                    trace.draft_ms += reply.draft_ms
                    trace.trees += 1
                    trace.ahead_hits += int(reply.from_draft_ahead)
                    tree, kept = fit_tree(reply.tree, max_nodes, max_depth)
                    drafted = True
                tv = time.perf_counter()
                report = self.verifier.verify([VerifyWork(rid, st.committed, tree, st.pending_commit)])
                trace.verify_ms += (time.perf_counter() - tv) * 1e3
                item = report.outputs[0]
                if item.error is not None:
                    raise item.error
                outcome = accept(tree, item.result.target_tokens, item.result.walk)
                emitted, finish = advance(st, tree, outcome, NO_EOS)
                out += emitted
                trace.emitted.append(len(outcome.accepted_nodes))
                trace.nodes.append(tree.size)
                told = in_original(outcome, kept) if drafted else None
            trace.seconds = time.perf_counter() - t0
        finally:
            self.verifier.release(rid)
            if drafting:
                self.drafter.end(rid)
        trace.tokens = out
        return trace

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.close()


# ---- the orchestrator's engine loop against service processes -------------------------------------------
class GrpcPath:
    """`orchestrator.engine.Engine` (its own thread, as in serving) on verifier/drafter addresses."""

    # a bound far above any healthy draft (a fresh CPU drafter's first trees on a busy machine
    # included): a benchmark wants every step's tree, not a lagging link's one-node trees
    def __init__(self, verifier: str, drafter: Optional[str], draft_timeout_s: float = 30.0):
        from orchestrator.engine import Engine, EngineConfig

        self.engine = Engine(EngineConfig(verifier=verifier, drafter=drafter, name="bench",
                                          draft_timeout_s=draft_timeout_s)).start()
        # The engine stops a request at the verifier's end-of-sequence ids; the benchmark wants
        # every method to generate the same number of tokens.
        self.engine.eos = NO_EOS

    def generate(self, prompt: Sequence[int], n: int, s: Sampling, method: Method, rid: str,
                 timeout_s: float = 120.0) -> Trace:
        from orchestrator.request import RequestSpec, Speculation
        from drafter_service.servicer import SHAPE_ENUMS

        if method.adaptive:
            sp = Speculation()  # every default: what a request that names nothing gets
        elif method.speculative:
            mode = "chain" if method.shape == "chain" else "tree"
            sp = Speculation(mode=mode, shape=SHAPE_ENUMS[method.shape], node_budget=method.budget,
                             max_depth=method.depth, draft_ahead=method.draft_ahead, adaptive=False)
        else:
            sp = Speculation(mode="off", adaptive=False)
        spec = RequestSpec(rid, tuple(prompt), s, n, sp, front=rid)
        link = self.engine.link
        before = (link.stats.trees, link.stats.draft_ahead_hits, link.stats.draft_ms) if link is not None else None
        trace = Trace([], 0.0)
        t0 = time.perf_counter()
        refused = self.engine.submit(spec)
        if refused is not None:
            raise RuntimeError(f"engine refused the request: {refused[1]}")
        deadline = t0 + timeout_s
        done = False
        while not done:
            if time.perf_counter() > deadline:
                self.engine.cancel(rid)
                raise TimeoutError(f"{rid}: no finish after {timeout_s:.0f} s")
            for ev in self.engine.outbox.drain(rid, timeout=1.0)[1]:
                if ev.error is not None:
                    raise RuntimeError(f"{rid} failed ({ev.error[0]}): {ev.error[1]}")
                if ev.moved_to is not None:
                    continue
                trace.tokens.extend(ev.tokens)
                if ev.tree_nodes > 0:  # a speculation step (the prefill's event has none)
                    trace.emitted.append(len(ev.tokens))
                    trace.nodes.append(ev.tree_nodes)
                done = done or ev.last
        trace.seconds = time.perf_counter() - t0
        if before is not None:
            trace.trees = link.stats.trees - before[0]
            trace.ahead_hits = link.stats.draft_ahead_hits - before[1]
            trace.draft_ms = link.stats.draft_ms - before[2]
        return trace

    def speculate_address(self, wait_s: float = 10.0) -> Optional[str]:
        """Where the engine's Speculate stream goes (the drafter's direct port when it has one),
        once its link is up; None without a drafter or when it does not come up in `wait_s`."""
        link = self.engine.link
        deadline = time.monotonic() + wait_s
        while link is not None and link.speculate_address is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return None if link is None else link.speculate_address

    def close(self) -> None:
        self.engine.stop()
