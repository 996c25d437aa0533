"""A small client for the Drafter service.

    client = DrafterClient("127.0.0.1:50051")
    client.start("seq-1", prompt_tokens, Sampling(), DraftOptions(shape="dynamic", node_budget=16))
    with client.stream() as stream:
        reply = stream.draft("seq-1", committed_length=len(prompt_tokens), root=first_token)
        ...   # verify reply.tree, then
        reply = stream.draft("seq-1", new_length, bonus, appended=accepted_tokens, outcome=outcome)
    client.end("seq-1")

`SpeculateStream.submit` / `collect` pipeline many requests (e.g. one per sequence of a batch) on
the one stream; responses come back in request order.
"""
from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Iterable, Sequence

from treeserve.acceptance import Outcome
from treeserve.sampling import Sampling
from treeserve.server import channel
from treeserve.tree import TokenTree, dist_from_proto
from treeserve.v1 import treeserve_pb2 as pb
from treeserve.v1 import treeserve_pb2_grpc as pbg

_SHAPES = {"chain": pb.TREE_SHAPE_CHAIN, "static": pb.TREE_SHAPE_STATIC, "dynamic": pb.TREE_SHAPE_DYNAMIC,
           "ngram": pb.TREE_SHAPE_NGRAM, "fused": pb.TREE_SHAPE_FUSED}


@dataclass(frozen=True)
class DraftOptions:
    shape: str | None = None  # None: the drafter's default
    node_budget: int = 0
    max_depth: int = 0
    draft_ahead: bool = True

    def to_proto(self):
        shape = _SHAPES[self.shape] if self.shape else pb.TREE_SHAPE_UNSPECIFIED
        return pb.DraftOptions(shape=shape, node_budget=self.node_budget, max_depth=self.max_depth,
                               draft_ahead=self.draft_ahead)


@dataclass(frozen=True)
class DraftResult:
    """A DraftResponse: `tree` is None and `error` = (grpc code number, message) when it failed."""

    sequence_id: str
    committed_length: int
    tree: TokenTree | None
    from_draft_ahead: bool = False
    draft_ms: float = 0.0
    error: tuple[int, str] | None = None

    @classmethod
    def from_proto(cls, msg) -> "DraftResult":
        if msg.HasField("error"):
            return cls(msg.sequence_id, int(msg.committed_length), None, error=(msg.error.code, msg.error.message))
        draft = tuple(dist_from_proto(d) for d in msg.tree.draft) if len(msg.tree.draft) else None
        tree = TokenTree(tuple(msg.tree.tokens), tuple(msg.tree.parents), draft)
        return cls(msg.sequence_id, int(msg.committed_length), tree, msg.from_draft_ahead, msg.draft_ms)


def draft_request(sequence_id: str, committed_length: int, root: int, appended: Sequence[int] = (),
                  outcome: Outcome | None = None, node_budget: int = 0, shape: str | None = None):
    """shape: this tree's (None: the sequence's)."""
    req = pb.DraftRequest(sequence_id=sequence_id, committed_length=committed_length,
                          appended_tokens=list(appended), root_token=root, node_budget=node_budget,
                          shape=_SHAPES[shape] if shape else pb.TREE_SHAPE_UNSPECIFIED)
    if outcome is not None:
        req.outcome.CopyFrom(outcome.to_proto())
    return req


class SpeculateStream:
    """One open Speculate stream."""

    def __init__(self, stub, timeout: float | None = None):
        self._q: queue.Queue = queue.Queue()
        self._responses = stub.Speculate(self._requests(), timeout=timeout)
        self._pending = 0

    def _requests(self) -> Iterable:
        while True:
            item = self._q.get()
            if item is None:
                return
            yield item

    def submit(self, request) -> None:
        self._pending += 1
        self._q.put(request)

    def collect(self, n: int | None = None) -> list[DraftResult]:
        """The next `n` responses (default: all outstanding), in request order."""
        n = self._pending if n is None else n
        out = [DraftResult.from_proto(next(self._responses)) for _ in range(n)]
        self._pending -= n
        return out

    def draft(self, sequence_id: str, committed_length: int, root: int, appended: Sequence[int] = (),
              outcome: Outcome | None = None, node_budget: int = 0, shape: str | None = None) -> DraftResult:
        self.submit(draft_request(sequence_id, committed_length, root, appended, outcome, node_budget, shape))
        return self.collect(1)[0]

    def close(self) -> None:
        self._q.put(None)
        for _ in self._responses:  # drain so the call ends cleanly
            pass

    def __enter__(self) -> "SpeculateStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DrafterClient:
    def __init__(self, address: str, auth_token: str | None = None, timeout: float = 30.0):
        self._channel = channel(address, auth_token)
        self.stub = pbg.DrafterStub(self._channel)
        self.timeout = timeout

    def start(self, sequence_id: str, tokens: Sequence[int], sampling: Sampling = Sampling(),
              options: DraftOptions | None = None) -> int:
        req = pb.StartSequenceRequest(sequence_id=sequence_id, tokens=list(tokens), sampling=sampling.to_proto())
        if options is not None:
            req.options.CopyFrom(options.to_proto())
        return int(self.stub.StartSequence(req, timeout=self.timeout).committed_length)

    def end(self, sequence_id: str) -> bool:
        return bool(self.stub.EndSequence(pb.EndSequenceRequest(sequence_id=sequence_id), timeout=self.timeout).ended)

    def stats(self):
        return self.stub.Stats(pb.StatsRequest(), timeout=self.timeout)

    def stream(self, timeout: float | None = None) -> SpeculateStream:
        return SpeculateStream(self.stub, timeout)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "DrafterClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
