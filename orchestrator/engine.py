"""The engine loop of one verifier replica: speculation steps for its whole batch.

One step, for every active request at once:
  1. take the next tree of each request from the drafter (waiting at most `draft_timeout_s`; a
     request without a tree this step verifies a one-node tree: plain decoding);
  2. one batched Verify for the whole batch, sent over the engine's VerifyStream (one
     long-lived stream, cheaper per step than a unary call; unary Verify for a verifier that
     has no VerifyStream); each item carries the commit of its request's previous step;
  3. acceptance (`steps.accept`), which extends the committed-token log;
  4. ask the drafter for the next trees (the outcome lets it reuse its work), with a budget from
     the adaptive policy;
  5. publish the new tokens to the outbox the request's front drains.

The loop runs in its own thread and owns every RequestState; other threads only talk to it
through `_inbox` (submit, adopt, cancel) and read the outbox.

Endings: a request's last event is published only after `Hooks.finished` has returned for it
(`Endings`, off the loop), so the coordinator has forgotten the request id by the time its client
hears the end, and the client may reuse the id at once.

Failures: a verifier item that lost its sequence (restart, idle expiry) is re-prefilled from the
log; a failed Verify call or stream (the next step opens a new stream) marks the replica down,
offers the requests to other replicas through `Hooks.replica_down`, and re-prefills the rest once
the replica answers again. Every sequence id the failure left behind (each re-prefill takes a new
one) is released first, also those of requests that moved: a verifier that was only cut off for a
moment still holds them, and would otherwise need two slots per request until its idle sweep. A
cancel that reaches this engine after its request moved follows it (`Hooks.forward_cancel`). The
drafter is never needed for correctness (see draft_link).
"""
from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import OrderedDict, defaultdict
from dataclasses import dataclass
from typing import Iterable, Optional

import grpc

from orchestrator.adaptive import (AdaptivePolicy, Choice, CostModel, FixedPolicy, Regime, RegimeTables, Seat,
                                   choose_for_batch, observations)
from orchestrator.draft_link import DraftLink, Want
from orchestrator.request import CANCELLED, Event, RequestSpec, RequestState
from orchestrator.steps import accept, advance, fit_tree, in_original, take_output, tree_limits
from treeserve.acceptance import Outcome
from treeserve.h2grpc.client import DirectStreamSession
from treeserve.server import channel as make_channel
from treeserve.stream_session import StreamSession
from treeserve.tree import TokenTree, tree_to_proto
from treeserve.v1 import treeserve_pb2 as pb
from treeserve.v1 import treeserve_pb2_grpc as pbg
from verifier_service.client import direct_verify_stream

log = logging.getLogger("treeserve.orchestrator.engine")

_DOWN_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED,
               grpc.StatusCode.UNKNOWN)
_LOST_CODES = (grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.FAILED_PRECONDITION.value[0])
# how a verifier refuses a VerifyStream before reading any request: it has none, or all are taken
_STREAM_REFUSED = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED)
ADAPTIVE_CAP = 32  # largest budget the adaptive policy considers when the request names none
ADAPTIVE_START = 8
RELEASE_TIMEOUT_S = 5.0  # longest wait for a Release (those of a failure's leftovers run side by side)
MOVED_MEMORY = 4096  # moved requests remembered, so that a cancel that arrives late can follow them
ENDINGS_FLUSH_S = 5.0  # how long a stopping engine lets its queued last events go out
# A front that has neither drained its events nor submitted for this long is gone (crashed, or
# stopped with its requests still here): its requests are cancelled and its events dropped.
# Fronts drain every second or two; this leaves room for a long pause of theirs
FRONT_SILENT_S = 60.0
READING_S = 5.0  # a front heard from within this is still draining (a stopping engine waits for it)
FRONT_CHECK_S = 1.0  # how often the step loop looks for silent fronts


class VerifierUnreachable(grpc.FutureTimeoutError):
    """No connection to the verifier within the time given (a FutureTimeoutError, as before, for the
    callers that retry; with the address and the wait in its message for those that report it)."""


@dataclass(frozen=True)
class EngineConfig:
    verifier: str
    drafter: Optional[str] = None
    name: str = ""
    service_token: Optional[str] = None
    draft_timeout_s: float = 1.0  # longest wait for a tree before verifying a one-node tree
    verify_timeout_s: float = 120.0  # longest wait for a step's Verify answer (and for a Prefill)
    replica_timeout_s: float = 60.0  # fail requests whose replica stays down this long
    connect_timeout_s: float = 60.0  # how long a new engine waits for its verifier to answer


@dataclass(frozen=True)
class VerifierInfo:
    model: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_sequences: int
    max_tree_nodes: int
    max_sequence_length: int
    device: str

    @classmethod
    def from_proto(cls, s) -> "VerifierInfo":
        return cls(s.model, int(s.vocab_size), tuple(s.eos_token_ids), int(s.max_sequences), int(s.max_tree_nodes),
                   int(s.max_sequence_length), s.device)


class Hooks:
    """What an engine tells the rest of the system. The defaults suit a lone engine."""

    def finished(self, request_ids: list[str]) -> None:
        """The requests ended and their slots are free. Called off the step loop (`Endings`); their
        last events are published once it returns, so it should return only when the rest of the
        system has forgotten the ids."""

    def forward_cancel(self, request_id: str, engine: str, reason: str, admission: str = "") -> None:
        """Cancel a request that this engine handed to `engine` (the cancel came here first)."""

    def replica_down(self, states: list[RequestState]) -> dict[str, str]:
        """Offer requests to other replicas; returns {request id: engine name} of those taken."""
        return {}

    def replica_up(self) -> None:
        pass


class Outbox:
    """Events per front, drained in batches (one call per batch, not per token).

    Delivery is at least once: a batch stays here until the front's next `drain` names it
    (`ack`), and a drain that does not is answered with it again, then what came since. A reply
    lost on the way (a Ray call that failed after the engine had run it) loses no event; the
    front's inboxes drop the repeats. A front that neither drains nor submits for `silent_s` (it
    crashed, or was stopped with requests here) is dropped with its events (`drop_silent`), and
    the engine cancels its requests."""

    def __init__(self, silent_s: float = FRONT_SILENT_S, clock=time.monotonic):
        self.silent_s = silent_s
        self._clock = clock
        self._cv = threading.Condition()
        self._events: dict[str, list[Event]] = defaultdict(list)
        self._sent: dict[str, tuple[int, list[Event]]] = {}  # each front's last batch, until acknowledged
        self._heard: dict[str, float] = {}  # when each front last drained or submitted (or had its first events)

    def touch(self, front: str) -> None:
        """`front` is alive (it submitted a request): not silent from now, whatever its drains."""
        with self._cv:
            self._heard[front] = self._clock()

    def put(self, front: str, events: Iterable[Event]) -> None:
        with self._cv:
            self._heard.setdefault(front, self._clock())
            self._events[front].extend(events)
            self._cv.notify_all()

    def drain(self, front: str, timeout: float, ack: Optional[int] = None) -> tuple[int, list[Event]]:
        """(batch, events): what `front` has not acknowledged, waiting up to `timeout` for some.
        `ack`: the batch the front's last drain returned (0: none yet), the returned one next
        time; None: a reader in this process, which cannot lose an answer: nothing is kept."""
        with self._cv:
            self._heard[front] = self._clock()
            sent = self._sent.get(front)
            if sent is not None and (ack is None or sent[0] == ack):
                del self._sent[front]
            if front not in self._sent and not self._events.get(front):
                # until events come, or another drain of this front takes some (this one carries them too)
                self._cv.wait_for(lambda: bool(self._events.get(front)) or front in self._sent, timeout)
            self._heard[front] = self._clock()
            # read again after the wait: another drain of this front (a retry of a call that
            # seemed lost) may have taken a batch meanwhile, which this answer must carry too
            sent = self._sent.get(front)
            new = self._events.pop(front, [])
            if sent is None and not new:
                return ack or 0, []
            self._cv.notify_all()  # `wait_drained`
            events = (sent[1] if sent is not None else []) + new
            if ack is None:
                self._sent.pop(front, None)
                return 0, events
            batch = secrets.randbits(62) or 1  # not a count: a new engine under the same name must not match an old ack
            self._sent[front] = (batch, events)
            return batch, events

    def wait_drained(self, timeout: float) -> bool:
        """Wait (at most `timeout`) until every front still draining (heard from within
        READING_S) has taken its events and acknowledged them (a last answer lost on the way
        would otherwise lose the requests' ends)."""
        def taken() -> bool:
            now = self._clock()
            waiting = {f for f, events in self._events.items() if events} | set(self._sent)
            return not any(now - self._heard.get(front, now) <= READING_S for front in waiting)

        with self._cv:
            return self._cv.wait_for(taken, timeout)

    def drop_silent(self) -> list[str]:
        """The fronts that have events here and have neither drained nor submitted for `silent_s`;
        their events go."""
        with self._cv:
            now = self._clock()
            gone = [front for front in {f for f, events in self._events.items() if events} | set(self._sent)
                    if now - self._heard.get(front, now) > self.silent_s]
            for front in gone:
                self._events.pop(front, None)
                self._sent.pop(front, None)
            return gone


class Endings:
    """Publishes each request's last event only after `Hooks.finished` has returned for it. The
    coordinator has then forgotten the request id, so a client that got its final message can
    reuse the id at once; and the coordinator's record of the request is still cleared once, by
    the engine that freed its slot, so its load count never runs ahead of the engine's. One
    thread, off the step loop; ends that pile up while it waits go out in its next call."""

    def __init__(self, hooks: Hooks, outbox: Outbox):
        self._hooks = hooks
        self._outbox = outbox
        self._queue: queue.Queue = queue.Queue()  # (front, last event), or None: stop
        self._thread = threading.Thread(target=self._run, name="engine-endings", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def put(self, front: str, last: Event) -> None:
        self._queue.put((front, last))

    def stop(self, timeout: float) -> None:
        """Publish what is queued, then end the thread (waiting for it at most `timeout`)."""
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            batch = self._take()
            ends = [item for item in batch if item is not None]
            if ends:
                self._publish(ends)
            if len(ends) < len(batch):
                return

    def _take(self) -> list:
        batch = [self._queue.get()]
        while True:
            try:
                batch.append(self._queue.get_nowait())
            except queue.Empty:
                return batch

    def _publish(self, ends: list[tuple[str, Event]]) -> None:
        try:
            self._hooks.finished([last.request_id for _, last in ends])
        except Exception:  # noqa: BLE001 - the clients must hear the end all the same
            log.exception("finished hook failed")
        for front, last in ends:
            self._outbox.put(front, [last])


def _regime_fields(regime: Regime) -> dict:
    """A regime as stats fields (a shape outside the enum, which the front refuses, by number)."""
    shape = pb.TreeShape.Name(regime.shape) if regime.shape in pb.TreeShape.values() else regime.shape
    return {"shape": shape, "temperature_band": regime.band, "draft_ahead": regime.ahead}


def make_policy(spec: RequestSpec, info: VerifierInfo, also: tuple = ()):
    """`also`: the regimes an adaptive request may draft in besides its own (`RequestSpec.other_regimes`,
    where the drafter can draft them)."""
    sp = spec.speculation
    if not sp.enabled:
        return FixedPolicy(1)
    if sp.adaptive:
        cap = min(sp.node_budget or ADAPTIVE_CAP, info.max_tree_nodes)
        return AdaptivePolicy(cap=cap, start=min(cap, ADAPTIVE_START), regime=spec.regime, also=also)
    return FixedPolicy(min(sp.node_budget, info.max_tree_nodes), spec.regime)


class Engine:
    def __init__(self, config: EngineConfig, hooks: Hooks | None = None):
        self.config = config
        self.name = config.name or f"engine:{config.verifier}"
        self.hooks = hooks or Hooks()
        self._channel = None
        # VerifyStream (on the verifier's direct port when it has one); None: the verifier has none
        self._stream: Optional[StreamSession | DirectStreamSession] = None
        self.info = VerifierInfo.from_proto(self._connect(config.connect_timeout_s))
        self.eos = frozenset(self.info.eos_token_ids)
        self.outbox = Outbox()
        self.cost = CostModel()
        # regime -> engine-wide acceptance of its requests (what a request falls back on)
        self.shared: RegimeTables = RegimeTables()
        self._requests: dict[str, RequestState] = {}
        self._inbox: queue.Queue = queue.Queue()
        self._count_lock = threading.Lock()
        self._count = 0  # requests accepted and not finished (the loop may not have seen them yet)
        self._down_since: Optional[float] = None
        self._last_offer = 0.0
        # sequence ids a replica failure left on the verifier (released once it answers again)
        self._stale_vids: list[str] = []
        self._moved: OrderedDict[str, str] = OrderedDict()  # request id -> engine it moved to
        self._endings = Endings(self.hooks, self.outbox)
        self._stop = threading.Event()
        self._releases: list = []  # Release calls of ended requests' sequences (grpc futures)
        self.steps = 0
        self.link = None
        if config.drafter:
            self.link = DraftLink(config.drafter, self._committed_tokens, self.info.vocab_size,
                                  self.info.max_tree_nodes, auth_token=config.service_token)
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ---- public (any thread) ------------------------------------------------------------
    def start(self) -> "Engine":
        self._endings.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            # the sequences of requests that ended last: a Release left in flight when the channel
            # goes would leave its sequence on the verifier, holding a slot
            self._await_releases()
        self._endings.stop(ENDINGS_FLUSH_S)
        if self._stream is not None:
            self._stream.close()
        if self.link is not None:
            self.link.shutdown()

    @property
    def load(self) -> int:
        return self._count

    def submit(self, spec: RequestSpec) -> Optional[tuple[int, str]]:
        """Accept a new request, or say why not: (grpc code number, message)."""
        err = self._check(spec)
        if err is not None:
            return err
        with self._count_lock:
            if self._stop.is_set():  # its loop would never run it
                return grpc.StatusCode.UNAVAILABLE.value[0], f"the engine of replica {self.config.verifier} is stopping"
            if self._count >= self.info.max_sequences:
                return (grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                        f"replica {self.config.verifier} is full ({self.info.max_sequences} sequences)")
            self._count += 1
        # `_fit_to_drafter` drops them later where the drafter turns out not to serve them
        also = spec.other_regimes if self.link is not None and self._serves_other_shapes() else ()
        state = RequestState(spec, list(spec.prompt), make_policy(spec, self.info, also))
        self.outbox.touch(spec.front)  # its reader here may start after the first events
        self._inbox.put(("add", state))
        return None

    def adopt(self, state: RequestState) -> bool:
        """Continue a request that another replica lost (re-prefilled from its log)."""
        with self._count_lock:
            if self._count >= self.info.max_sequences or self._down_since is not None or self._stop.is_set():
                return False
            self._count += 1
        state.needs_prefill, state.pending_commit, state.awaiting_draft = True, None, False
        state.last_nodes = state.last_tokens = 1  # its last step was on another engine's batch
        state.reopen_drafter = True
        state.epoch += 1
        self.outbox.touch(state.spec.front)  # its front reads this engine only once it hears of the move
        self._inbox.put(("add", state))
        return True

    def cancel(self, request_id: str, reason: str = "cancelled", admission: str = "") -> None:
        """admission: cancel only the request admitted with it (`RequestSpec.admission`), not a
        newer one under the same id; empty: whichever is live under the id."""
        self._inbox.put(("cancel", request_id, reason, admission))

    def stats(self) -> dict:
        a, c = self.cost.fit()
        out = {"name": self.name, "verifier": self.config.verifier, "load": self._count, "steps": self.steps,
               "down": self._down_since is not None, "forward_ms_intercept": a, "forward_ms_per_node": c,
               # per regime: tokens a step by budget; per step kind (the regimes that drafted in it,
               # none: plain) the median time outside the forward (list() and dict() copy at once,
               # while the loop may add one)
               "acceptance": [dict(_regime_fields(k), tau=dict(t.tau)) for k, t in list(self.shared.items())],
               "step_overhead_ms": [{"drafted": [_regime_fields(r) for r in sorted(kind)], "ms": ms}
                                    for kind, ms in self.cost.overheads().items()],
               "info": self.info.__dict__,
               # what steps are sent with: VerifyStream until the verifier says it has none
               "verify_rpc": "Verify" if self._stream is None else "VerifyStream",
               "verify_stream_address": getattr(self._stream, "address", self.config.verifier)}
        if self.link is not None:
            out["drafter"] = {"up": self.link.up, "speculate_address": self.link.speculate_address,
                              **self.link.stats.__dict__}
        return out

    # ---- validation ---------------------------------------------------------------------
    def _check(self, spec: RequestSpec) -> Optional[tuple[int, str]]:
        bad = grpc.StatusCode.INVALID_ARGUMENT.value[0]
        if any(not 0 <= t < self.info.vocab_size for t in spec.prompt):
            return bad, f"prompt token outside the vocabulary [0, {self.info.vocab_size})"
        if len(spec.prompt) + spec.max_new_tokens > self.info.max_sequence_length:
            return bad, (f"prompt ({len(spec.prompt)} tokens) + max_new_tokens ({spec.max_new_tokens}) exceeds the "
                         f"maximum sequence length {self.info.max_sequence_length}")
        if spec.speculation.node_budget > self.info.max_tree_nodes:
            return bad, f"node_budget {spec.speculation.node_budget} exceeds the verifier's limit {self.info.max_tree_nodes}"
        return None

    # ---- the loop -----------------------------------------------------------------------
    def _run(self) -> None:
        next_front_check = 0.0
        while not self._stop.is_set():
            try:
                self._absorb(wait=not self._requests)
                if time.monotonic() >= next_front_check:
                    next_front_check = time.monotonic() + FRONT_CHECK_S
                    self._cancel_for_silent_fronts()
                if self._down_since is not None:
                    self._probe()
                    continue
                self._prefill([r for r in self._requests.values() if r.needs_prefill])
                batch = [r for r in self._requests.values() if not r.needs_prefill]
                if batch and self._down_since is None:
                    self._step(batch)
            except Exception:  # noqa: BLE001 - the loop must outlive any single bad step
                log.exception("%s: step failed", self.name)
                time.sleep(0.05)

    def _absorb(self, wait: bool) -> None:
        try:
            msg = self._inbox.get(timeout=0.5) if wait else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if msg[0] == "add":
                self._requests[msg[1].request_id] = msg[1]
                self._moved.pop(msg[1].request_id, None)  # moved back here
            elif msg[0] == "cancel":
                self._cancel(*msg[1:])
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel(self, request_id: str, reason: str, admission: str = "") -> None:
        r = self._requests.get(request_id)
        if r is not None:
            if admission and r.spec.admission != admission:
                return  # meant for an earlier request under the id, which has ended
            log.debug("%s: %s ends: %s", self.name, r.request_id, reason)
            self._end(r, r.next_event(finish=CANCELLED))
            return
        engine = self._moved.get(request_id)
        if engine is None:
            return  # ended already
        # routed here while the request was being moved (the coordinator learns where it went only
        # once `replica_down` returns): it must not be lost, so it follows the request
        log.info("%s: cancel of %s follows it to %s", self.name, request_id, engine)
        try:
            self.hooks.forward_cancel(request_id, engine, reason, admission)
        except Exception:  # noqa: BLE001
            log.exception("%s: could not forward the cancel of %s to %s", self.name, request_id, engine)

    def _cancel_for_silent_fronts(self) -> None:
        """Requests whose front stopped draining (`Outbox.drop_silent`) end: nobody hears them."""
        for front in self.outbox.drop_silent():
            orphans = [r for r in self._requests.values() if r.spec.front == front]
            if not orphans:
                continue  # the last events of requests cancelled before
            log.warning("%s: front %s has not read its events for %.0f s: cancelling its %d request(s)", self.name,
                        front, self.outbox.silent_s, len(orphans))
            for r in orphans:
                self._cancel(r.request_id, "its front stopped reading")

    def _step(self, batch: list[RequestState]) -> None:
        t0 = time.perf_counter()
        # the step's kind for the cost model: the regimes that asked for a draft (and waited on it,
        # whether a tree came or not)
        asked = [r for r in batch if r.awaiting_draft]
        trees = self._gather_trees(batch)
        items = []
        for r, tree in zip(batch, trees):
            item = pb.VerifyItem(sequence_id=r.vid, committed_length=r.committed, tree=tree_to_proto(tree))
            if r.pending_commit is not None:
                length, path = r.pending_commit
                item.commit.CopyFrom(pb.Commit(committed_length=length, accepted_nodes=path))
            items.append(item)
        try:
            resp = self._verify(pb.VerifyRequest(items=items))
        except grpc.RpcError as exc:
            self._verifier_failed(batch, exc)
            return
        step_ms = (time.perf_counter() - t0) * 1e3
        nodes = sum(t.size for t in trees)
        self.cost.observe(nodes, resp.forward_ms, step_ms, {r.regime for r in asked})
        self.steps += 1
        done = []  # (request, outcome in the drafter's node indices or None, tokens out, finish)
        for r, tree, res in zip(batch, trees, resp.results):
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s at %d: commit %s, tree %s %s -> %s %s", r.vid, r.committed, r.pending_commit,
                          tree.tokens, tree.parents, list(res.target_tokens),
                          res.error.message if res.HasField("error") else "")
            if res.HasField("error"):
                self._item_failed(r, res.error.code, res.error.message)
                continue
            try:
                outcome = accept(tree, res.target_tokens, Outcome.from_proto(res.walk) if res.HasField("walk") else None)
            except ValueError as exc:
                self._item_failed(r, grpc.StatusCode.INTERNAL.value[0], str(exc))
                continue
            r.failures = 0
            if r.from_drafter:
                # an n-gram tree as the drafter made it (not cut here) tells every smaller budget too
                nested = r.regime.shape == pb.TREE_SHAPE_NGRAM and tree.draft is None and r.tree_map is None
                for budget, emitted in observations(r.budget, outcome.accepted_nodes, nested):
                    r.policy.observe(budget, emitted, self.shared, r.regime)
            out, finish = advance(r, tree, outcome, self.eos)
            r.last_nodes, r.last_tokens = tree.size, len(outcome.accepted_nodes)
            done.append((r, in_original(outcome, r.tree_map) if r.from_drafter else None, out, finish))
        # Next trees first (the drafter starts at once), then the client events.
        self._request_drafts([(r, told) for r, told, _, finish in done if finish is None], asked)
        for r, _, out, finish in done:
            self._publish(r, r.next_event(tokens=tuple(out), tree_nodes=r.last_nodes, step_ms=step_ms, finish=finish))

    def _verify(self, request):
        """One step's Verify, over the stream when the verifier has VerifyStream. A failed stream
        raises its RpcError like a failed call (the session opens a new stream on the next step).
        A verifier that refuses the stream before reading anything (an older one: UNIMPLEMENTED; one
        whose streams are all taken: RESOURCE_EXHAUSTED) gets this and later steps as unary Verify
        calls, until the engine reconnects (`_connect`, which asks for a stream again)."""
        if self._stream is not None:
            try:
                return self._stream.send(request)  # within verify_timeout_s, the session's timeout
            except grpc.RpcError as exc:
                if exc.code() not in _STREAM_REFUSED:
                    raise
                log.warning("%s: verifier %s refused a VerifyStream (%s): unary Verify calls", self.name,
                            self.config.verifier, exc.details() or exc.code().name)
            self._stream.close()
            self._stream = None
        return self._stub.Verify(request, timeout=self.config.verify_timeout_s)

    def _gather_trees(self, batch: list[RequestState]) -> list[TokenTree]:
        expect = {r.request_id: r.committed for r in batch if r.awaiting_draft}
        got = self.link.take(expect, self.config.draft_timeout_s) if expect and self.link is not None else {}
        trees = []
        for r in batch:
            r.awaiting_draft = False
            entry = got.get(r.request_id)
            tree = entry[0] if entry is not None and entry[0].tokens[0] == r.root else None
            r.from_drafter, r.tree_map = tree is not None, None
            if tree is None:
                trees.append(TokenTree.single(r.root))
                continue
            max_nodes, max_depth = tree_limits(r, self.info.max_tree_nodes, self.info.max_sequence_length)
            tree, r.tree_map = fit_tree(tree, max_nodes, max_depth)
            trees.append(tree)
        return trees

    def _request_drafts(self, going: list[tuple[RequestState, Outcome | None]], asked: list[RequestState]) -> None:
        """The next trees of a step's requests that go on (each with its outcome in the drafter's
        node indices), their budgets chosen for the batch (`adaptive.choose_for_batch`; `asked`:
        the requests that drafted in this step)."""
        if self.link is None:
            return
        asking = {id(r) for r in asked}
        self._fit_to_drafter([r for r, _ in going])
        seats = [Seat(r.policy, r.regime, self.shared, r.last_nodes, r.last_tokens, id(r) in asking)
                 if r.spec.speculation.enabled else Seat(None, r.regime, None) for r, _ in going]
        for (r, told), choice in zip(going, choose_for_batch(self.cost, seats)):
            self._request_draft(r, told, choice)

    def _request_draft(self, r: RequestState, outcome: Outcome | None, choice: Choice | None = None) -> None:
        """Ask for `r`'s next tree (choice None: its policy's as if it were alone; the batch's own
        checks wait for its first step, `_request_drafts`). A tree of another regime than the
        request's own asks the drafter for that regime's shape."""
        if self.link is None or not r.spec.speculation.enabled:
            return
        if choice is None:
            self._fit_to_drafter([r])
            budget = r.policy.choose(self.cost, 0, self.shared, 0.0)
            choice = Choice(budget, r.policy.current)
        max_nodes, max_depth = tree_limits(r, self.info.max_tree_nodes, self.info.max_sequence_length)
        if max_depth == 0 or choice.budget == 1:
            r.budget = 1
            return
        r.budget = min(choice.budget, max_nodes) if choice.budget else 0
        # a drafter that predates per-tree shapes drafts the sequence's own (a reconnect to one
        # since the choice): its trees are priced so
        r.regime = choice.regime if self.link.per_tree_shapes is not False else r.spec.regime
        shape = r.regime.shape if r.regime.shape != r.spec.regime.shape else pb.TREE_SHAPE_UNSPECIFIED
        r.awaiting_draft = self.link.request(r.request_id, Want(r.committed, r.root, r.budget, shape), outcome)

    def _serves_other_shapes(self) -> bool:
        """Whether the drafter (as far as the link knows yet) drafts trees of other shapes than a
        sequence's own where they pay: not one that predates per-tree shapes (it drafts each
        sequence's own whatever it is asked), and not one whose default is n-gram trees (the only
        other shape a default request tries: the same trees twice)."""
        return self.link.per_tree_shapes is not False and self.link.default_shape != pb.TREE_SHAPE_NGRAM

    def _fit_to_drafter(self, requests: list[RequestState]) -> None:
        """Policies that may choose other regimes keep their own only where the drafter does not
        serve them (else, against a drafter that predates per-tree shapes, the trees they ask of
        the others, never measured there, are chosen by borrowed estimates for good)."""
        if not self._serves_other_shapes():
            for r in requests:
                r.policy.keep_own_regime()

    def _committed_tokens(self, request_id: str):
        r = self._requests.get(request_id)
        if r is None or not r.started:
            return None
        return r.tokens[:-1]

    # ---- prefill ------------------------------------------------------------------------
    def _prefill(self, todo: list[RequestState]) -> None:
        if not todo:
            return
        self._await_releases()
        calls = []
        for r in todo:
            prompt = r.tokens[:-1] if r.started else r.tokens
            req = pb.PrefillRequest(sequence_id=r.vid, prompt_tokens=prompt, sampling=r.spec.sampling.to_proto())
            calls.append((r, time.perf_counter(), self._stub.Prefill.future(req, timeout=self.config.verify_timeout_s)))
        down = None
        for r, t0, fut in calls:
            try:
                resp = fut.result()
            except grpc.RpcError as exc:
                if exc.code() in _DOWN_CODES:
                    down = exc
                    continue
                if r.started:  # a resumed request: try again on the next pass, then give up
                    r.failures += 1
                    if r.failures < 3:
                        r.epoch += 1
                        continue
                self._fail(r, exc.code().value[0], exc.details() or exc.code().name)
                continue
            self._prefilled(r, int(resp.next_token), (time.perf_counter() - t0) * 1e3)
        if down is not None:
            self._verifier_failed([r for r, _, _ in calls], down)

    def _prefilled(self, r: RequestState, next_token: int, ms: float) -> None:
        r.needs_prefill, r.pending_commit = False, None
        r.forwards += 1
        if r.started:
            if next_token != r.root:
                log.warning("%s: re-prefilled %s predicts %d where the log has %d (numerical drift); the log wins",
                            self.name, r.request_id, next_token, r.root)
            if self.link is not None and r.spec.speculation.enabled and r.reopen_drafter:
                r.reopen_drafter = False
                self.link.open(r.request_id, r.spec.sampling.to_proto(), r.spec.speculation.draft_options())
            self._request_draft(r, None)
            return
        r.started = True
        r.tokens.append(next_token)
        out, finish = take_output(r, [next_token], self.eos)
        if finish is None and self.link is not None and r.spec.speculation.enabled:
            self.link.open(r.request_id, r.spec.sampling.to_proto(), r.spec.speculation.draft_options())
            self._request_draft(r, None)
        self._publish(r, r.next_event(tokens=tuple(out), tree_nodes=0, step_ms=ms, finish=finish))

    # ---- failures -----------------------------------------------------------------------
    def _item_failed(self, r: RequestState, code: int, message: str) -> None:
        if code in _LOST_CODES:
            log.info("%s: verifier lost %s (%s): re-prefilling from the log", self.name, r.vid, message)
            self._release_async(r.vid)
            r.epoch += 1
            r.needs_prefill, r.pending_commit = True, None
            return
        r.failures += 1
        log.warning("%s: step of %s failed (%d): %s", self.name, r.request_id, code, message)
        if r.failures >= 3:
            self._fail(r, code, message)

    def _verifier_failed(self, batch: list[RequestState], exc: grpc.RpcError) -> None:
        if exc.code() not in _DOWN_CODES:
            for r in batch:
                self._fail(r, exc.code().value[0], f"verifier refused the step: {exc.details()}")
            return
        log.warning("%s: verifier %s failed (%s): replica down", self.name, self.config.verifier, exc.code().name)
        self._down_since = time.monotonic()
        for r in self._requests.values():
            self._stale_vids.append(r.vid)  # a verifier that was only cut off still holds it
            r.epoch += 1
            r.needs_prefill, r.pending_commit, r.awaiting_draft = True, None, False
        self._offer_elsewhere()

    def _offer_elsewhere(self) -> None:
        self._last_offer = time.monotonic()
        candidates = list(self._requests.values())
        if not candidates:
            return
        try:
            taken = self.hooks.replica_down(candidates)
        except Exception:  # noqa: BLE001
            log.exception("%s: could not offer requests to other replicas", self.name)
            return
        for rid in taken:
            r = self._requests.pop(rid, None)
            if r is None:
                continue
            with self._count_lock:
                self._count -= 1
            if self.link is not None:
                self.link.close(rid, end=False)
            self._remember_move(rid, taken[rid])
            self.outbox.put(r.spec.front, [Event(rid, -1, moved_to=taken[rid], admission=r.spec.admission)])

    def _remember_move(self, request_id: str, engine: str) -> None:
        """Cancels already on their way here follow the request (`_cancel`); later ones go to the
        new engine directly. The oldest moves are forgotten past MOVED_MEMORY."""
        self._moved[request_id] = engine
        self._moved.move_to_end(request_id)
        while len(self._moved) > MOVED_MEMORY:
            self._moved.popitem(last=False)

    def _probe(self) -> None:
        if not self._answers_again():
            self._still_down()
            return
        log.info("%s: verifier %s is back; re-prefilling %d requests", self.name, self.config.verifier,
                 sum(r.needs_prefill for r in self._requests.values()))
        self._down_since = None
        try:
            self.hooks.replica_up()
        except Exception:  # noqa: BLE001
            log.exception("%s: replica_up hook failed", self.name)

    def _still_down(self) -> None:
        waited = time.monotonic() - self._down_since
        if waited > self.config.replica_timeout_s:
            for r in list(self._requests.values()):
                self._fail(r, grpc.StatusCode.UNAVAILABLE.value[0],
                           f"verifier {self.config.verifier} unreachable for {waited:.0f} s")
            self._down_since = time.monotonic()
        elif time.monotonic() - self._last_offer > 2.0:
            self._offer_elsewhere()
        self._stop.wait(0.2)

    def _answers_again(self) -> bool:
        """The verifier answers on a fresh channel, and has released what the failure left behind."""
        try:
            self._connect(1.0)
        except (grpc.RpcError, grpc.FutureTimeoutError):
            return False
        return self._release_stale()

    def _release_stale(self) -> bool:
        """Release the sequence ids the failure left behind, side by side, each within
        RELEASE_TIMEOUT_S, and before any re-prefill: a re-prefill that raced them would need a
        second slot per request. A restarted verifier knows none of them (it answers released =
        false), which is fine. False when the verifier stopped answering again; the ids not
        released are kept for the next try."""
        calls = [(vid, self._stub.Release.future(pb.ReleaseRequest(sequence_id=vid), timeout=RELEASE_TIMEOUT_S))
                 for vid in self._stale_vids]
        kept = []
        for vid, call in calls:
            try:
                call.result()
            except grpc.RpcError as exc:
                if exc.code() in _DOWN_CODES:
                    kept.append(vid)
                else:  # nothing to retry: a sequence the verifier refuses to release is not ours to free
                    log.warning("%s: release of %s refused (%s)", self.name, vid, exc.code().name)
        if calls:
            log.info("%s: released %d sequences left by the failure", self.name, len(calls) - len(kept))
        self._stale_vids = kept
        return not kept

    def _connect(self, timeout: float):
        """A fresh channel: after a restart it connects at once instead of waiting out gRPC's
        reconnect backoff on the old one. Returns the verifier's Stats (pb.VerifierStats), which
        shows that it answers; only then do the new channel and stream replace the old ones. The
        Verify stream goes with the old channel; the next step opens one on the new (and so asks a
        restarted verifier again for VerifyStream, and for its direct port)."""
        deadline = time.monotonic() + timeout
        while True:
            channel = make_channel(self.config.verifier, self.config.service_token)
            try:
                grpc.channel_ready_future(channel).result(timeout=min(2.0, max(0.1, deadline - time.monotonic())))
                break
            except grpc.FutureTimeoutError:
                channel.close()
                if time.monotonic() >= deadline:
                    raise VerifierUnreachable(f"verifier {self.config.verifier} did not answer within {timeout:g} s") \
                        from None
        stub = pbg.VerifierStub(channel)
        try:
            stats = stub.Stats(pb.StatsRequest(), timeout=min(10.0, timeout))
        except grpc.RpcError:
            channel.close()
            raise
        if self._stream is not None:
            self._stream.close()
        if self._channel is not None:
            self._channel.close()
        self._channel = channel
        self._stub = stub
        self._stream = self._stream_session(stats.direct_port)
        return stats

    def _stream_session(self, port: int) -> StreamSession | DirectStreamSession:
        """The session for VerifyStream: on the verifier's direct `port` (0: none) when it answers
        (a round trip with no grpcio threads at either end), else on the channel."""
        if port:
            address = f"{self.config.verifier.rpartition(':')[0]}:{port}"
            session = direct_verify_stream(address, self.config.verify_timeout_s, self.config.service_token)
            try:
                return session.connect()
            except grpc.RpcError as exc:
                log.warning("%s: verifier %s advertises direct port %d, which does not answer (%s): VerifyStream "
                            "over gRPC instead", self.name, self.config.verifier, port, exc.details())
        return StreamSession(self._stub.VerifyStream, timeout=self.config.verify_timeout_s)

    # ---- endings ------------------------------------------------------------------------
    def _fail(self, r: RequestState, code: int, message: str) -> None:
        self._end(r, r.next_event(error=(code, message)))

    def _publish(self, r: RequestState, event: Event) -> None:
        if event.last:
            self._end(r, event)
        else:
            self._emit([event], r)

    def _end(self, r: RequestState, last: Event) -> None:
        """Free the request here; its last event goes out through `_endings`, once the coordinator
        has forgotten it."""
        if self._requests.pop(r.request_id, None) is None:
            return
        with self._count_lock:
            self._count -= 1
        if r.started or not r.needs_prefill:
            self._release_async(r.vid)
        if self.link is not None:
            self.link.close(r.request_id)
        self._endings.put(r.spec.front, last)

    def _release_async(self, vid: str) -> None:
        """Release an ended request's sequence without waiting for the answer (the next prefill
        does: `_await_releases`)."""
        self._releases = [f for f in self._releases if not f.done()]
        self._releases.append(self._stub.Release.future(pb.ReleaseRequest(sequence_id=vid), timeout=RELEASE_TIMEOUT_S))

    def _await_releases(self) -> None:
        """Before a prefill and when the engine stops, the verifier has freed the slots of the
        requests that ended (each Release within RELEASE_TIMEOUT_S): a full replica's next request
        would otherwise find no slot (RESOURCE_EXHAUSTED), a request id reused at once could meet
        its old sequence, and a stopped engine's channel would drop them."""
        pending, self._releases = self._releases, []
        for call in pending:
            try:
                call.result()
            except grpc.RpcError:
                pass  # a replica that is down has lost the sequence anyway

    def _emit(self, events: list[Event], r: RequestState) -> None:
        self.outbox.put(r.spec.front, events)
