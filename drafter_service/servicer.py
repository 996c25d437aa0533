"""The `Drafter` gRPC service: wire messages in and out of `engine.Drafter`.

Speculate is one bidirectional stream: each DraftRequest gets exactly one DraftResponse, in request
order. A request that fails carries `error` (its gRPC code and message) and changes nothing; the
stream stays open and other sequences are unaffected.

An open Speculate stream holds one of the server's threads for its whole life (grpcio's sync
server), idle or not, so the server takes at most half its threads' worth of them (`stream_cap`,
as the verifier does for its VerifyStreams); the other half always serves StartSequence,
EndSequence, Stats and health.

The direct port (`--direct-port`, `treeserve.h2grpc`) serves Speculate too, the same handler on a
socket of its own: one thread per connection reads a request, drafts and writes the answer, with
no hand-off between threads. Stats advertises it; an orchestrator's draft link opens its stream
there when it can (`orchestrator.draft_link`).
"""
from __future__ import annotations

import logging
import threading

import grpc
from google.protobuf.message import DecodeError

from drafter_service.engine import DraftCall, Drafter, DraftReply
from treeserve.acceptance import Outcome
from treeserve.errors import InvalidArgument, Unavailable, item_error, status_of
from treeserve.h2grpc.server import POLL_SECONDS, DirectServer, Method
from treeserve.sampling import Sampling
from treeserve.server import GRACE_SECONDS, Server, StreamCap, client_requests, grpc_errors, rpc_threads, stream_cap
from treeserve.tree import tree_to_proto
from treeserve.v1 import treeserve_pb2 as pb
from treeserve.v1 import treeserve_pb2_grpc as pbg

log = logging.getLogger("treeserve.drafter")

SHAPE_NAMES = {
    pb.TREE_SHAPE_CHAIN: "chain",
    pb.TREE_SHAPE_STATIC: "static",
    pb.TREE_SHAPE_DYNAMIC: "dynamic",
    pb.TREE_SHAPE_NGRAM: "ngram",
    pb.TREE_SHAPE_FUSED: "fused",
}
SHAPE_ENUMS = {name: value for value, name in SHAPE_NAMES.items()}
SERVICE = pb.DESCRIPTOR.services_by_name["Drafter"].full_name


def shape_name(value: int) -> str | None:
    """The shape a TreeShape value names (None: unspecified, the drafter's default, or for one
    tree the sequence's own). A value this drafter does not know (from a newer client) is refused,
    not drafted as the default."""
    if value == pb.TREE_SHAPE_UNSPECIFIED:
        return None
    name = SHAPE_NAMES.get(value)
    if name is None:
        raise InvalidArgument(f"unknown tree shape {value}; known: "
                              + ", ".join(f"{v} ({n})" for v, n in sorted(SHAPE_NAMES.items())))
    return name


def call_from_proto(req) -> DraftCall:
    outcome = Outcome.from_proto(req.outcome) if req.HasField("outcome") else None
    return DraftCall(req.sequence_id, int(req.committed_length), tuple(int(t) for t in req.appended_tokens),
                     int(req.root_token), outcome, int(req.node_budget), shape_name(req.shape))


def reply_to_proto(reply: DraftReply):
    return pb.DraftResponse(sequence_id=reply.sequence_id, committed_length=reply.committed_length,
                            tree=tree_to_proto(reply.tree), from_draft_ahead=reply.from_draft_ahead,
                            draft_ms=reply.draft_ms)


class DrafterServicer(pbg.DrafterServicer):
    def __init__(self, drafter: Drafter, max_streams: int, stopping: threading.Event | None = None):
        """max_streams: Speculate streams open at once, more are RESOURCE_EXHAUSTED (`serve` takes
        half its server's threads); stopping: the server's shutdown event; open Speculate streams
        end at their next request once set."""
        self.drafter = drafter
        self._stopping = stopping
        self._streams = StreamCap(max_streams, "Speculate streams", "close one, or share one stream between sequences")
        self.direct_port = 0  # Stats advertises it (DrafterServer sets it once the port is open)

    @property
    def max_streams(self) -> int:
        return self._streams.limit

    @grpc_errors
    def StartSequence(self, request, context):
        options = None
        if request.HasField("options"):
            o = request.options
            options = self.drafter.options(shape_name(o.shape), o.node_budget, o.max_depth, o.draft_ahead)
        try:
            sampling = Sampling.from_proto(request.sampling) if request.HasField("sampling") else Sampling()
        except ValueError as exc:
            raise InvalidArgument(f"sampling: {exc}") from exc
        # the repeated field as it is: the drafter checks its length before it copies anything
        length = self.drafter.start(request.sequence_id, request.tokens, sampling, options)
        return pb.StartSequenceResponse(committed_length=length)

    @grpc_errors
    def EndSequence(self, request, context):
        return pb.EndSequenceResponse(ended=self.drafter.end(request.sequence_id))

    @grpc_errors
    def Speculate(self, request_iterator, context):
        """The stream holds a server thread until it ends: past `max_streams` open ones, a new
        stream is refused (RESOURCE_EXHAUSTED) before it reads anything."""
        with self._streams.held():
            for req in client_requests(request_iterator, self._stopping):
                yield self._draft(req)

    def _draft(self, req) -> pb.DraftResponse:
        """One stream request's response: its tree, or the error it met."""
        try:
            return reply_to_proto(self.drafter.draft(call_from_proto(req)))
        except Exception as exc:  # noqa: BLE001 - per-request errors travel in the response
            code, _ = status_of(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("draft request for %r failed", req.sequence_id)
            self.drafter.metrics.error(code.name)
            return pb.DraftResponse(sequence_id=req.sequence_id, error=item_error(exc))

    # ---- the direct port (treeserve.h2grpc) -------------------------------------------------
    def direct_methods(self) -> dict[str, Method]:
        """Speculate as the direct port serves it: each request message answered by `_draft`."""
        return {f"/{SERVICE}/Speculate": Method(self._direct_draft, streaming=True)}

    def _direct_draft(self, message: bytes, call) -> bytes:
        if self._stopping is not None and self._stopping.is_set():
            raise Unavailable("the drafter is shutting down")
        try:
            req = pb.DraftRequest.FromString(message)
        except DecodeError as exc:
            raise InvalidArgument(f"malformed DraftRequest: {exc}") from None
        return self._draft(req).SerializeToString()

    @grpc_errors
    def Stats(self, request, context):
        m = self.drafter.metrics
        return pb.DrafterStats(
            strategy=self.drafter.strategy, active_sequences=self.drafter.active(), trees=m.trees,
            draft_ahead_hits=m.ahead_hits, draft_ahead_misses=m.ahead_misses, mean_draft_ms=m.mean_draft_ms,
            saved_draft_ms=m.saved_ms, direct_port=self.direct_port, per_tree_shapes=True,
            default_shape=SHAPE_ENUMS[self.drafter.defaults.shape],
        )


class DrafterServer:
    """A running Drafter service: the gRPC server, its thread pool sized for the drafter's
    sequences (`rpc_threads`), Speculate streams capped to half of it (`stream_cap`), and with
    `direct_address` the direct port beside it. `wait()` serves until SIGTERM/SIGINT; `stop()`."""

    def __init__(self, drafter: Drafter, address: str, auth_token: str | None = None,
                 grace_s: float = GRACE_SECONDS, direct_address: str | None = None,
                 direct_poll_s: float = POLL_SECONDS):
        """direct_address: where to serve Speculate on the direct port as well (None: not at
        all); direct_poll_s: how long its connections poll for the next request before they sleep."""
        threads = rpc_threads(drafter.max_sequences)
        self.server = Server(address, max_workers=threads, auth_token=auth_token, grace_s=grace_s)
        self.servicer = DrafterServicer(drafter, stopping=self.server.stopping, max_streams=stream_cap(threads))
        self.server.add(pbg.add_DrafterServicer_to_server, self.servicer, "Drafter")
        self.direct: DirectServer | None = None
        if direct_address is not None:
            self.direct = DirectServer(direct_address, self.servicer.direct_methods(), auth_token=auth_token,
                                       poll_s=direct_poll_s).start()
            self.servicer.direct_port = self.direct.port
            direct = self.direct
            drafter.metrics.direct_connections(lambda: direct.connections)
        try:
            self.server.start()
        except BaseException:
            if self.direct is not None:
                self.direct.stop(grace=0.0)
            raise
        self.port = self.server.port
        self.direct_port = self.direct.port if self.direct is not None else None

    def wait(self) -> None:
        """Serve until SIGTERM/SIGINT, then shut down gracefully."""
        self.server.wait()  # the direct port's streams end at their next message meanwhile
        if self.direct is not None:
            self.direct.stop(grace=min(1.0, self.server.grace_s))

    def stop(self, grace: float | None = None) -> None:
        """grace: as `treeserve.server.Server.stop` (None: the server's own)."""
        if self.direct is not None:
            self.direct.stop(grace=min(1.0, self.server.grace_s if grace is None else grace))
        self.server.stop(grace)


def serve(drafter: Drafter, address: str, auth_token: str | None = None, grace_s: float = GRACE_SECONDS,
          direct_address: str | None = None, direct_poll_s: float = POLL_SECONDS) -> DrafterServer:
    """A started `DrafterServer` for `drafter` on `address`."""
    return DrafterServer(drafter, address, auth_token, grace_s, direct_address, direct_poll_s)
