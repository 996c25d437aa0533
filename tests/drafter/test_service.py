"""The drafter as a separate process, driven through a real Speculate stream."""
import os
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from drafter_service.client import DraftOptions, DrafterClient
from treeserve.acceptance import Outcome
from treeserve.errors import Unavailable
from treeserve.sampling import Sampling
from treeserve.server import channel, client_requests

TOKEN = "sesame"


class Served:
    """A `treeserve drafter` subprocess on a free port."""

    def __init__(self, *args: str):
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "treeserve.cli", "drafter", "--port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        self.address = None
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if line.startswith("drafter listening on "):
                self.address = line.split()[-1]

    def wait_serving(self, timeout: float = 300.0) -> str:
        deadline = time.monotonic() + timeout
        while self.address is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("drafter did not start:\n" + "".join(self.lines))
            time.sleep(0.1)
        stub = health_pb2_grpc.HealthStub(channel(self.address))
        status = stub.Check(health_pb2.HealthCheckRequest(service="treeserve.v1.Drafter"), timeout=60).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        return self.address

    def stop(self):
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def servers(tiny_pair):
    # both start at once: their imports overlap
    ngram = Served("--ngram", "--auth-token", TOKEN)
    model = Served("--model", str(tiny_pair[1]), "--node-budget", "8", "--max-depth", "3", "--max-sequences", "4")
    try:
        yield {"ngram": ngram.wait_serving(), "model": model.wait_serving(), "ngram_proc": ngram}
    finally:
        ngram.stop()
        model.stop()


def test_ngram_service_stream(servers):
    with DrafterClient(servers["ngram"], auth_token=TOKEN) as client:
        tokens = [3, 4, 5, 6, 7, 8, 3, 4]
        assert client.start("n1", tokens, options=DraftOptions(node_budget=6, max_depth=4)) == 8
        with client.stream() as s:
            r = s.draft("n1", 8, root=5)
            assert r.error is None and list(r.tree.tokens[:4]) == [5, 6, 7, 8] and r.tree.size <= 6
            # several requests in flight on the one stream: answers in order, errors in place
            kid = r.tree.children(0)[0]
            good = dict(appended=[5, r.tree.tokens[kid]], outcome=Outcome((0, kid), 9))
            from drafter_service.client import draft_request

            s.submit(draft_request("ghost", 8, 5))
            s.submit(draft_request("n1", 99, 9, **good))
            s.submit(draft_request("n1", 10, 9, appended=good["appended"], outcome=Outcome((0, 77), 9)))
            s.submit(draft_request("n1", 10, 9, **good))
            codes = [x.error[0] if x.error else 0 for x in s.collect()]
            assert codes == [grpc.StatusCode.NOT_FOUND.value[0], grpc.StatusCode.FAILED_PRECONDITION.value[0],
                             grpc.StatusCode.INVALID_ARGUMENT.value[0], 0]
        assert client.end("n1") and not client.end("n1")
        stats = client.stats()
        assert stats.strategy == "ngram" and stats.trees == 2
    with DrafterClient(servers["ngram"]) as anonymous:
        with pytest.raises(grpc.RpcError) as info:
            anonymous.stats()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_model_service_stream(servers, prompt):
    with DrafterClient(servers["model"]) as client:
        L = len(prompt)
        client.start("m1", prompt, Sampling(0.8, 0, 0, 4), DraftOptions("dynamic", 8, 3, True))
        client.start("m2", prompt, options=DraftOptions("static", 13, 4, False))
        with client.stream() as s:
            a = s.draft("m1", L, root=prompt[-1])
            b = s.draft("m2", L, root=prompt[-1])
            assert a.error is None and b.error is None
            a.tree.validate(320, 8)
            b.tree.validate(320, 13)
            assert a.tree.draft is not None and b.tree.draft is None and b.tree.size == 13
            kid = a.tree.children(0)[0]
            nxt = s.draft("m1", L + 2, root=11, appended=[prompt[-1], a.tree.tokens[kid]],
                          outcome=Outcome((0, kid), 11))
            assert nxt.error is None and nxt.tree.tokens[0] == 11 and nxt.committed_length == L + 2
            stale = s.draft("m2", L + 5, root=1, appended=[prompt[-1]])
            assert stale.error[0] == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        stats = client.stats()
        assert stats.active_sequences == 2 and stats.trees == 3
        assert stats.draft_ahead_hits + stats.draft_ahead_misses == 1
        with pytest.raises(grpc.RpcError) as info:
            client.start("m3", prompt, options=DraftOptions("chain", -4))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_client_cancelling_its_stream_is_not_an_error(servers):
    """An orchestrator ends its Speculate stream by cancelling it (shutdown, reconnect): the
    drafter logs nothing for it and keeps serving."""
    served = servers["ngram_proc"]
    with DrafterClient(servers["ngram"], auth_token=TOKEN) as client:
        client.start("c1", [3, 4, 5, 3, 4], options=DraftOptions(node_budget=4, max_depth=2))
        s = client.stream()
        assert s.draft("c1", 5, root=5).error is None
        s._responses.cancel()
        time.sleep(1.0)  # the server sees the cancel at once; give it time to (not) log
        assert client.end("c1")
    assert not [line for line in served.lines if "Speculate failed" in line or "Traceback" in line], served.lines


def test_stream_requests_end_once_the_server_stops():
    """The request loop both servicers' streams share: requests pass through until the server's
    `stopping` event is set, then the next one ends the stream with UNAVAILABLE; a client's cancel
    ends it quietly."""
    stopping = threading.Event()
    seen = []
    with pytest.raises(Unavailable, match="shutting down"):
        for r in client_requests(iter([1, 2, 3]), stopping):
            seen.append(r)
            stopping.set()
    assert seen == [1]

    def cancelled():
        yield 1
        raise grpc.RpcError()

    assert list(client_requests(cancelled())) == [1]
