"""The public Generation service: validate a request, hand it to the engines, stream its tokens.

Text lives here, tokens live in the engines: the servicer tokenises text prompts, detokenises
incrementally and applies stop strings (`output.OutputStream`); when a stop string ends a request
early it tells the engine to free the sequence. A client that disconnects (or whose deadline
passes) frees its sequence on the verifier and the drafter the same way.
"""
from __future__ import annotations

import logging
import math
import secrets
import time
import uuid
from dataclasses import dataclass

import grpc

from orchestrator.metrics import metrics
from orchestrator.output import OutputStream
from orchestrator.request import CANCELLED, EOS, LENGTH, RequestSpec, Speculation
from orchestrator.router import Router
from treeserve.errors import InvalidArgument, ServeError
from treeserve.sampling import Sampling
from treeserve.server import grpc_errors
from treeserve.v1 import treeserve_pb2 as pb
from treeserve.v1 import treeserve_pb2_grpc as pbg

log = logging.getLogger("treeserve.orchestrator.generation")

MAX_REQUEST_ID_BYTES = 96  # the verifier's sequence id adds "#<epoch>" and allows 128
MAX_STOPS = 16
MAX_STOP_CHARS = 256
_CODES = {c.value[0]: c for c in grpc.StatusCode}
_FINISH = {LENGTH: pb.FINISH_REASON_LENGTH, EOS: pb.FINISH_REASON_EOS, CANCELLED: pb.FINISH_REASON_CANCELLED}
_MODES = {pb.SPECULATION_MODE_OFF: "off", pb.SPECULATION_MODE_CHAIN: "chain", pb.SPECULATION_MODE_TREE: "tree"}


class StatusError(ServeError):
    """An error with any gRPC status code (e.g. one an engine reported)."""

    def __init__(self, code: int | grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code if isinstance(code, grpc.StatusCode) else _CODES.get(code, grpc.StatusCode.UNKNOWN)


@dataclass(frozen=True)
class FrontLimits:
    default_max_new_tokens: int = 256
    max_new_tokens: int = 4096


class GenerationServicer(pbg.GenerationServicer):
    def __init__(self, router: Router, tokenizer=None, limits: FrontLimits = FrontLimits(), poll_s: float = 0.5):
        self._router = router
        self._tok = tokenizer
        self._limits = limits
        self._poll = poll_s

    # ---- RPCs ---------------------------------------------------------------------------
    @grpc_errors
    def Generate(self, request, context):
        m = metrics()
        m.active.inc()
        try:
            yield from self._generate(request, context, m)
        except Exception as exc:
            m.requests.labels(outcome=getattr(exc, "code", grpc.StatusCode.INTERNAL).name).inc()
            raise
        finally:
            m.active.dec()

    def _generate(self, request, context, m):
        t0 = time.perf_counter()
        spec, stream = self._parse(request)
        inbox, error = self._router.submit(spec)
        if error is not None:
            raise StatusError(*error)
        rid = spec.request_id
        state = {"open": True}

        def on_done():  # the RPC ended: normal end, client cancel, disconnect or deadline
            if state["open"]:
                state["open"] = False
                self._router.cancel(rid, "client went away")

        context.add_callback(on_done)
        sent = 0
        try:
            while True:
                ev = inbox.get(self._poll)
                if ev is None:
                    if not context.is_active():
                        return
                    continue
                if ev.error is not None:
                    state["open"] = False
                    raise StatusError(*ev.error)
                chunk = stream.push(ev.tokens)
                finish = _FINISH.get(ev.finish, pb.FINISH_REASON_UNSPECIFIED)
                if chunk.stopped:
                    finish = pb.FINISH_REASON_STOP
                    self._router.cancel(rid, "stop string")
                elif ev.finish is not None:
                    tail = stream.finish()
                    chunk.token_ids += tail.token_ids
                    chunk.text += tail.text
                if chunk.token_ids and not sent:
                    m.first_token.observe(time.perf_counter() - t0)
                sent += len(chunk.token_ids)
                msg = pb.GenerateResponse(request_id=rid, token_ids=chunk.token_ids, text=chunk.text,
                                          step=pb.StepStats(tree_nodes=ev.tree_nodes, accepted_tokens=len(ev.tokens),
                                                            step_ms=ev.step_ms),
                                          finish_reason=finish)
                if finish != pb.FINISH_REASON_UNSPECIFIED:
                    state["open"] = False
                    msg.generated_tokens = sent
                    msg.target_forwards = ev.forwards
                    msg.mean_accepted = sent / ev.forwards if ev.forwards else 0.0
                    m.requests.labels(outcome=pb.FinishReason.Name(finish).removeprefix("FINISH_REASON_")).inc()
                    m.tokens.inc(sent)
                    m.forwards.inc(ev.forwards)
                    if ev.forwards:
                        m.tau.observe(msg.mean_accepted)
                    yield msg
                    return
                yield msg
        finally:
            self._router.forget(rid)

    @grpc_errors
    def Cancel(self, request, context):
        if not request.request_id:
            raise InvalidArgument("request_id is empty")
        return pb.CancelResponse(cancelled=self._router.cancel(request.request_id, "cancelled by the client"))

    # ---- validation ---------------------------------------------------------------------
    def _parse(self, request) -> tuple[RequestSpec, OutputStream]:
        rid = request.request_id or uuid.uuid4().hex
        if len(rid.encode()) > MAX_REQUEST_ID_BYTES:
            raise InvalidArgument(f"request_id is longer than {MAX_REQUEST_ID_BYTES} bytes")
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidArgument("prompt is missing: set text or tokens")
        if which == "text":
            if not request.text:
                raise InvalidArgument("prompt text is empty")
            if self._tok is None:
                raise InvalidArgument("this server has no tokenizer: send the prompt as token ids")
            prompt = tuple(int(t) for t in self._tok(request.text)["input_ids"])
            if not prompt:
                raise InvalidArgument("prompt text encodes to no tokens")
        else:
            prompt = tuple(request.tokens.ids)
            if not prompt:
                raise InvalidArgument("prompt token list is empty")
        s = request.sampling
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(s, name)):
                raise InvalidArgument(f"sampling.{name} must be finite")
        try:
            sampling = Sampling.from_proto(s)
        except ValueError as exc:
            raise InvalidArgument(f"sampling: {exc}") from exc
        if not sampling.greedy and sampling.seed == 0:
            sampling = Sampling(sampling.temperature, sampling.top_k, sampling.top_p, secrets.randbits(63) or 1)
        max_new = request.max_new_tokens or self._limits.default_max_new_tokens
        if not 1 <= max_new <= self._limits.max_new_tokens:
            raise InvalidArgument(f"max_new_tokens must be in [1, {self._limits.max_new_tokens}], got {request.max_new_tokens}")
        stops = list(request.stop)
        if len(stops) > MAX_STOPS:
            raise InvalidArgument(f"at most {MAX_STOPS} stop strings")
        if any(not st or len(st) > MAX_STOP_CHARS for st in stops):
            raise InvalidArgument(f"stop strings must be non-empty and at most {MAX_STOP_CHARS} characters")
        if stops and self._tok is None:
            raise InvalidArgument("stop strings need a tokenizer, and this server has none")
        spec = RequestSpec(rid, prompt, sampling, max_new, parse_speculation(request.speculation), self._router.front)
        return spec, OutputStream(self._tok, stops, context=prompt)


def parse_speculation(msg) -> Speculation:
    if msg.mode == pb.SPECULATION_MODE_UNSPECIFIED:
        mode, adaptive = "tree", True
    elif msg.mode in _MODES:
        mode, adaptive = _MODES[msg.mode], bool(msg.adaptive)
    else:
        raise InvalidArgument(f"unknown speculation mode {msg.mode}")
    d = msg.draft
    if d.shape not in pb.TreeShape.values():
        raise InvalidArgument(f"unknown tree shape {d.shape}")
    if d.node_budget < 0 or d.max_depth < 0:
        raise InvalidArgument("node_budget and max_depth must be >= 0")
    if mode == "chain" and d.shape not in (pb.TREE_SHAPE_UNSPECIFIED, pb.TREE_SHAPE_CHAIN):
        raise InvalidArgument("speculation mode CHAIN takes no other tree shape")
    return Speculation(mode, int(d.shape), int(d.node_budget), int(d.max_depth), bool(d.draft_ahead), adaptive)
