"""The Verifier gRPC service: decode and check requests at the edge, hand the work to the batcher
(which runs it on this RPC thread when the model is free), encode the answers, and report where a
Verify call's time went (metrics, recorded after the reply is sent). Nothing here touches the
model directly.

Verify and VerifyStream share one request path (`_verify`); they differ only in how a request
arrives, how a malformed one ends the call (a status for the call, or for the whole stream) and
when the metrics are recorded. The direct port (`treeserve.h2grpc`, `direct_methods`) serves both
through the same path. On every port the path takes the request's bytes and parses them itself
(`parse_verify_request`), so a request that does not parse is INVALID_ARGUMENT everywhere.

A VerifyStream holds one of the main port's RPC threads for as long as it is open (grpcio's sync
server), so the main port takes at most half its threads' worth of them (`stream_cap`); the rest
stay for unary calls (Prefill, Commit, Stats, health), which an idle stream must never starve."""
from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import grpc
import torch
from google.protobuf.message import DecodeError

from treeserve.errors import InvalidArgument, ServeError, Unavailable, item_error, status_of
from treeserve.h2grpc.server import POLL_SECONDS, DirectServer, Method
from treeserve.sampling import Sampling
from treeserve.server import (GRACE_SECONDS, Server, StreamCap, client_requests, grpc_errors, on_error, rpc_threads,
                              stream_cap)
from treeserve.tree import TreeError, tree_from_proto
from treeserve.v1 import treeserve_pb2 as pb
from treeserve.v1 import treeserve_pb2_grpc as pbg
from verifier_service.batcher import Batcher, VerifyReply
from verifier_service.engine import Engine, VerifyWork
from verifier_service.limits import MAX_SEQUENCE_ID_BYTES, MAX_TOP_LOGPROBS, Limits
from verifier_service.metrics import metrics
from verifier_service.pool import LifoExecutor

SERVICE = pb.DESCRIPTOR.services_by_name["Verifier"].full_name
# The methods whose requests reach the servicer as bytes, on both ports (see `parse_verify_request`)
RAW_REQUEST_METHODS = ("Verify", "VerifyStream")


class DeadlineExceeded(ServeError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


def _counted(method):
    """Count a failed call, or a failed stream, under its status code (the grpc_errors boundary
    then reports it)."""

    def count(context, exc):
        metrics().error(status_of(exc)[0])
        raise exc

    return on_error(method, count)


def after_reply(context, fn) -> None:
    """Run `fn` once the call is over (gRPC runs call callbacks after the reply went out), so
    bookkeeping such as metrics stays off the caller's path; at once if the call already ended."""
    if not context.add_callback(fn):
        fn()


def check_sequence_id(sequence_id: str) -> str:
    if not sequence_id:
        raise InvalidArgument("sequence_id is empty")
    if len(sequence_id.encode()) > MAX_SEQUENCE_ID_BYTES:
        raise InvalidArgument(f"sequence_id is longer than {MAX_SEQUENCE_ID_BYTES} bytes")
    return sequence_id


def parse_verify_request(message: bytes) -> pb.VerifyRequest:
    """A VerifyRequest off the wire. Bytes that do not parse (a truncated message, a sequence_id
    that is not UTF-8) are the client's error, INVALID_ARGUMENT; grpcio, left to parse them before
    the handler, would answer INTERNAL ("Exception deserializing request!")."""
    try:
        return pb.VerifyRequest.FromString(message)
    except DecodeError as exc:
        raise InvalidArgument(f"VerifyRequest does not parse: {exc}") from exc


def first_duplicate(ids: Iterable[str]) -> str | None:
    """The first id that repeats an earlier one, or None; one pass (a request may hold many ids)."""
    seen: set[str] = set()
    for sid in ids:
        if sid in seen:
            return sid
        seen.add(sid)
    return None


def sampling_from(msg) -> Sampling:
    try:
        return Sampling.from_proto(msg)
    except ValueError as exc:
        raise InvalidArgument(f"sampling: {exc}") from exc


@dataclass(frozen=True)
class ModelInfo:
    """What Stats reports about the loaded model."""

    name: str
    device: str
    eos_token_ids: tuple[int, ...]


class VerifierServicer(pbg.VerifierServicer):
    def __init__(self, engine: Engine, batcher: Batcher, info: ModelInfo, max_streams: int,
                 stopping: threading.Event | None = None):
        """max_streams: VerifyStreams open at once on the main port (more are RESOURCE_EXHAUSTED;
        see `stream_cap`); stopping: the server's shutdown event; open VerifyStreams end at their
        next request once set."""
        self._stopping = stopping
        self._streams = StreamCap(max_streams, "VerifyStreams", "close one, or call Verify")
        self._engine = engine
        self._batcher = batcher
        self._limits: Limits = engine.limits
        self._vocab = engine.vocab_size
        self._info = info
        self.direct_port = 0  # Stats advertises it (VerifierServer sets it once the port is open)

    def _wait(self, future, context):
        """The future's result within the call's deadline. A call that ran the model on its own
        thread (the model was free) comes here with the result in hand, after its deadline if
        the forward outlasted it; gRPC then reports DEADLINE_EXCEEDED to the caller.

        A call without a deadline, such as a VerifyStream opened without one (its messages have
        none of their own), waits for the result: the work cannot hang on a caller that left,
        because the batcher drops queued work whose call is no longer active (`alive`)."""
        remaining = context.time_remaining()
        # gRPC reports "no deadline" as ~292 billion years, more than a lock wait accepts
        timeout = remaining if remaining < threading.TIMEOUT_MAX else None
        try:
            return future.result(timeout=timeout)
        except TimeoutError as exc:
            raise DeadlineExceeded("deadline passed while waiting for the model") from exc

    # ---- sequences ----------------------------------------------------------------------

    @property
    def max_streams(self) -> int:
        return self._streams.limit

    @grpc_errors
    @_counted
    def Prefill(self, request, context):
        sid = check_sequence_id(request.sequence_id)
        prompt = tuple(request.prompt_tokens)
        if not prompt:
            raise InvalidArgument("prompt_tokens is empty")
        if len(prompt) >= self._limits.max_sequence_length:
            raise InvalidArgument(
                f"prompt of {len(prompt)} tokens leaves no room below the maximum sequence length "
                f"{self._limits.max_sequence_length}"
            )
        bad = next((t for t in prompt if not 0 <= t < self._vocab), None)
        if bad is not None:
            raise InvalidArgument(f"prompt token {bad} outside the vocabulary [0, {self._vocab})")
        s = sampling_from(request.sampling)
        fut = self._batcher.submit(self._engine.prefill, sid, prompt, s, alive=context.is_active)
        length, token = self._wait(fut, context)
        return pb.PrefillResponse(committed_length=length, next_token=token)

    @grpc_errors
    @_counted
    def Commit(self, request, context):
        sid = check_sequence_id(request.sequence_id)
        if not request.HasField("commit"):
            raise InvalidArgument("commit is missing")
        c = request.commit
        fut = self._batcher.submit(
            self._engine.commit, sid, int(c.committed_length), tuple(c.accepted_nodes), alive=context.is_active
        )
        return pb.CommitResponse(committed_length=self._wait(fut, context))

    @grpc_errors
    @_counted
    def Release(self, request, context):
        sid = check_sequence_id(request.sequence_id)
        fut = self._batcher.submit(self._engine.release, sid, alive=context.is_active)
        return pb.ReleaseResponse(released=self._wait(fut, context))

    # ---- verification -------------------------------------------------------------------
    def _decode_item(self, item) -> VerifyWork:
        sid = check_sequence_id(item.sequence_id)
        if not 0 <= item.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {item.top_logprobs}")
        try:
            tree = tree_from_proto(item.tree, self._vocab, self._limits.max_tree_nodes)
        except TreeError as exc:
            raise InvalidArgument(f"sequence {sid!r}: malformed tree: {exc}") from exc
        commit = None
        if item.HasField("commit"):
            commit = (int(item.commit.committed_length), tuple(item.commit.accepted_nodes))
        return VerifyWork(sid, int(item.committed_length), tree, commit, int(item.top_logprobs))

    @grpc_errors
    @_counted
    def Verify(self, request: bytes, context):
        """`request`: the VerifyRequest's bytes (registered raw: RAW_REQUEST_METHODS)."""
        response, record = self._verify(request, context)
        after_reply(context, record)
        return response

    @grpc_errors
    @_counted
    def VerifyStream(self, request_iterator, context):
        """One response per request (each the VerifyRequest's bytes), in order. A request malformed
        as a whole raises out of the loop, and the boundary ends the stream with its status.
        Messages have no deadline of their own (`_wait` then waits for the result); a cancelled
        stream stops its queued work through `context.is_active`, as a cancelled call does.

        The stream holds an RPC thread until it ends: past `max_streams` open ones, a new stream
        is refused (RESOURCE_EXHAUSTED) before it reads anything."""
        with self._streams.held():
            for request in client_requests(request_iterator, self._stopping):
                response, record = self._verify(request, context)
                try:
                    yield response
                finally:
                    # gRPC resumes a response generator only once the message went out (or closes
                    # it when the stream ended first), so this is "after the reply", as for Verify;
                    # the client is by then busy with the answer, not waiting on this thread.
                    record()

    def _verify(self, message: bytes, context):
        """Parse, decode, verify and encode one VerifyRequest (`message`: its bytes). Returns the
        VerifyResponse and a callable that records the request's time split by stage (metrics),
        for the caller to run once the response is on its way. Raises ServeError when the request
        is malformed as a whole."""
        t_start = time.perf_counter()
        request = parse_verify_request(message)
        items = request.items
        self._check_items(items)
        errors: dict[int, BaseException] = {}
        works: list[VerifyWork] = []
        where: list[int] = []
        for i, item in enumerate(items):
            try:
                works.append(self._decode_item(item))
                where.append(i)
            except ServeError as exc:
                errors[i] = exc
        t_handoff = time.perf_counter()
        got = self._batcher.run(works, alive=context.is_active)
        # the usual case: this thread found the model free and ran the forward itself
        reply = got if isinstance(got, VerifyReply) else self._wait(got, context)
        t_back = time.perf_counter()
        try:
            resp = self._encode(request, reply, dict(zip(where, reply.outputs)), errors)
        except BaseException:
            reply.after()
            raise
        t_end = time.perf_counter()
        # everything else waits until the response is on its way
        return resp, functools.partial(self._record, reply, t_start, t_handoff, t_back, t_end)

    def _check_items(self, items) -> None:
        """Refuse a request as a whole, before any tree is decoded, when it holds more items than
        the verifier has sequences (max_sequences; every item past that would fail anyway, after
        its decode and a place in the queue ahead of other clients' work) or one sequence twice."""
        limit = self._limits.max_sequences
        if len(items) > limit:
            raise InvalidArgument(f"{len(items)} items in one request: at most {limit} (the verifier's "
                                  "max_sequences, its live sequences) are served")
        if len(items) > 1:
            dup = first_duplicate(it.sequence_id for it in items)
            if dup is not None:
                raise InvalidArgument(f"sequence {dup!r} appears more than once in one request")

    @staticmethod
    def _encode(request, reply, outputs: dict, errors: dict):
        resp = pb.VerifyResponse(forward_ms=reply.forward_ms, batch_sequences=reply.batch_sequences)
        results = resp.results
        for i, item in enumerate(request.items):
            r = results.add(sequence_id=item.sequence_id)
            out = outputs.get(i)
            exc = errors.get(i) if out is None else out.error
            if exc is not None:
                r.error.CopyFrom(item_error(exc))
                metrics().error(status_of(exc)[0])
                continue
            res = out.result
            r.committed_length = out.committed_length
            r.target_tokens.extend(res.target_tokens)
            if res.walk is not None:
                r.walk.CopyFrom(res.walk.to_proto())
            for toks, lps in res.top_logprobs:
                r.top_logprobs.add(tokens=toks, logprobs=lps)
        return resp

    @staticmethod
    def _record(reply: VerifyReply, t_start: float, t_handoff: float, t_back: float, t_end: float) -> None:
        """The request's metrics: what the batcher left to do (`reply.after`), and the call's time
        by stage (perf_counter readings: arrival, hand-off to the batcher, reply back, encoded)."""
        reply.after()
        timing = reply.timing
        m = metrics()
        m.call({
            "decode": (t_handoff - t_start) * 1e3,
            "queue": timing.queue,
            "forward": timing.forward,
            "engine": timing.engine,
            "handback": max(0.0, t_back - reply.done_at) * 1e3,
            "encode": (t_end - t_back) * 1e3,
            "total": (t_end - t_start) * 1e3,
        })
        if timing.inline:
            m.inline_calls.inc()

    # ---- the direct port (treeserve.h2grpc) -------------------------------------------------
    def direct_methods(self) -> dict[str, Method]:
        """Verify and VerifyStream as the direct port serves them: the same request path
        (`_verify`), with the port's call in place of gRPC's context."""
        return {f"/{SERVICE}/Verify": Method(self._direct_verify),
                f"/{SERVICE}/VerifyStream": Method(self._direct_verify, streaming=True)}

    def _direct_verify(self, message: bytes, call) -> bytes:
        try:
            if self._stopping is not None and self._stopping.is_set():
                raise Unavailable("the verifier is shutting down")
            response, record = self._verify(message, call)
        except Exception as exc:  # counted as _counted counts the gRPC port's failures
            metrics().error(status_of(exc)[0])
            raise
        call.add_callback(record)
        return response.SerializeToString()

    # ---- statistics ---------------------------------------------------------------------
    @grpc_errors
    def Stats(self, request, context):
        e = self._engine
        passes = e.forward_passes
        return pb.VerifierStats(
            model=self._info.name,
            vocab_size=self._vocab,
            eos_token_ids=self._info.eos_token_ids,
            max_sequences=self._limits.max_sequences,
            active_sequences=len(e.table),
            max_tree_nodes=self._limits.max_tree_nodes,
            max_sequence_length=self._limits.max_sequence_length,
            verified_nodes=e.verified_nodes,
            forward_passes=passes,
            mean_forward_ms=e.forward_ms_total / passes if passes else 0.0,
            device=self._info.device,
            direct_port=self.direct_port,
        )


def eos_ids(lm) -> tuple[int, ...]:
    """End-of-sequence ids from the config and the tokenizer, deduplicated, config first."""
    ids: list[int] = []
    cfg = getattr(lm.config, "eos_token_id", None)
    if isinstance(cfg, int):
        ids.append(cfg)
    elif cfg:
        ids.extend(int(t) for t in cfg)
    tok = getattr(lm, "tokenizer", None)
    if tok is not None and getattr(tok, "eos_token_id", None) is not None:
        ids.append(int(tok.eos_token_id))
    return tuple(dict.fromkeys(ids))


class VerifierServer:
    """A running Verifier: batcher (model thread) + gRPC server. `stop()` shuts both down."""

    def __init__(self, lm, limits: Limits, address: str, info: ModelInfo, auth_token: str | None = None,
                 grace_s: float = GRACE_SECONDS, direct_address: str | None = None,
                 direct_poll_s: float = POLL_SECONDS):
        """grace_s: how long a shutdown (SIGTERM/SIGINT in `wait`) lets calls in flight finish;
        direct_address: where to serve Verify and VerifyStream on the direct port as well
        (`treeserve.h2grpc`; None: not at all); direct_poll_s: how long its connections poll for
        the next request before they sleep (`DirectServer`)."""
        self.engine = Engine(lm, limits.validate())
        self.batcher = Batcher(self.engine, limits, device=info.device).start()
        # RPC threads run the model themselves when it is free: they keep inference mode on for
        # good instead of entering it for every forward (see batcher._model_mode)
        threads = rpc_threads(limits.max_sequences)
        self._pool = LifoExecutor(threads, name="verifier-rpc", prefer=self.batcher.is_runner,
                                  context=torch.inference_mode)
        self.server = Server(address, auth_token=auth_token, executor=self._pool, grace_s=grace_s)
        self.server.on_stopping(self.batcher.hurry)
        servicer = VerifierServicer(self.engine, self.batcher, info, max_streams=stream_cap(threads),
                                    stopping=self.server.stopping)
        self.servicer = servicer
        self.server.add(pbg.add_VerifierServicer_to_server, servicer, "Verifier", raw_methods=RAW_REQUEST_METHODS)
        self.direct: DirectServer | None = None
        if direct_address is not None:
            self.direct = DirectServer(direct_address, servicer.direct_methods(), auth_token=auth_token,
                                       thread_context=torch.inference_mode, poll_s=direct_poll_s).start()
            servicer.direct_port = self.direct.port
            direct = self.direct
            metrics().direct_connections.set_function(lambda: direct.connections)
        self.server.start()
        self.port = self.server.port
        self.direct_port = self.direct.port if self.direct is not None else None

    def wait(self) -> None:
        """Serve until SIGTERM/SIGINT."""
        self.server.wait()  # the direct port's streams end at their next message meanwhile
        if self.direct is not None:
            self.direct.stop(grace=1.0)
        self._close()

    def stop(self) -> None:
        if self.direct is not None:
            self.direct.stop(grace=1.0)
        self.server.stop(grace=1.0)
        self._close()

    def _close(self) -> None:
        self.batcher.stop()
        self._pool.shutdown(wait=False)
