"""The orchestrator's drafter link: an EndSequence that cannot reach the drafter is kept (a bounded
queue) and sent once the link is back, unless the id was opened again meanwhile; a drafter that
refuses the stream is not reconnected to in a tight loop."""
import time

import pytest

from drafter_service.client import DrafterClient
from drafter_service.engine import Drafter
from drafter_service.servicer import DrafterServicer, serve
from orchestrator.draft_link import DraftLink, PendingEnds
from tests.orchestrator.stack import wait_until
from treeserve.server import Server
from treeserve.v1 import treeserve_pb2 as pb
from treeserve.v1 import treeserve_pb2_grpc as pbg


def length_of(drafter: Drafter, sid: str) -> int | None:
    """The drafter's committed length of `sid` (None while it has none, e.g. while it restarts)."""
    seq = drafter._seqs.get(sid)
    return None if seq is None else seq.state.length


def test_pending_ends_keep_the_newest_up_to_their_limit():
    ends = PendingEnds(limit=3)
    for sid in ("a", "b", "c", "a", "d"):  # "a" again: it moves to the back
        ends.add(sid)
    assert ends.dropped == 1 and "b" not in ends
    ends.discard("c")
    assert ends.take_all() == ["a", "d"]
    assert len(ends) == 0 and ends.dropped == 0


@pytest.fixture
def drafter():
    d = Drafter(None, idle_timeout_s=0)
    yield d
    d.close()


def test_an_end_sent_while_the_drafter_is_unreachable_goes_out_once_it_is_back(drafter):
    server = serve(drafter, "127.0.0.1:0")
    address = f"127.0.0.1:{server.port}"
    tokens = {"gone": [1, 2, 3], "back": [4, 5, 6]}
    link = DraftLink(address, tokens.get, vocab_size=1000, max_tree_nodes=16, call_timeout=5.0)
    options = pb.DraftOptions()
    try:
        link.open("gone", pb.SamplingParams(), options)
        link.open("back", pb.SamplingParams(), options)
        wait_until(lambda: drafter.active() == 2)
        server.stop(grace=0)  # the drafter is cut off, with both sequences
        wait_until(lambda: not link.up)
        link.close("gone")
        link.close("back")
        wait_until(lambda: "gone" in link._ends and "back" in link._ends)
        tokens["back"] = [4, 5, 6, 7]
        link.open("back", pb.SamplingParams(), options)  # opened again: its end must not follow
        assert "back" not in link._ends
        server = serve(drafter, address)  # back, on the same port, still holding both
        wait_until(lambda: link.up and "gone" not in drafter._seqs)
        wait_until(lambda: len(link._ends) == 0 and drafter.active() == 1)
        wait_until(lambda: length_of(drafter, "back") == 4)  # started again from its log, not ended
    finally:
        link.shutdown()
        server.stop(grace=0)


def test_a_drafter_that_refuses_the_stream_is_retried_with_a_growing_delay(drafter):
    """Its unary calls answer but its one stream is taken: each reconnect restarts every sequence,
    so they must back off (0.1, 0.2, 0.4... s) instead of looping at once."""
    server = Server("127.0.0.1:0")
    server.add(pbg.add_DrafterServicer_to_server, DrafterServicer(drafter, max_streams=1), "Drafter").start()
    address = f"127.0.0.1:{server.port}"
    client = DrafterClient(address, timeout=5)
    held = client.stream()
    assert held.draft("ghost", 1, 1).error is not None  # answered: the one stream is held
    link = DraftLink(address, {"s": [1, 2, 3]}.get, vocab_size=1000, max_tree_nodes=16, call_timeout=5.0)
    try:
        link.open("s", pb.SamplingParams(), pb.DraftOptions())
        t0 = time.monotonic()
        wait_until(lambda: link.stats.reconnects >= 4, what="four connects")
        # no stream has answered: the wait before the next connect has doubled on each (0.1 ... 0.8)
        assert link._reconnect_delay >= 0.8 and time.monotonic() - t0 >= 0.1 + 0.2 + 0.4
    finally:
        link.shutdown()
        held.close()
        client.close()
        server.stop(grace=0)

