"""Draft-ahead: prepare the next tree for the likely outcomes while the current one is verified.

After a tree T goes out, a *round* of background work starts for its sequence:

1. finalise: one draft forward over the whole of T on the sequence's own slot. It gives the draft
   distribution at every node (for predicting outcomes) and leaves the slot able to commit any
   path of T without another forward pass. Fresh drafting always starts from this point too: a
   request that arrives before the worker got to it runs it first.
2. predict: outcome (accepted node a, bonus token b) gets the estimate
   P(reach a) * q_a(b), with P(reach a) the product of draft probabilities along a's path and b
   ranging over tokens that are not children of a (a greedy target would have accepted those).
   Fan-out is geometric: the node most likely to end the walk may propose `fanout` bonus tokens,
   the next one half as many, and so on (at least one each); the `trees` most probable outcomes win.
3. one job per predicted outcome, likeliest first: fork the slot, repeat the finalising forward
   on the fork (bit-identical, so it can commit the same way), commit the outcome's path, draft the
   next tree exactly as fresh drafting would (same proposer, same single-slot calls), and finalise
   that tree in turn.

When the outcome arrives, the round stops. A finished (or running) job for that outcome is a *hit*:
its forked state becomes the sequence's state and its tree is the answer, identical to what fresh
drafting would give. Anything else is a *miss*: unfinished jobs are abandoned, forks freed, and the
tree is drafted fresh. Either way the draft state holds exactly the committed tokens (its model
slot catches up on them before its next forward pass, `DraftState.catch_up`).

Rounds of different sequences share one worker thread, round-robin, one unit of work at a time,
and yield to foreground requests (`Gate`).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from drafter_service.draftlm import Gate
from drafter_service.proposer import Draft, Proposer, draft_tree, fits
from drafter_service.state import Abandoned, DraftState
from models.graphs import CAPTURE_LOCK
from treeserve.tree import TokenTree

log = logging.getLogger("treeserve.drafter.ahead")

Key = tuple  # (appended tokens, bonus token, budget)


@dataclass(frozen=True)
class AheadConfig:
    """trees: most outcomes prepared per round; fanout: most bonus guesses for the likeliest node."""

    trees: int = 4
    fanout: int = 4


@dataclass(frozen=True)
class Prediction:
    path: tuple[int, ...]  # accepted nodes, root first
    bonus: int
    prob: float  # estimated probability of this outcome

    def appended(self, tree: TokenTree) -> tuple[int, ...]:
        return tuple(tree.tokens_along(self.path))


def predict(tree: TokenTree, probs: torch.Tensor, config: AheadConfig, columns=None) -> list[Prediction]:
    """The likeliest outcomes of verifying `tree`, best first. probs (N, K): the draft distribution
    at each node (the one children were ranked or drawn by) over the columns of the draft head
    `columns` (`head.DraftHead`; None: column c is token c). Tokens outside the columns have
    probability 0 (a tree may hold them: fused trees take n-gram nodes)."""
    if config.trees <= 0:
        return []
    n, width = probs.shape
    kids = [set(tree.tokens[c] for c in tree.children(i)) for i in range(n)]
    k = min(width, config.fanout + max(len(s) for s in kids))
    top_p, top_c = torch.topk(probs.float(), k, dim=-1)
    top_t = top_c if columns is None else columns.to_tokens(top_c)
    parents = torch.tensor(tree.parents[1:], dtype=torch.long).to(probs.device, non_blocking=True)
    tokens = torch.tensor(tree.tokens[1:], dtype=torch.long).to(probs.device, non_blocking=True)
    if columns is None:
        cols = torch.where(tokens < width, tokens, torch.full_like(tokens, -1))
    else:
        cols = columns.columns_of(tokens)
    edge = torch.where(cols >= 0, probs[parents, cols.clamp(min=0)], torch.zeros_like(cols, dtype=probs.dtype))
    # one transfer: edge probabilities, then the top-k probabilities and tokens
    host = torch.cat([edge.double(), top_p.double().flatten(), top_t.double().flatten()]).cpu().numpy()
    edge = host[: n - 1].tolist()
    top_p = host[n - 1 : n - 1 + n * k].reshape(n, k).tolist()
    top_t = host[n - 1 + n * k :].reshape(n, k).astype("int64").tolist()
    reach = [1.0] * n
    for i in range(1, n):
        reach[i] = reach[tree.parents[i]] * edge[i - 1]
    stop = [reach[i] * max(0.0, 1.0 - sum(p for p, t in zip(top_p[i], top_t[i]) if t in kids[i])) for i in range(n)]
    guesses: list[Prediction] = []
    for rank, i in enumerate(sorted(range(n), key=lambda j: (-stop[j], j))):
        allowed = max(1, config.fanout >> rank)
        mine = [(p, t) for p, t in zip(top_p[i], top_t[i]) if t not in kids[i] and p > 0.0][:allowed]
        path = tuple(tree.path_to(i))
        guesses += [Prediction(path, t, reach[i] * p) for p, t in mine]
    guesses.sort(key=lambda g: -g.prob)
    return guesses[: config.trees]


@dataclass
class Prepared:
    """A finished job: the state after the outcome and its next tree (already finalised)."""

    state: DraftState
    draft: Draft
    predictions: list[Prediction]
    build_ms: float


@dataclass
class Job:
    key: Key
    prediction: Prediction
    appended: tuple[int, ...]
    result: Prepared | None = None
    done: bool = False


@dataclass
class Round:
    """Background work for one sequence after it sent `tree` (see the module docstring)."""

    base: DraftState  # the sequence's own state (not owned by the round)
    tree: TokenTree
    proposer: Proposer
    budget: int
    depth: int
    config: AheadConfig
    predictions: list[Prediction] | None = None  # known when the base state was prepared ahead
    jobs: list[Job] = field(default_factory=list)
    finalised: bool = False
    stopped: bool = False
    keep: Key | None = None
    running: object = None
    cv: threading.Condition = field(default_factory=threading.Condition)

    def __post_init__(self):
        if self.predictions is not None:
            self.finalised = True
            self._plan(self.predictions)

    def _plan(self, predictions: list[Prediction]) -> None:
        for p in predictions:
            appended = p.appended(self.tree)
            self.jobs.append(Job(key_of(appended, p.bonus, self.budget), p, appended))

    # ---- worker side ------------------------------------------------------------------------
    def has_work(self) -> bool:
        with self.cv:
            return not self.stopped and (not self.finalised or any(not j.done for j in self.jobs))

    def run_one(self) -> None:
        """Run the next unit of work (finalise, or the next job)."""
        with self.cv:
            if self.stopped:
                return
            unit = "finalise" if not self.finalised else next((j for j in self.jobs if not j.done), None)
            if unit is None:
                return
            self.running = unit
        try:
            # the device work of this thread must not overlap a lazy graph capture of a target model
            # sharing the process (models.graphs.CAPTURE_LOCK)
            if unit == "finalise":
                with CAPTURE_LOCK:
                    probs = self.base.node_probs(self.tree)
                    preds = predict(self.tree, probs, self.config, self.base.picker.columns)
                with self.cv:
                    self.finalised = True
                    self._plan(preds)
            else:
                with CAPTURE_LOCK:
                    result = self._prepare(unit)
                with self.cv:
                    unit.result, unit.done = result, True
        except Exception:  # noqa: BLE001 - a failed job is a miss, never an error for the client
            log.exception("draft-ahead work failed for sequence %s", self.base.sequence_id)
            with self.cv:
                if unit == "finalise":
                    self.stopped = True
                else:
                    unit.done = True
        finally:
            with self.cv:
                self.running = None
                self.cv.notify_all()

    def _abandoned(self, job: Job) -> bool:
        with self.cv:
            return self.stopped and self.keep != job.key

    def _prepare(self, job: Job) -> Prepared | None:
        state = self.base.fork()
        if state is None:
            return None
        state.abandoned = lambda: self._abandoned(job)
        try:
            state.prepare(self.tree)  # the same forward the base slot finalised with
            t0 = time.perf_counter()
            state.advance(job.appended)
            draft = draft_tree(self.proposer, state, job.prediction.bonus, self.budget, self.depth)
            build_ms = (time.perf_counter() - t0) * 1e3
            if not fits(state, draft.tree):  # at the model's length: no forward for its predictions
                state.release()
                return None
            preds = predict(draft.tree, state.node_probs(draft.tree), self.config, state.picker.columns)
        except Abandoned:
            state.release()
            return None
        except BaseException:
            state.release()
            raise
        state.abandoned = None
        return Prepared(state, draft, preds, build_ms)

    # ---- foreground side --------------------------------------------------------------------
    def claim(self, key: Key | None) -> tuple[Prepared | None, bool, bool]:
        """Stop the round and take the job for `key`, waiting for it when it is running.

        Returns (prepared state or None, whether it had finished before the call, whether the base
        slot still needs its finalising forward). Every other prepared state is freed."""
        with self.cv:
            self.stopped, self.keep = True, key
            ready = any(j.key == key and j.done and j.result is not None for j in self.jobs)
            self.cv.wait_for(lambda: self.running is None)
            hit = next((j.result for j in self.jobs if j.key == key and j.result is not None), None)
            others = [j.result for j in self.jobs if j.result is not None and j.result is not hit]
            finalised = self.finalised
        for prepared in others:
            prepared.state.release()
        return hit, ready, not finalised


class Worker:
    """One background thread running rounds round-robin; pauses while foreground work is active."""

    def __init__(self, gate: Gate):
        self._gate = gate
        self._rounds: collections.deque[Round] = collections.deque()
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="draft-ahead", daemon=True)
        self._thread.start()

    def submit(self, rnd: Round) -> None:
        with self._cv:
            # rounds with nothing left to do (claimed by their next draft) go here too, not only
            # when the worker next looks: it can wait at the gate for as long as requests keep coming
            self._rounds = collections.deque(r for r in self._rounds if r.has_work())
            self._rounds.append(rnd)
            self._cv.notify_all()

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Block until no round has work left (tests and benchmarks)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._busy and not any(r.has_work() for r in self._rounds), timeout)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5.0)

    def _next(self) -> Round | None:
        with self._cv:
            while True:
                if self._closed:
                    return None
                while self._rounds and not self._rounds[0].has_work():
                    self._rounds.popleft()
                if self._rounds:
                    rnd = self._rounds.popleft()
                    self._rounds.append(rnd)  # round-robin: others get their next unit first
                    self._busy = True
                    return rnd
                self._cv.notify_all()
                self._cv.wait()

    def _loop(self) -> None:
        while True:
            rnd = self._next()
            if rnd is None:
                return
            self._gate.wait_for_idle()
            try:
                rnd.run_one()
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()


def key_of(appended, bonus: int, budget: int) -> Key:
    return (tuple(int(t) for t in appended), int(bonus), int(budget))
