"""A small typed client of the Verifier service. Call failures surface as grpc.RpcError unchanged;
per-item failures of Verify come back as `ItemResult.error`. `VerifierClient.verify_stream()`
opens Verify over one long-lived VerifyStream (`treeserve.stream_session`): one request/response
pair at a time, with a deadline per message; `verify_stream_direct(address)` the same on the
verifier's direct port (`treeserve.h2grpc`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import grpc

from treeserve.acceptance import Outcome
from treeserve.h2grpc.client import DirectStreamSession
from treeserve.sampling import Sampling
from treeserve.server import channel as make_channel
from treeserve.stream_session import StreamSession
from treeserve.tree import TokenTree, tree_to_proto
from treeserve.v1 import treeserve_pb2 as pb
from treeserve.v1 import treeserve_pb2_grpc as pbg

_CODES = {c.value[0]: c for c in grpc.StatusCode}
VERIFY_STREAM_PATH = f"/{pb.DESCRIPTOR.services_by_name['Verifier'].full_name}/VerifyStream"


def direct_verify_stream(address: str, timeout: float | None = None,
                         auth_token: str | None = None) -> DirectStreamSession:
    """VerifyStream on a verifier's direct port at `address` ("host:port"; `treeserve verifier
    --direct-port`, treeserve.h2grpc), with StreamSession's contract: `timeout` bounds each
    response's wait. It opens its own connection."""
    return DirectStreamSession(address, VERIFY_STREAM_PATH, pb.VerifyRequest.SerializeToString,
                               pb.VerifyResponse.FromString, timeout, auth_token=auth_token)


@dataclass(frozen=True)
class CommitSpec:
    """Commit the last verified tree (built on `committed_length`) along `accepted_nodes`."""

    committed_length: int
    accepted_nodes: tuple[int, ...]

    def to_proto(self):
        return pb.Commit(committed_length=self.committed_length, accepted_nodes=self.accepted_nodes)


@dataclass(frozen=True)
class VerifyItem:
    sequence_id: str
    committed_length: int  # the length the tree is built on, after `commit`
    tree: TokenTree
    commit: CommitSpec | None = None
    top_logprobs: int = 0

    def to_proto(self):
        msg = pb.VerifyItem(
            sequence_id=self.sequence_id,
            committed_length=self.committed_length,
            tree=tree_to_proto(self.tree),
            top_logprobs=self.top_logprobs,
        )
        if self.commit is not None:
            msg.commit.CopyFrom(self.commit.to_proto())
        return msg


@dataclass(frozen=True)
class ItemError:
    code: grpc.StatusCode
    message: str


@dataclass(frozen=True)
class ItemResult:
    sequence_id: str
    error: ItemError | None = None
    committed_length: int = 0
    target_tokens: tuple[int, ...] = ()
    walk: Outcome | None = None
    top_logprobs: tuple[tuple[tuple[int, ...], tuple[float, ...]], ...] = ()  # per node: (tokens, logprobs)

    @property
    def ok(self) -> bool:
        return self.error is None

    @classmethod
    def from_proto(cls, r) -> "ItemResult":
        if r.HasField("error"):
            return cls(r.sequence_id, ItemError(_CODES.get(r.error.code, grpc.StatusCode.UNKNOWN), r.error.message))
        return cls(
            r.sequence_id,
            None,
            int(r.committed_length),
            tuple(r.target_tokens),
            Outcome.from_proto(r.walk) if r.HasField("walk") else None,
            tuple((tuple(t.tokens), tuple(t.logprobs)) for t in r.top_logprobs),
        )


@dataclass(frozen=True)
class VerifyReply:
    results: list[ItemResult]  # in request order
    forward_ms: float
    batch_sequences: int


class VerifierClient:
    """`timeout`: default deadline per call, seconds (None: no deadline)."""

    def __init__(self, address: str | None = None, *, channel: grpc.Channel | None = None,
                 auth_token: str | None = None, timeout: float | None = 60.0):
        if (address is None) == (channel is None):
            raise ValueError("give exactly one of address and channel")
        self._own = channel is None
        self._channel = channel if channel is not None else make_channel(address, auth_token)
        self._stub = pbg.VerifierStub(self._channel)
        self._auth_token = auth_token
        self.timeout = timeout

    def close(self) -> None:
        if self._own:
            self._channel.close()

    def __enter__(self) -> "VerifierClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _t(self, timeout: float | None) -> float | None:
        return self.timeout if timeout is None else timeout

    def prefill(self, sequence_id: str, prompt: Sequence[int], sampling: Sampling = Sampling(),
                timeout: float | None = None) -> tuple[int, int]:
        """Returns (committed_length, next_token)."""
        r = self._stub.Prefill(
            pb.PrefillRequest(sequence_id=sequence_id, prompt_tokens=list(prompt), sampling=sampling.to_proto()),
            timeout=self._t(timeout),
        )
        return int(r.committed_length), int(r.next_token)

    def verify_raw(self, request, timeout: float | None = None):
        """Send a prepared pb.VerifyRequest; returns the pb.VerifyResponse."""
        return self._stub.Verify(request, timeout=self._t(timeout))

    def verify_stream(self, timeout: float | None = None) -> StreamSession:
        """Verify over one long-lived VerifyStream: `send(pb.VerifyRequest) -> pb.VerifyResponse`,
        `close()`, a context manager. `timeout`: the deadline of each response (default: the
        client's); see StreamSession for what a failure does to the stream."""
        return StreamSession(self._stub.VerifyStream, self._t(timeout))

    def verify_stream_direct(self, address: str, timeout: float | None = None) -> DirectStreamSession:
        """`verify_stream` on the verifier's direct port at `address` (`treeserve verifier
        --direct-port`; treeserve.h2grpc): the same contract, with a round trip that passes no
        message between threads at either end. It opens its own connection."""
        return direct_verify_stream(address, self._t(timeout), self._auth_token)

    def verify(self, items: Sequence[VerifyItem], timeout: float | None = None) -> VerifyReply:
        r = self.verify_raw(pb.VerifyRequest(items=[it.to_proto() for it in items]), timeout)
        return VerifyReply([ItemResult.from_proto(x) for x in r.results], float(r.forward_ms), int(r.batch_sequences))

    def commit(self, sequence_id: str, committed_length: int, accepted_nodes: Sequence[int],
               timeout: float | None = None) -> int:
        """Returns the committed length afterwards."""
        spec = CommitSpec(committed_length, tuple(accepted_nodes))
        r = self._stub.Commit(pb.CommitRequest(sequence_id=sequence_id, commit=spec.to_proto()), timeout=self._t(timeout))
        return int(r.committed_length)

    def release(self, sequence_id: str, timeout: float | None = None) -> bool:
        return bool(self._stub.Release(pb.ReleaseRequest(sequence_id=sequence_id), timeout=self._t(timeout)).released)

    def stats(self, timeout: float | None = None):
        """pb.VerifierStats."""
        return self._stub.Stats(pb.StatsRequest(), timeout=self._t(timeout))
