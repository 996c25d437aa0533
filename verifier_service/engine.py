"""Everything the verifier does to its model and its sequences, one call at a time.

The engine is single-threaded by design: only the thread holding the model in the batcher (its
model thread, or an RPC thread that found the model free) calls it, one at a time, so the model
never runs two forwards at once and the sequence table needs no locks. Requests arrive here
already decoded and validated against the static limits (trees, prompts, sampling); what needs
the live state (unknown ids, lengths, commits, free slots) is checked here.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from models.errors import SequenceTooLong, SlotsExhausted, StaleHandle
from treeserve.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, ServeError
from treeserve.sampling import Sampling
from treeserve.tree import TokenTree
from verifier_service import results
from verifier_service.limits import Limits
from verifier_service.metrics import metrics
from verifier_service.sequences import Sequence, SequenceTable, VerifiedTree, applied, plan_commit

log = logging.getLogger("treeserve.verifier")


class VerifyWork(NamedTuple):  # a tuple: made for every item of every step, cheaper than a frozen dataclass
    """One decoded Verify item. `commit` is (committed_length, accepted_nodes) or None."""

    sequence_id: str
    committed_length: int
    tree: TokenTree
    commit: tuple[int, tuple[int, ...]] | None = None
    top_logprobs: int = 0


@dataclass
class ItemOutput:
    """Exactly one of `result` and `error` is set."""

    committed_length: int = 0
    result: results.NodeResults | None = None
    error: BaseException | None = None


@dataclass
class BatchReport:
    outputs: list[ItemOutput]  # aligned with the works passed in
    forward_ms: float  # commits + forward + per-node results; 0 when nothing reached the model
    sequences: int  # trees that shared the forward
    nodes: int = 0  # tree nodes in the forward
    commits: int = 0  # piggy-backed commits applied before it


def prepare(lm, *, capture_graphs: bool) -> None:
    """Before a verifier serves: compile on CUDA what its requests launch (the model's kernels,
    `HybridLM.warm_up`, and the sampling kernels, `results.warm_up`) and, with `capture_graphs`,
    capture every CUDA graph bucket now instead of at each bucket's first use."""
    lm.warm_up()
    results.warm_up(lm.config.vocab_size, lm.device)
    if capture_graphs and lm.graphs is not None:
        lm.graphs.capture_all()


def runtime_error(exc: BaseException) -> BaseException:
    """The runtime's errors carry no gRPC code: give them the one the contract names."""
    if isinstance(exc, SlotsExhausted):
        return ResourceExhausted(f"no free state slot: {exc}")
    if isinstance(exc, SequenceTooLong):
        return InvalidArgument(str(exc))
    if isinstance(exc, StaleHandle):
        return FailedPrecondition(str(exc))
    return exc


class Engine:
    def __init__(self, lm, limits: Limits, clock=time.monotonic):
        self.lm = lm
        self.limits = limits
        self.table = SequenceTable()
        self.vocab_size = int(lm.config.vocab_size)
        self._clock = clock
        self._metrics = metrics()
        # totals for the Stats RPC (written by the model thread, read by any)
        self.verified_nodes = 0
        self.forward_passes = 0
        self.forward_ms_total = 0.0

    # ---- sequences ----------------------------------------------------------------------
    def prefill(self, sequence_id: str, prompt: tuple[int, ...], s: Sampling) -> tuple[int, int]:
        """Returns (committed_length, next_token). Idempotent for the same prompt and sampling."""
        seq = self.table.find(sequence_id)
        if seq is not None:
            if seq.prompt != prompt or seq.sampling != s:
                raise FailedPrecondition(
                    f"sequence {sequence_id!r} is live with another prompt or sampling; release it first"
                )
            seq.last_used = self._clock()
            return len(seq.prompt), seq.first_token
        if len(self.table) >= self.limits.max_sequences:
            raise ResourceExhausted(f"all {self.limits.max_sequences} sequence slots are in use")
        try:
            slot = self.lm.pool.alloc()
        except SlotsExhausted as exc:
            raise runtime_error(exc) from exc
        try:
            logits = self.lm.prefill([slot], [list(prompt)])
            pos = torch.tensor([len(prompt)], dtype=torch.long, device=logits.device)
            first = int(results.choose(logits[:1], s, pos)[0])
        except Exception as exc:
            self.lm.pool.free(slot)
            mapped = runtime_error(exc)
            if mapped is exc:
                raise
            raise mapped from exc
        self.table.add(Sequence(sequence_id, slot, prompt, s, first, len(prompt), self._clock()))
        self._metrics.prefills.inc()
        self._metrics.active_sequences.set(len(self.table))
        return len(prompt), first

    def release(self, sequence_id: str) -> bool:
        seq = self.table.pop(sequence_id)
        if seq is None:
            return False
        self.lm.pool.free(seq.slot)
        self._metrics.active_sequences.set(len(self.table))
        return True

    def sweep(self) -> list[str]:
        """Release sequences idle past the timeout; returns their ids."""
        gone = [s.id for s in self.table.idle(self._clock(), self.limits.idle_timeout_s)]
        for sid in gone:
            self.release(sid)
            self._metrics.expired.inc()
            log.info("released idle sequence %r", sid)
        return gone

    def commit(self, sequence_id: str, committed_length: int, accepted_nodes: tuple[int, ...]) -> int:
        """Explicit commit; returns the committed length afterwards."""
        seq = self.table.get(sequence_id)
        seq.last_used = self._clock()
        path = plan_commit(seq, committed_length, accepted_nodes)
        if path is not None:
            failed = self._apply_commits([(seq, path)])
            if failed:
                raise failed[seq.id]
            self._metrics.commits.inc()
        return seq.length

    # ---- verification -------------------------------------------------------------------
    def verify(self, works: list[VerifyWork]) -> BatchReport:
        """Commits first (one batched runtime call), then one forward over every remaining tree.
        A failing item gets its error; the others are unaffected. Its metrics are left to
        `record(report)`, for the caller to run once the answers are handed out: a handful of
        Prometheus updates cost tens of microseconds on a cold cache, on every step."""
        now = self._clock()
        outputs = [ItemOutput() for _ in works]
        staged: list[tuple[int, Sequence, list[int] | None]] = []
        seen: set[str] = set()
        for i, w in enumerate(works):
            try:
                if w.sequence_id in seen:  # the batcher never packs one sequence twice
                    raise InvalidArgument(f"sequence {w.sequence_id!r} appears twice in one batch")
                seen.add(w.sequence_id)
                seq = self.table.get(w.sequence_id)
                seq.last_used = now
                path = plan_commit(seq, *w.commit) if w.commit is not None else None
                self._check_verify(seq, w, seq.length + (len(path) if path else 0))
                staged.append((i, seq, path))
            except ServeError as exc:
                outputs[i].error = exc
        if not staged:
            return BatchReport(outputs, 0.0, 0)

        t0 = time.perf_counter()
        commits = [(seq, path) for _, seq, path in staged if path]
        failed = self._apply_commits(commits)
        ready = []
        for i, seq, _ in staged:
            if seq.id in failed:
                outputs[i].error = failed[seq.id]
            else:
                ready.append((i, seq))
        for i, seq in ready:
            outputs[i].committed_length = seq.length
        self._forward(ready, works, outputs)
        forward_ms = (time.perf_counter() - t0) * 1e3

        nodes = sum(works[i].tree.size for i, _ in ready)
        if ready:
            self.forward_passes += 1
            self.verified_nodes += nodes
            self.forward_ms_total += forward_ms
        # every commit that did not fail was applied (see _apply_commits)
        return BatchReport(outputs, forward_ms, len(ready), nodes, len(commits) - len(failed))

    def record(self, report: BatchReport) -> None:
        """The metrics of one `verify` batch (call once per report)."""
        m = self._metrics
        if report.commits:
            m.commits.inc(report.commits)
        if report.sequences:
            m.forward_passes.inc()
            m.nodes_verified.inc(report.nodes)
            m.batch_sequences.observe(report.sequences)
            m.batch_nodes.observe(report.nodes)
            m.forward_ms.observe(report.forward_ms)

    def _check_verify(self, seq: Sequence, w: VerifyWork, length: int) -> None:
        """`length`: the sequence's length once its piggy-backed commit is applied."""
        if w.committed_length != length:
            raise FailedPrecondition(
                f"sequence {seq.id!r}: tree built on length {w.committed_length}, but the sequence is at length {length}"
            )
        if length + w.tree.size > self.limits.max_sequence_length:
            raise InvalidArgument(
                f"sequence {seq.id!r}: a tree of {w.tree.size} nodes at length {length} exceeds the maximum "
                f"sequence length {self.limits.max_sequence_length}"
            )

    def _apply_commits(self, pairs: list[tuple[Sequence, list[int]]]) -> dict[str, BaseException]:
        """Commit every (sequence, path) in one runtime call; returns the errors by sequence id.
        Should the batched call fail before changing anything (a stale handle, a bad path), each
        commit is retried alone so one bad commit cannot fail the others (a commit the runtime did
        apply before failing shows in the slot's length). Should it fail midway (a device error),
        the states of its sequences are unknown: they are released, and each gets
        FAILED_PRECONDITION (prefill it again), never a commit applied twice."""
        if not pairs:
            return {}
        try:
            self.lm.commit([(seq.verified.pending, path) for seq, path in pairs])
        except Exception as exc:  # noqa: BLE001 - isolated below
            midway = not isinstance(exc, (StaleHandle, ValueError))  # those come before any change
            if midway:
                return {seq.id: self._commit_lost(seq, exc) for seq, _ in pairs}
            if len(pairs) == 1:
                return {pairs[0][0].id: self._commit_failed(pairs[0][0], exc)}
        else:
            for seq, path in pairs:
                applied(seq, path)
            return {}
        failed = {}
        for seq, path in pairs:
            if self.lm.pool.length(seq.slot) == seq.length + len(path):
                applied(seq, path)
                continue
            try:
                self.lm.commit([(seq.verified.pending, path)])
            except Exception as exc:  # noqa: BLE001
                failed[seq.id] = self._commit_failed(seq, exc)
            else:
                applied(seq, path)
        return failed

    def _commit_failed(self, seq: Sequence, exc: BaseException) -> BaseException:
        log.warning("commit of sequence %r failed: %s", seq.id, exc)
        seq.verified = None  # whatever was pending is unusable now
        return runtime_error(exc)

    def _commit_lost(self, seq: Sequence, exc: BaseException) -> BaseException:
        """A commit that failed after the state moved: the sequence's state is unknown, so it goes."""
        log.warning("commit of sequence %r failed midway: %s; releasing it", seq.id, exc)
        self.release(seq.id)
        return FailedPrecondition(f"sequence {seq.id!r} lost its state in a commit that failed ({exc}); "
                                  "prefill it again")

    def _forward(self, ready: list[tuple[int, Sequence]], works: list[VerifyWork], outputs: list[ItemOutput]) -> None:
        """One `lm.verify` over every ready tree; per-item retries only if the batch fails."""
        if not ready:
            return
        for _, seq in ready:
            # verifying overwrites what the previous tree left in the slot's scratch space
            seq.verified = None
        try:
            self._forward_batch(ready, works, outputs)
        except Exception as exc:  # noqa: BLE001
            if len(ready) == 1:
                log.warning("verify of sequence %r failed: %s", ready[0][1].id, exc, exc_info=True)
                outputs[ready[0][0]].error = runtime_error(exc)
                return
            log.warning("batched verify failed (%s); retrying its %d trees one by one", exc, len(ready))
            for item in ready:
                try:
                    self._forward_batch([item], works, outputs)
                except Exception as one:  # noqa: BLE001
                    outputs[item[0]].error = runtime_error(one)

    def _forward_batch(self, ready: list[tuple[int, Sequence]], works: list[VerifyWork], outputs: list[ItemOutput]) -> None:
        trees = [works[i].tree for i, _ in ready]
        res = self.lm.verify([seq.slot for _, seq in ready], trees)
        queries = [
            results.NodeQuery(works[i].tree, seq.length, seq.sampling, works[i].top_logprobs) for i, seq in ready
        ]
        node_results = results.compute(res.logits, [int(o) for o in res.offsets], queries)
        for b, (i, seq) in enumerate(ready):
            seq.verified = VerifiedTree(works[i].tree, res.pending[b], seq.length)
            outputs[i].result = node_results[b]
