"""The public Generation servicer against a stand-in router (no Ray, no model): when it cancels a
request, when it lets the client hear the end, and how many streams it serves at once.

The stand-in router hands out real `router.Inbox`es; the test plays the engines by delivering
events into them."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from orchestrator import generation
from orchestrator.client import GenerationClient, request
from orchestrator.generation import FrontLimits, GenerationServicer
from orchestrator.request import CANCELLED, LENGTH, Event
from orchestrator.router import Inbox
from tests.orchestrator.stack import wait_until
from treeserve.server import Server
from treeserve.v1 import treeserve_pb2 as pb
from treeserve.v1 import treeserve_pb2_grpc as pbg


class StandInRouter:
    """Records what the servicer asks of the engines. `on_cancel(request_id, reason)` plays the
    engine's answer to a cancel."""

    front = "front"

    def __init__(self, on_cancel=None):
        self.inboxes: dict[str, Inbox] = {}
        self.cancels: list[tuple[str, str]] = []
        self.admissions: dict[str, str] = {}
        self._on_cancel = on_cancel

    def submit(self, spec):
        inbox = self.inboxes[spec.request_id] = Inbox(spec.request_id)
        self.admissions[spec.request_id] = spec.admission
        return inbox, None

    def cancel(self, request_id: str, reason: str = "cancelled", admission: str = "") -> bool:
        self.cancels.append((request_id, reason))
        if self._on_cancel is not None:
            self._on_cancel(request_id, reason)
        return True

    def cancel_soon(self, request_id: str, reason: str, admission: str) -> None:
        assert admission == self.admissions[request_id]  # that request's, not whichever holds the id
        self.cancel(request_id, reason, admission)

    def forget(self, inbox: Inbox) -> None:
        if self.inboxes.get(inbox.request_id) is inbox:
            del self.inboxes[inbox.request_id]

    def deliver_when_submitted(self, request_id: str, *events: Event) -> None:
        """From another thread, as an engine would: `events` into the request's inbox once the
        stream has submitted it (a servicer's generator runs only when first iterated)."""
        def deliver():
            deadline = time.monotonic() + 30
            while request_id not in self.inboxes and time.monotonic() < deadline:
                time.sleep(0.01)
            for event in events:
                self.inboxes[request_id].deliver(event)

        threading.Thread(target=deliver, daemon=True).start()


class Context:
    """A servicer context: `ended` is an RPC that was over before the handler registered its
    callback (the client left during the submission), as gRPC reports it."""

    def __init__(self, ended: bool = False):
        self.ended = ended
        self.callbacks: list = []

    def add_callback(self, callback) -> bool:
        if self.ended:
            return False
        self.callbacks.append(callback)
        return True

    def is_active(self) -> bool:
        return not self.ended

    def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")

    def rpc_ends(self) -> None:
        """What gRPC does when the RPC ends: run the callbacks."""
        self.ended = True
        for callback in self.callbacks:
            callback()


def generate(servicer, rid: str, context, **kw):
    return servicer.Generate(request([1, 2, 3], max_new_tokens=8, request_id=rid, **kw), context)


def test_a_client_that_left_during_the_submission_is_cancelled():
    """gRPC runs no callback added after the RPC ended (add_callback says False): the request is
    cancelled at once instead of running to max_new_tokens."""
    router = StandInRouter()
    assert list(generate(GenerationServicer(router, poll_s=0.05), "gone", Context(ended=True))) == []
    assert router.cancels == [("gone", "client went away")]
    assert router.inboxes == {}


def test_a_stream_closed_mid_way_is_cancelled_once():
    router = StandInRouter()
    context = Context()
    stream = generate(GenerationServicer(router, poll_s=0.05), "mid", context)
    router.deliver_when_submitted("mid", Event("mid", 0, tokens=(7, 8)))
    assert list(next(stream).token_ids) == [7, 8]
    stream.close()  # the generator is abandoned at a yield (GeneratorExit): its `finally` cancels
    context.rpc_ends()  # and gRPC's callback after it does not cancel again
    assert router.cancels == [("mid", "client went away")]
    assert router.inboxes == {}


def test_a_finished_request_is_not_cancelled():
    router = StandInRouter()
    context = Context()
    stream = generate(GenerationServicer(router, poll_s=0.05), "done", context)
    router.deliver_when_submitted("done", Event("done", 0, tokens=(7,), forwards=1),
                                  Event("done", 1, tokens=(8,), forwards=2, finish=LENGTH))
    msgs = list(stream)
    context.rpc_ends()
    assert [list(m.token_ids) for m in msgs] == [[7], [8]]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_LENGTH and msgs[-1].generated_tokens == 2
    assert router.cancels == [] and router.inboxes == {}


@pytest.fixture(scope="module")
def tokenizer(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0])


def stop_case(tokenizer):
    """Token ids of a text, and a stop string in its middle."""
    text = "x = 1\ny = 2\nz = 3\n"
    return tuple(tokenizer(text)["input_ids"]), "y ="


def test_stop_is_sent_once_the_engine_ended_the_request(tokenizer):
    """After a stop string the front cancels the request and sends FINISH_REASON_STOP only once
    the engine's own last event arrived (the engine publishes it once the coordinator forgot the
    id), with the request's inbox already dropped: the client may reuse the id at once."""
    ids, stop = stop_case(tokenizer)
    ended = threading.Event()

    def engine_ends(request_id, reason):  # the engine takes a moment to process the cancel
        def end():
            ended.set()
            router.inboxes[request_id].deliver(Event(request_id, 2, forwards=2, finish=CANCELLED))

        threading.Timer(0.3, end).start()

    router = StandInRouter(on_cancel=engine_ends)
    servicer = GenerationServicer(router, tokenizer, poll_s=0.05)
    stream = servicer.Generate(request("x", max_new_tokens=8, request_id="stops", stop=[stop]), Context())
    router.deliver_when_submitted("stops", Event("stops", 0, tokens=ids[:2], forwards=1),
                                  Event("stops", 1, tokens=ids[2:], forwards=2))
    msgs = []
    for msg in stream:
        if msg.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            assert ended.is_set(), "STOP sent before the engine ended the request"
            assert "stops" not in router.inboxes, "STOP sent while the id was still live at the front"
        msgs.append(msg)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
    assert "".join(m.text for m in msgs) == "x = 1\n"
    assert router.cancels == [("stops", "stop string")]


def test_stop_waits_for_the_engine_only_so_long(tokenizer, monkeypatch):
    monkeypatch.setattr(generation, "STOP_WAIT_S", 0.3)
    ids, stop = stop_case(tokenizer)
    router = StandInRouter()  # an engine that never answers the cancel
    stream = GenerationServicer(router, tokenizer, poll_s=0.05).Generate(
        request("x", max_new_tokens=8, request_id="silent", stop=[stop]), Context())
    router.deliver_when_submitted("silent", Event("silent", 0, tokens=ids, forwards=1))
    t0 = time.monotonic()
    msgs = list(stream)
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP
    assert 0.3 <= time.monotonic() - t0 < 5


def test_streams_beyond_the_cap_are_refused_and_cancel_still_answers(monkeypatch):
    """Every open stream holds a server worker. With a cap of two streams and one worker more,
    two endless streams leave the third worker free: a third Generate is refused with
    RESOURCE_EXHAUSTED at once, and Cancel answers (without the cap the third stream would take
    that worker too and Cancel would wait for one)."""
    monkeypatch.setattr(generation, "UNARY_WORKERS", 1)
    limits = FrontLimits(max_streams=2)
    assert limits.worker_count() == 3
    router = StandInRouter()
    server = Server("127.0.0.1:0", max_workers=limits.worker_count())
    server.add(pbg.add_GenerationServicer_to_server, GenerationServicer(router, limits=limits, poll_s=0.05),
               "Generation").start()
    client = GenerationClient(f"127.0.0.1:{server.port}")
    streams = [client.stream(request([1, 2, 3], max_new_tokens=8, request_id=f"s{i}"), timeout=60) for i in range(2)]
    try:
        for s in streams:
            threading.Thread(target=_consume, args=(s,), daemon=True).start()
        wait_until(lambda: len(router.inboxes) == 2, 15, "two live streams")
        for i in range(3):
            with pytest.raises(grpc.RpcError) as refused:
                list(client.stream(request([1, 2, 3], max_new_tokens=8, request_id=f"more{i}"), timeout=30))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value.details()
        t0 = time.monotonic()
        assert client.stub.Cancel(pb.CancelRequest(request_id="s0"), timeout=30).cancelled
        assert time.monotonic() - t0 < 4  # not after a stream's worker came free (minutes)
        # a stream that ends gives its place back
        streams[0].cancel()
        wait_until(lambda: len(router.inboxes) == 1, 15, "the cancelled stream to end")
        third = client.stream(request([1, 2, 3], max_new_tokens=8, request_id="s2"), timeout=60)
        threading.Thread(target=_consume, args=(third,), daemon=True).start()
        wait_until(lambda: "s2" in router.inboxes, 15, "a new stream in the freed place")
        streams.append(third)
    finally:
        for s in streams:
            s.cancel()
        client.close()
        server.stop(grace=0)


def _consume(stream) -> None:
    try:
        for _ in stream:
            pass
    except grpc.RpcError:
        pass


def test_the_command_line_caps_streams_as_the_front_does_unless_told():
    import argparse

    from orchestrator.cli_orchestrator import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--verifier", "v:1"]).max_streams == FrontLimits().max_streams
    assert p.parse_args(["--verifier", "v:1", "--max-streams", "8"]).max_streams == 8
    with pytest.raises(SystemExit):
        p.parse_args(["--verifier", "v:1", "--max-streams", "0"])


def test_an_orchestrator_whose_verifier_does_not_answer_says_so_in_one_line():
    import subprocess
    import sys

    from orchestrator.procs import free_port

    nobody = f"127.0.0.1:{free_port()}"
    r = subprocess.run([sys.executable, "-m", "treeserve.cli", "orchestrator", "--verifier", nobody, "--port", "0",
                        "--connect-timeout-s", "2"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 1
    assert (f"treeserve orchestrator: verifier {nobody} could not be registered: "
            f"orchestrator.engine.VerifierUnreachable: verifier {nobody} did not answer within 2 s") in r.stderr


def test_generate_reads_token_ids_or_refuses_them_in_one_line(capsys):
    import argparse

    from orchestrator.cli_generate import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--tokens", "1 22 3"]).tokens == [1, 22, 3]
    for bad in ("1 x", "", "-4"):
        with pytest.raises(SystemExit):
            p.parse_args(["--tokens", bad])
        assert "token ids" in capsys.readouterr().err


class ByteTokenizer:
    """Ids are byte strings: 1 'a', 2 a newline, 3 a newline and the first byte of a two-byte
    character (so its text waits for the rest of that character)."""

    pieces = {1: b"a", 2: b"\n", 3: b"\n\xc3"}

    def decode(self, ids, **kw):
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


def test_a_stop_string_found_only_when_the_text_is_flushed_is_a_stop():
    """The request ends at its length on a step whose text completes the stop string "\\n\\n" and
    ends inside a character: only the final flush sees the stop, and the client is told STOP."""
    router = StandInRouter()
    context = Context()
    stream = generate(GenerationServicer(router, ByteTokenizer(), poll_s=0.05), "flush", context, stop=["\n\n"])
    router.deliver_when_submitted("flush", Event("flush", 0, tokens=(1, 2, 3), forwards=1, finish=LENGTH))
    msgs = list(stream)
    assert "".join(m.text for m in msgs) == "a"
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP


def test_the_request_helper_takes_one_stop_string_and_refuses_bytes():
    assert list(request("hi", stop="END").stop) == ["END"]
    assert list(request("hi", stop=["a", "b"]).stop) == ["a", "b"]
    with pytest.raises(TypeError, match="not bytes"):
        request(b"abc")


class CountingTokenizer:
    """One token per character; counts the texts it was given."""

    def __init__(self):
        self.calls = 0

    def __call__(self, text):
        self.calls += 1
        return {"input_ids": [ord(c) % 200 for c in text]}

    def decode(self, ids, **kw):
        return "".join(chr(i) for i in ids)


def test_a_prompt_longer_than_the_front_takes_is_refused_before_it_goes_anywhere():
    """Over max_prompt_tokens (as ids, or once tokenised), or a text over PROMPT_CHARS_PER_TOKEN
    characters per such token (not even tokenised): INVALID_ARGUMENT, and nothing is submitted."""
    from orchestrator.generation import PROMPT_CHARS_PER_TOKEN

    router, tokenizer = StandInRouter(), CountingTokenizer()
    server = Server("127.0.0.1:0")
    server.add(pbg.add_GenerationServicer_to_server,
               GenerationServicer(router, tokenizer, limits=FrontLimits(max_prompt_tokens=4), poll_s=0.05),
               "Generation").start()
    client = GenerationClient(f"127.0.0.1:{server.port}")
    try:
        for prompt in ([1, 2, 3, 4, 5], "abcde", "x" * (4 * PROMPT_CHARS_PER_TOKEN + 1)):
            with pytest.raises(grpc.RpcError) as refused:
                client.generate(request(prompt, max_new_tokens=2), timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        assert tokenizer.calls == 1 and router.inboxes == {} and router.admissions == {}
        stream = client.stream(request([1, 2, 3, 4], max_new_tokens=2, request_id="fits"), timeout=30)
        threading.Thread(target=_consume, args=(stream,), daemon=True).start()
        wait_until(lambda: "fits" in router.admissions, 15, "the request that fits")
        stream.cancel()
    finally:
        client.close()
        server.stop(grace=0)
