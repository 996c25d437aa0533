"""One engine's connection to the drafter: a single Speculate stream shared by every sequence of
the engine's batch, plus StartSequence / EndSequence calls.

The engine never blocks on the drafter for longer than it chooses to wait for a tree, and never
depends on it for correctness:
- at most one DraftRequest per sequence is in flight; while one is outstanding (the drafter is
  lagging) the engine verifies a one-node tree instead, and the late answer is dropped;
- when the stream or a call fails, every sequence is marked out of sync and a background thread
  reconnects with backoff, then restarts each sequence from the engine's committed-token log
  (StartSequence with the full log), after which drafting resumes;
- a per-sequence error (e.g. the drafter lost the sequence) resynchronises just that sequence;
- an EndSequence that cannot reach the drafter (the link is down, or the call fails as a network
  failure would) waits in a bounded queue (`PendingEnds`) and is sent again once the link is back,
  so the drafter does not keep the sequence until its idle sweep; an id opened again meanwhile
  leaves the queue (its StartSequence resets the drafter's state).

`tokens_of(sequence_id)` is supplied by the engine: the sequence's committed tokens (the log
without its root), or None when the sequence is gone.

The stream goes to the drafter's direct port when its Stats advertise one (`treeserve drafter
--direct-port`, `treeserve.h2grpc.client.DirectStream`). Then the engine's thread does all of the
stream's reading and writing itself: it writes its requests, reads the answers while it waits in
`take` (and those that came meanwhile before each `request`), and sends the request a sequence
wanted while it was being started again (the link's worker thread only makes the unary calls). An
answer so reaches the engine with no hand-off between threads, and the connection, which is not
thread-safe, is read and written by one thread; another that gives the link up (the worker, after a
failed call, or `shutdown`) only aborts it (a socket shutdown, which wakes a read in progress), and
the engine's thread closes it. Whatever the stream does (an answer that does not parse, a broken
connection), `request` and `take` do not raise: the link goes down and reconnects. Otherwise it is
grpcio's stream: requests go through a queue to grpcio's sending thread, and a reader thread of the
link receives the answers.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

import grpc

from treeserve.acceptance import Outcome
from treeserve.h2grpc.client import DirectStream
from treeserve.server import channel as make_channel
from treeserve.stream_session import drain
from treeserve.tree import TreeError, tree_from_proto
from treeserve.v1 import treeserve_pb2 as pb
from treeserve.v1 import treeserve_pb2_grpc as pbg

log = logging.getLogger("treeserve.orchestrator.draft")

SYNCING, READY = "syncing", "ready"
SPECULATE_PATH = f"/{pb.DESCRIPTOR.services_by_name['Drafter'].full_name}/Speculate"
# Status codes of a call that failed as a network failure would: the drafter may not have seen it
LINK_FAILURES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)
# EndSequences kept for a drafter that cannot be reached; past this the oldest is dropped, and the
# drafter's idle sweep (`--idle-timeout-s`) frees that sequence instead
MAX_PENDING_ENDS = 1024
# Direct port: while a sequence of the batch is being started again, how often `take` stops reading
# to send the request it wants once the worker has started it
SYNC_POLL_S = 0.001
# How long the connection to a drafter's direct port (and its first SETTINGS) may take before the
# link takes grpcio's stream instead, as the main port's connect allows
DIRECT_CONNECT_S = 2.0


class Want(NamedTuple):
    """A tree the engine asks for: at committed `length`, rooted at `root`, of at most `budget`
    nodes (0: the sequence's budget) and of tree `shape` (a TreeShape; UNSPECIFIED: the sequence's)."""

    length: int
    root: int
    budget: int
    shape: int = pb.TREE_SHAPE_UNSPECIFIED


@dataclass
class _Seq:
    sampling: object  # pb.SamplingParams
    options: object  # pb.DraftOptions
    state: str = SYNCING
    known: int = 0  # committed length the drafter has
    inflight: Optional[int] = None  # committed length of the outstanding request
    sent_at: float = 0.0
    wanted: Optional[Want] = None  # a request to send once in sync
    result: Optional[tuple] = None  # (length, TokenTree, from_draft_ahead, draft_ms)


class PendingEnds:
    """Sequence ids whose EndSequence is still to be sent, oldest first, at most `limit` of them
    (the oldest goes when a new one would pass it). Not thread-safe: the link's lock guards it."""

    def __init__(self, limit: int = MAX_PENDING_ENDS):
        self._limit = limit
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.dropped = 0  # ids given up on because the queue was full, since the last take_all

    def add(self, sid: str) -> None:
        self._ids[sid] = None
        self._ids.move_to_end(sid)
        while len(self._ids) > self._limit:
            self._ids.popitem(last=False)
            self.dropped += 1

    def discard(self, sid: str) -> None:
        self._ids.pop(sid, None)

    def take_all(self) -> list[str]:
        ids, self._ids = list(self._ids), collections.OrderedDict()
        self.dropped = 0
        return ids

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, sid: str) -> bool:
        return sid in self._ids


@dataclass
class DraftStats:
    trees: int = 0
    late: int = 0
    invalid: int = 0
    resyncs: int = 0
    reconnects: int = 0
    draft_ahead_hits: int = 0
    draft_ms: float = 0.0


class DraftLink:
    def __init__(self, address: str, tokens_of: Callable[[str], Optional[Sequence[int]]], vocab_size: int,
                 max_tree_nodes: int, auth_token: str | None = None, call_timeout: float = 30.0,
                 stuck_after: float = 30.0):
        self.address = address
        self._tokens_of = tokens_of
        self._vocab = vocab_size
        self._max_nodes = max_tree_nodes
        self._token = auth_token
        self._timeout = call_timeout
        self._stuck_after = stuck_after
        self._cv = threading.Condition()
        self._seqs: dict[str, _Seq] = {}
        self._up = False
        self._generation = 0  # bumps with every new stream; stale readers stop
        self._send_q: Optional[queue.Queue] = None
        self._call = None  # the Speculate stream (grpcio's)
        self._direct: Optional[DirectStream] = None  # or the stream on the drafter's direct port
        # direct streams the link has given up: aborted (from whatever thread), closed by the engine's
        self._retired: list[DirectStream] = []
        self._direct_answered = False  # whether the direct stream has answered anything yet
        # direct port: sequences started again whose wanted request the engine's thread is to send
        self._restarted: set[str] = set()
        # a direct port that refused the stream itself (a status, not a broken link, before any
        # answer: e.g. UNIMPLEMENTED): later connects take grpcio's stream instead of looping on it
        self._direct_refused: Optional[str] = None
        self._stub = None
        self._channel = None
        self._work: queue.Queue = queue.Queue()
        self._ends = PendingEnds()  # EndSequences to send again once the link is up
        # wait before the next connect: grows with every connect, back to zero once a stream has
        # answered (a drafter that takes the calls but refuses the stream, its streams all taken,
        # must not be reconnected to, and its sequences restarted, in a tight loop)
        self._reconnect_delay = 0.0
        self._closed = False
        self.lagging = False
        # whether the drafter honours DraftRequest.shape, and the shape of a sequence that names
        # none (a TreeShape), as its Stats said at the last connect (None until one)
        self.per_tree_shapes: Optional[bool] = None
        self.default_shape: Optional[int] = None
        self.stats = DraftStats()
        self._worker = threading.Thread(target=self._work_loop, name="draft-link", daemon=True)
        self._worker.start()
        self._work.put(("connect",))

    # ---- engine-facing ------------------------------------------------------------------
    @property
    def up(self) -> bool:
        return self._up

    def open(self, sid: str, sampling, options) -> None:
        """Start drafting for a sequence (asynchronously; its first trees may be one-node)."""
        with self._cv:
            self._seqs[sid] = _Seq(sampling, options)
            # its StartSequence resets whatever the drafter holds for the id: an EndSequence still
            # to be sent would end the new sequence instead
            self._ends.discard(sid)
        self._work.put(("start", sid))

    def close(self, sid: str, end: bool = True) -> None:
        """Stop drafting for a sequence; `end=False` when another engine now drafts it."""
        with self._cv:
            known = self._seqs.pop(sid, None) is not None
        if known and end:
            self._work.put(("end", sid))

    def request(self, sid: str, want: Want, outcome: Outcome | None) -> bool:
        """Ask for the tree to verify at committed `want.length` with root `want.root`. Returns
        whether an answer may come (the engine then waits for it in `take`)."""
        with self._cv:
            seq = self._seqs.get(sid)
            if seq is not None:
                seq.wanted = None  # this request supersedes one it wanted while it was started again
            self._catch_up_locked()
            seq = self._seqs.get(sid)
            if seq is None or not self._up:
                return False
            if seq.state == SYNCING:
                seq.wanted = want
                return True
            if seq.inflight is not None:
                if time.monotonic() - seq.sent_at > self._stuck_after:
                    log.warning("drafter has not answered %s for %.0f s: reconnecting", sid, self._stuck_after)
                    self._mark_down_locked()
                return False
            self._send_locked(sid, seq, want, outcome)
            return True

    def take(self, expect: dict[str, int], timeout: float) -> dict[str, tuple]:
        """Wait up to `timeout` s for the trees of `expect` (sequence id -> committed length);
        returns sid -> (TokenTree, from_draft_ahead, draft_ms) for those that came. While the
        drafter is lagging, waits for nothing."""
        got: dict[str, tuple] = {}
        with self._cv:
            self._catch_up_locked()
            if self.lagging and not any(s.inflight is not None for s in self._seqs.values()):
                self.lagging = False
            deadline = time.monotonic() + (0.0 if self.lagging else timeout)
            while True:
                for sid, length in expect.items():
                    seq = self._seqs.get(sid)
                    if sid in got or seq is None or seq.result is None:
                        continue
                    if seq.result[0] == length:
                        got[sid] = seq.result[1:]
                    seq.result = None
                missing = [s for s in expect if s not in got and self._may_answer(s, expect[s])]
                left = deadline - time.monotonic()
                if not missing or left <= 0:
                    break
                if self._direct is None:
                    self._cv.wait(left)
                    continue
                self._send_wanted_locked()
                if self._direct is None:
                    continue  # the send failed: the link is down
                # a sequence being started again sends its request once the worker is done: look
                # every so often
                syncing = any(self._seqs[s].state == SYNCING for s in missing if s in self._seqs)
                self._read_unlocked(min(left, SYNC_POLL_S) if syncing else left)
            if missing:
                self.lagging = True
                self.stats.late += len(missing)
        return got

    def shutdown(self) -> None:
        with self._cv:
            self._closed = True
            self._mark_down_locked()
        self._work.put(("stop",))

    # ---- internals ----------------------------------------------------------------------
    def _may_answer(self, sid: str, length: int) -> bool:
        seq = self._seqs.get(sid)
        if seq is None or not self._up:
            return False
        return seq.inflight == length or seq.wanted is not None

    def _read_unlocked(self, timeout: float) -> bool:
        """Direct port, called holding the lock once: read one answer within `timeout` s (0: only
        one that has come) with the lock let go meanwhile, then take it in; whether one came. A
        failed stream marks the link down."""
        stream, generation = self._direct, self._generation
        self._cv.release()
        try:
            resp = stream.read(timeout)
            failure = None
        except Exception as exc:  # noqa: BLE001 - whatever the drafter sends, the engine's step goes on
            resp, failure = None, exc
        finally:
            self._cv.acquire()
        if generation != self._generation:
            return False  # the link went down meanwhile (and the stream with it)
        if failure is not None:
            log.warning("drafter %s stream ended: %s", self.address, _describe(failure))
            if (isinstance(failure, grpc.RpcError) and failure.code() not in LINK_FAILURES
                    and not self._direct_answered):
                self._direct_refused = stream.address
                log.warning("drafter %s: its direct port %s refuses Speculate: grpcio's stream from now on",
                            self.address, stream.address)
            self._mark_down_locked()
            return False
        if resp is None:
            return False
        self._direct_answered = True
        try:
            self._on_response(resp, generation)
        except Exception:  # noqa: BLE001
            log.exception("drafter %s: an answer could not be taken in", self.address)
            self._mark_down_locked()
        return True

    def _catch_up_locked(self) -> None:
        """Direct port: close the streams given up, take in the answers that have come already,
        and send the requests that sequences started again meanwhile want."""
        while self._retired:
            self._retired.pop().close()
        while self._direct is not None and self._read_unlocked(0.0):
            pass
        self._send_wanted_locked()

    def _send_wanted_locked(self) -> None:
        """Direct port: send what the sequences the worker has started again wanted meanwhile."""
        while self._restarted and self._direct is not None:
            sid = self._restarted.pop()
            seq = self._seqs.get(sid)
            if seq is None or seq.state != READY or seq.wanted is None or seq.inflight is not None:
                continue  # gone, down again, or superseded by a newer request
            wanted, seq.wanted = seq.wanted, None
            if wanted.length >= seq.known:
                self._send_locked(sid, seq, wanted, None)

    def _send_locked(self, sid, seq: _Seq, want: Want, outcome: Outcome | None) -> None:
        length = want.length
        tokens = self._tokens_of(sid)
        if tokens is None or len(tokens) < length:
            return
        req = pb.DraftRequest(sequence_id=sid, committed_length=length, appended_tokens=list(tokens[seq.known:length]),
                              root_token=want.root, node_budget=max(0, want.budget), shape=want.shape)
        if outcome is not None and seq.known == length - len(outcome.accepted_nodes):
            req.outcome.CopyFrom(outcome.to_proto())
        seq.known = length
        seq.inflight = length
        seq.sent_at = time.monotonic()
        seq.result = None
        if self._direct is None:
            self._send_q.put(req)
            return
        try:
            self._direct.write(req)
        except Exception as exc:  # noqa: BLE001 - a failed write ends the stream, never the engine's step
            log.warning("drafter %s stream ended: %s", self.address, _describe(exc))
            self._mark_down_locked()

    def _mark_down_locked(self) -> None:
        if self._up:
            self._up = False
            self._generation += 1
            if self._send_q is not None:
                self._send_q.put(None)
            if self._call is not None:
                self._call.cancel()  # a hung drafter must not keep the old reader blocked
            if self._direct is not None:
                # this may be any thread, and the engine's may be reading it: a socket shutdown wakes
                # that read; the engine's thread closes it
                self._direct.abort()
                self._retired.append(self._direct)
                self._direct = None
            if not self._closed:
                self._work.put(("connect",))
        for seq in self._seqs.values():
            seq.state, seq.inflight, seq.result, seq.wanted = SYNCING, None, None, None
        self._restarted.clear()
        self.lagging = False
        self._cv.notify_all()

    def _work_loop(self) -> None:
        while True:
            job = self._work.get()
            if job[0] == "stop":
                if self._channel is not None:
                    self._channel.close()
                return
            try:
                if job[0] == "connect":
                    time.sleep(self._reconnect_delay)
                    self._reconnect_delay = min(2.0, max(0.1, 2 * self._reconnect_delay))
                    if not self._connect():
                        self._work.put(("connect",))
                elif job[0] == "start":
                    self._start(job[1])
                elif job[0] == "end":
                    self._end(job[1])
            except grpc.RpcError as exc:
                log.warning("drafter %s: %s failed: %s", self.address, job[0], _describe(exc))
                if exc.code() in LINK_FAILURES:  # the link is broken (a failed end waits in `_ends`)
                    with self._cv:
                        self._mark_down_locked()
                elif job[0] == "start":
                    with self._cv:  # this sequence is not draftable: it decodes plainly
                        self._seqs.pop(job[1], None)
            except Exception:  # noqa: BLE001 - the link must survive anything the drafter does
                log.exception("drafter %s: %s failed", self.address, job[0])

    def _connect(self) -> bool:
        with self._cv:
            if self._closed or self._up:
                return True
        if self._channel is not None:
            self._channel.close()
        self._channel = make_channel(self.address, self._token)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=2.0)
            stub = pbg.DrafterStub(self._channel)
            stats = stub.Stats(pb.StatsRequest(), timeout=2.0)
        except (grpc.FutureTimeoutError, grpc.RpcError):
            return False
        direct = self._open_direct(stats.direct_port)
        if not stats.per_tree_shapes:
            log.warning("drafter %s predates per-tree shapes: trees of the sequences' own shapes only", self.address)
        self.per_tree_shapes = stats.per_tree_shapes
        self.default_shape = stats.default_shape
        send_q: Optional[queue.Queue] = None
        responses = None
        if direct is None:
            send_q = queue.Queue()
            responses = stub.Speculate(drain(send_q))
        with self._cv:
            self._stub = stub
            self._send_q = send_q
            self._call = responses
            self._direct = direct
            self._direct_answered = False
            self._up = True
            generation = self._generation
            sids = list(self._seqs)
            ends = self._ends.take_all()
        self.stats.reconnects += 1
        if responses is not None:
            threading.Thread(target=self._read, args=(responses, generation), name="draft-reader",
                             daemon=True).start()
        # the ends go first: a start queued for one of their ids later (a reopen) runs after its end
        for sid in ends:
            self._work.put(("end", sid))
        for sid in sids:
            self._work.put(("start", sid))
        log.info("drafter %s connected%s", self.address,
                 f" (Speculate on its direct port {direct.address})" if direct is not None else "")
        return True

    def _open_direct(self, port: int) -> Optional[DirectStream]:
        """The Speculate stream on the drafter's direct `port` (0: it has none), or None (then
        grpcio's stream) when that port does not answer."""
        if not port:
            return None
        address = f"{self.address.rpartition(':')[0]}:{port}"
        if address == self._direct_refused:
            return None
        try:
            return DirectStream(address, SPECULATE_PATH, lambda m: m.SerializeToString(), pb.DraftResponse.FromString,
                                auth_token=self._token, send_timeout=self._timeout,
                                connect_timeout=DIRECT_CONNECT_S)
        except grpc.RpcError as exc:
            log.warning("drafter %s advertises direct port %d, which does not answer (%s): Speculate over gRPC "
                        "instead", self.address, port, _describe(exc))
            return None

    @property
    def speculate_address(self) -> Optional[str]:
        """Where the Speculate stream goes: the direct port's address, the drafter's, or None while
        the link is down."""
        with self._cv:
            if not self._up:
                return None
            return self._direct.address if self._direct is not None else self.address

    def _end(self, sid: str) -> None:
        """EndSequence for a closed sequence; kept for later when the drafter cannot be reached."""
        with self._cv:
            up, stub = self._up, self._stub
        if not up:
            self._defer_end(sid)
            return
        try:
            stub.EndSequence(pb.EndSequenceRequest(sequence_id=sid), timeout=self._timeout)
        except grpc.RpcError as exc:
            if exc.code() in LINK_FAILURES:
                self._defer_end(sid)
            raise

    def _defer_end(self, sid: str) -> None:
        with self._cv:
            if sid in self._seqs or self._closed:  # opened again (its start resets it), or shutting down
                return
            self._ends.add(sid)
            if self._ends.dropped == 1:  # once per outage: every later end drops one more
                log.warning("drafter %s: %d EndSequences wait for the link, the most kept; older ones are dropped "
                            "(the drafter's idle sweep ends those sequences)", self.address, len(self._ends))

    def _start(self, sid: str) -> None:
        with self._cv:
            seq = self._seqs.get(sid)
            if seq is None or not self._up:
                return
            seq.state, seq.inflight, seq.result = SYNCING, None, None
        tokens = self._tokens_of(sid)
        if tokens is None:
            return
        tokens = list(tokens)
        resp = self._stub.StartSequence(
            pb.StartSequenceRequest(sequence_id=sid, tokens=tokens, sampling=seq.sampling, options=seq.options),
            timeout=self._timeout,
        )
        with self._cv:
            if self._seqs.get(sid) is not seq or not self._up:
                return
            seq.known = int(resp.committed_length) if resp.committed_length else len(tokens)
            seq.state = READY
            self.stats.resyncs += 1
            if self._direct is None:
                wanted, seq.wanted = seq.wanted, None
                if wanted is not None and wanted.length >= seq.known:
                    self._send_locked(sid, seq, wanted, None)
            else:  # on the direct port the engine's thread sends `wanted` (`_send_wanted_locked`)
                self._restarted.add(sid)
            self._cv.notify_all()

    def _read(self, responses, generation: int) -> None:
        try:
            for resp in responses:
                self._on_response(resp, generation)
        except grpc.RpcError as exc:
            if generation == self._generation:
                log.warning("drafter %s stream ended: %s", self.address, _describe(exc))
        with self._cv:
            if generation == self._generation:
                self._mark_down_locked()

    def _on_response(self, resp, generation: int) -> None:
        self._reconnect_delay = 0.0  # the stream answers: the link works
        tree = None
        error = resp.HasField("error")
        if not error:
            try:
                tree = tree_from_proto(resp.tree, self._vocab, self._max_nodes)
            except TreeError as exc:
                self.stats.invalid += 1
                log.warning("drafter sent a malformed tree for %s: %s", resp.sequence_id, exc)
        with self._cv:
            if generation != self._generation:
                return
            seq = self._seqs.get(resp.sequence_id)
            if seq is None:
                return
            if seq.inflight == resp.committed_length or error:
                seq.inflight = None
            if error:
                log.info("drafter lost sequence %s (%s): restarting it", resp.sequence_id, resp.error.message)
                seq.state = SYNCING
                self._work.put(("start", resp.sequence_id))
            elif tree is not None:
                seq.result = (int(resp.committed_length), tree, bool(resp.from_draft_ahead), float(resp.draft_ms))
                self.stats.trees += 1
                self.stats.draft_ahead_hits += int(resp.from_draft_ahead)
                self.stats.draft_ms += float(resp.draft_ms)
            if not any(s.inflight is not None for s in self._seqs.values()):
                self.lagging = False
            self._cv.notify_all()


def _describe(exc: BaseException) -> str:
    try:
        return f"{exc.code().name}: {exc.details()}"
    except Exception:  # noqa: BLE001
        return str(exc)
