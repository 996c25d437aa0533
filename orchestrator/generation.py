"""The public Generation service: validate a request, hand it to the engines, stream its tokens.

Text lives here, tokens live in the engines: the servicer tokenises text prompts, detokenises
incrementally and applies stop strings (`output.OutputStream`); when a stop string ends a request
early it tells the engine to free the sequence, and sends FINISH_REASON_STOP once the engine has
ended it (bounded by STOP_WAIT_S), so the client may reuse the request id at once. A client that
disconnects (or whose deadline passes), at any moment after the submission, frees its sequence on
the verifier and the drafter the same way.

Each open Generate stream holds one of the server's worker threads for its whole life, so the
servicer takes at most `FrontLimits.max_streams` of them and refuses more with RESOURCE_EXHAUSTED;
the server has UNARY_WORKERS more (`worker_count`), which keep Cancel, health checks and
reflection answering when every stream is taken.
"""
from __future__ import annotations

import logging
import math
import secrets
import threading
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
from treeserve.server import StreamCap, grpc_errors
from treeserve.v1 import treeserve_pb2 as pb
from treeserve.v1 import treeserve_pb2_grpc as pbg

log = logging.getLogger("treeserve.orchestrator.generation")

MAX_REQUEST_ID_BYTES = 96  # the verifier's sequence id adds "#<admission>.<epoch>" (8 + 2 + digits) and allows 128
MAX_STOPS = 16
MAX_STOP_CHARS = 256
PROMPT_CHARS_PER_TOKEN = 16  # a text prompt longer than this many characters per allowed token is refused untokenised
STOP_WAIT_S = 5.0  # longest wait, after a stop string, for the engine to end the request
UNARY_WORKERS = 16  # server workers beyond max_streams: Cancel, health and reflection never queue behind streams
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
    max_streams: int = 240  # open Generate streams; more are refused with RESOURCE_EXHAUSTED
    # Longer prompts are refused here, before they are tokenised and sent through Ray (a replica
    # refuses what does not fit its max_sequence_length later, at no cost to the front); a text
    # prompt may have PROMPT_CHARS_PER_TOKEN characters per token at most
    max_prompt_tokens: int = 32768

    def __post_init__(self):
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be at least 1, got {self.max_streams}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be at least 1, got {self.max_prompt_tokens}")
        if not 1 <= self.default_max_new_tokens <= self.max_new_tokens:
            # else every request that names no max_new_tokens would be refused
            raise ValueError(f"default_max_new_tokens ({self.default_max_new_tokens}) must be in [1, max_new_tokens "
                             f"({self.max_new_tokens})]")

    def worker_count(self) -> int:
        """Server worker threads: one per stream, plus UNARY_WORKERS for everything else."""
        return self.max_streams + UNARY_WORKERS


class _Cancellation:
    """Cancels a request on the services at most once, and not once it has ended. Called from the
    RPC's done-callback (gRPC's polling thread: the cancel must not wait there, `cancel_soon`) and
    from the handler, hence the lock. Only this request: not a newer one that reuses its id."""

    def __init__(self, router: Router, spec: RequestSpec):
        self._router = router
        self._request_id = spec.request_id
        self._admission = spec.admission
        self._lock = threading.Lock()
        self._settled = False

    def ended(self) -> None:
        """The request's last event arrived: nothing is left to cancel."""
        with self._lock:
            self._settled = True

    def __call__(self, reason: str = "client went away") -> None:
        with self._lock:
            if self._settled:
                return
            self._settled = True
        self._router.cancel_soon(self._request_id, reason, self._admission)


class GenerationServicer(pbg.GenerationServicer):
    def __init__(self, router: Router, tokenizer=None, limits: FrontLimits = FrontLimits(), poll_s: float = 0.5):
        self._router = router
        self._tok = tokenizer
        self._limits = limits
        self._poll = poll_s
        self._streams = StreamCap(limits.max_streams, "Generate streams", "retry later, or on another front")

    # ---- RPCs ---------------------------------------------------------------------------
    @grpc_errors
    def Generate(self, request, context):
        m = metrics()
        try:
            with self._streams.held():
                m.active.inc()
                try:
                    yield from self._generate(request, context, m)
                finally:
                    m.active.dec()
        except Exception as exc:
            m.requests.labels(outcome=getattr(exc, "code", grpc.StatusCode.INTERNAL).name).inc()
            raise

    def _generate(self, request, context, m):
        t0 = time.perf_counter()
        spec, stream = self._parse(request)
        inbox, error = self._router.submit(spec)
        if error is not None:
            raise StatusError(*error)
        cancel = _Cancellation(self._router, spec)
        try:
            # the RPC ends (normal end, client cancel, disconnect or deadline): cancel unless it ended
            if not context.add_callback(cancel):
                cancel()  # it ended while the request was being submitted: the callback will never run
                return
            yield from self._relay(inbox, stream, cancel, context, m, t0)
        finally:
            cancel()  # every exit before the request's end (the client left, an error here) frees it
            self._router.forget(inbox)

    def _relay(self, inbox, stream: OutputStream, cancel: _Cancellation, context, m, t0: float):
        """The request's events as response messages, until its last one or until the client leaves."""
        rid = inbox.request_id
        sent = 0
        while True:
            ev = inbox.get(self._poll)
            if ev is None:
                if not context.is_active():
                    return
                continue
            if ev.error is not None:
                cancel.ended()
                raise StatusError(*ev.error)
            chunk = stream.push(ev.tokens)
            finish = _FINISH.get(ev.finish, pb.FINISH_REASON_UNSPECIFIED)
            if chunk.stopped:
                finish = pb.FINISH_REASON_STOP
                if not ev.last:  # the engine is still running it
                    cancel("stop string")
                    self._await_end(inbox)
            elif ev.finish is not None:
                tail = stream.finish()
                chunk.token_ids += tail.token_ids
                chunk.text += tail.text
                if tail.stopped:  # the stop string's last characters waited for the rest of a character
                    finish = pb.FINISH_REASON_STOP
            if chunk.token_ids and not sent:
                m.first_token.observe(time.perf_counter() - t0)
            sent += len(chunk.token_ids)
            msg = pb.GenerateResponse(request_id=rid, token_ids=chunk.token_ids, text=chunk.text,
                                      step=pb.StepStats(tree_nodes=ev.tree_nodes, accepted_tokens=len(ev.tokens),
                                                        step_ms=ev.step_ms),
                                      finish_reason=finish)
            if finish == pb.FINISH_REASON_UNSPECIFIED:
                yield msg
                continue
            cancel.ended()
            _add_totals(msg, sent, ev.forwards, m)
            self._router.forget(inbox)  # before the client hears the end: it may reuse the id at once
            yield msg
            return

    def _await_end(self, inbox) -> None:
        """After a stop string: wait (at most STOP_WAIT_S) for the engine's own last event of the
        request, the cancel's or a finish that crossed it. The engine publishes it only once the
        coordinator has forgotten the id (`engine.Endings`), so a client that gets
        FINISH_REASON_STOP can reuse the id at once; and the coordinator's record stays the
        engine's, cleared when the slot is free, so its load count stays right. Tokens in between
        are past the stop and dropped."""
        deadline = time.monotonic() + STOP_WAIT_S
        while (left := deadline - time.monotonic()) > 0:
            ev = inbox.get(min(left, self._poll))
            if ev is not None and ev.last:
                return
        log.warning("request %s: no end from its engine %.0f s after its stop string", inbox.request_id, STOP_WAIT_S)

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
            most = PROMPT_CHARS_PER_TOKEN * self._limits.max_prompt_tokens
            if len(request.text) > most:
                raise InvalidArgument(f"prompt text is longer than {most} characters ({PROMPT_CHARS_PER_TOKEN} per "
                                      f"token of the {self._limits.max_prompt_tokens} this server takes)")
            prompt = tuple(int(t) for t in self._tok(request.text)["input_ids"])
            if not prompt:
                raise InvalidArgument("prompt text encodes to no tokens")
        else:
            prompt = tuple(request.tokens.ids)
            if not prompt:
                raise InvalidArgument("prompt token list is empty")
        if len(prompt) > self._limits.max_prompt_tokens:
            raise InvalidArgument(f"the prompt has {len(prompt)} tokens; this server takes at most "
                                  f"{self._limits.max_prompt_tokens}")
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


def _add_totals(msg, sent: int, forwards: int, m) -> None:
    """The last message's totals, and the finished request's metrics."""
    msg.generated_tokens = sent
    msg.target_forwards = forwards
    msg.mean_accepted = sent / forwards if forwards else 0.0
    m.requests.labels(outcome=pb.FinishReason.Name(msg.finish_reason).removeprefix("FINISH_REASON_")).inc()
    m.tokens.inc(sent)
    m.forwards.inc(forwards)
    if forwards:
        m.tau.observe(msg.mean_accepted)


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
