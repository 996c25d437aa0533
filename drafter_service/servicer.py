"""The `Drafter` gRPC service: wire messages in and out of `engine.Drafter`.

Speculate is one bidirectional stream: each DraftRequest gets exactly one DraftResponse, in request
order. A request that fails carries `error` (its gRPC code and message) and changes nothing; the
stream stays open and other sequences are unaffected.
"""
from __future__ import annotations

import logging
import threading

import grpc

from drafter_service.engine import DraftCall, Drafter, DraftReply
from treeserve.acceptance import Outcome
from treeserve.errors import InvalidArgument, item_error, status_of
from treeserve.sampling import Sampling
from treeserve.server import client_requests, grpc_errors
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


def call_from_proto(req) -> DraftCall:
    outcome = Outcome.from_proto(req.outcome) if req.HasField("outcome") else None
    return DraftCall(req.sequence_id, int(req.committed_length), tuple(int(t) for t in req.appended_tokens),
                     int(req.root_token), outcome, int(req.node_budget))


def reply_to_proto(reply: DraftReply):
    return pb.DraftResponse(sequence_id=reply.sequence_id, committed_length=reply.committed_length,
                            tree=tree_to_proto(reply.tree), from_draft_ahead=reply.from_draft_ahead,
                            draft_ms=reply.draft_ms)


class DrafterServicer(pbg.DrafterServicer):
    def __init__(self, drafter: Drafter, stopping: threading.Event | None = None):
        """stopping: the server's shutdown event; open Speculate streams end at their next request once set."""
        self.drafter = drafter
        self._stopping = stopping

    @grpc_errors
    def StartSequence(self, request, context):
        options = None
        if request.HasField("options"):
            o = request.options
            options = self.drafter.options(SHAPE_NAMES.get(o.shape), o.node_budget, o.max_depth, o.draft_ahead)
        try:
            sampling = Sampling.from_proto(request.sampling) if request.HasField("sampling") else Sampling()
        except ValueError as exc:
            raise InvalidArgument(f"sampling: {exc}") from exc
        length = self.drafter.start(request.sequence_id, list(request.tokens), sampling, options)
        return pb.StartSequenceResponse(committed_length=length)

    @grpc_errors
    def EndSequence(self, request, context):
        return pb.EndSequenceResponse(ended=self.drafter.end(request.sequence_id))

    @grpc_errors
    def Speculate(self, request_iterator, context):
        for req in client_requests(request_iterator, self._stopping):
            try:
                reply = self.drafter.draft(call_from_proto(req))
            except Exception as exc:  # noqa: BLE001 - per-request errors travel in the response
                code, _ = status_of(exc)
                if code == grpc.StatusCode.INTERNAL:
                    log.exception("draft request for %r failed", req.sequence_id)
                self.drafter.metrics.error(code.name)
                yield pb.DraftResponse(sequence_id=req.sequence_id, error=item_error(exc))
                continue
            yield reply_to_proto(reply)

    @grpc_errors
    def Stats(self, request, context):
        m = self.drafter.metrics
        return pb.DrafterStats(
            strategy=self.drafter.strategy, active_sequences=self.drafter.active(), trees=m.trees,
            draft_ahead_hits=m.ahead_hits, draft_ahead_misses=m.ahead_misses, mean_draft_ms=m.mean_draft_ms,
            saved_draft_ms=m.saved_ms,
        )

