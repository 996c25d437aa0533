"""The orchestrator's drafter link: an EndSequence that cannot reach the drafter is kept (a bounded
queue) and sent once the link is back, unless the id was opened again meanwhile; a drafter that
refuses the stream is not reconnected to in a tight loop."""
import contextlib
import threading
import time

import pytest

from drafter_service.client import DrafterClient
from drafter_service.engine import Drafter
from drafter_service.servicer import DrafterServicer, serve
from orchestrator.draft_link import DraftLink, PendingEnds, Want
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



# ---- the stream on the drafter's direct port ------------------------------------------------------
REPEAT = [7, 8, 9] * 6  # n-gram drafting continues a repeating text
WAIT_S = 30.0  # an upper bound for waits that should end at once


class SlowDrafts:
    """The drafter's `draft`, held back by `delay` seconds while that is set (a lagging drafter)."""

    def __init__(self, drafter: Drafter):
        self.inner = drafter.draft
        self.delay = 0.0
        drafter.draft = self

    def __call__(self, call):
        if self.delay:
            time.sleep(self.delay)
        return self.inner(call)


@contextlib.contextmanager
def ngram_link(server):
    """A link to `server` drafting n-gram trees for one sequence "s" whose log starts as REPEAT:
    yields (link, log) once the sequence is started; shut down after."""
    log = {"s": list(REPEAT)}
    link = DraftLink(f"127.0.0.1:{server.port}", lambda sid: log[sid][:-1] if sid in log else None,
                     vocab_size=1000, max_tree_nodes=16, call_timeout=5.0)
    try:
        link.open("s", pb.SamplingParams(), pb.DraftOptions(shape=pb.TREE_SHAPE_NGRAM, node_budget=8, max_depth=4))
        wait_until(lambda: link.up and link._seqs["s"].state == "ready", what="the sequence started")
        yield link, log
    finally:
        link.shutdown()


@pytest.fixture
def direct(drafter):
    server = serve(drafter, "127.0.0.1:0", direct_address="127.0.0.1:0")
    try:
        with ngram_link(server) as (link, log):
            yield server, link, log
    finally:
        server.stop(grace=0)


def draft_step(link: DraftLink, log: dict, timeout: float = 5.0):
    """Ask for the tree after the log's last token and wait for it: (asked, tree or None)."""
    n = len(log["s"])
    asked = link.request("s", Want(n - 1, log["s"][-1], 8), None)
    got = link.take({"s": n - 1}, timeout) if asked else {}
    return asked, got["s"][0] if "s" in got else None


def test_the_link_drafts_over_the_direct_port(drafter, direct):
    server, link, log = direct
    assert server.direct_port and link.speculate_address == f"127.0.0.1:{server.direct_port}"
    for _ in range(5):
        asked, tree = draft_step(link, log)
        assert asked and tree is not None
        root = log["s"][-1]
        assert tree.tokens[0] == root and tree.tokens[1] == REPEAT[(REPEAT.index(root) + 1) % 3]
        log["s"].append(REPEAT[len(log["s"]) % 3])
    assert link.stats.trees == 5 and link.stats.late == 0 and drafter.metrics.trees == 5


def test_a_late_answer_over_the_direct_port_is_dropped_and_drafting_resumes(drafter, direct):
    server, link, log = direct
    slow = SlowDrafts(drafter)
    slow.delay = 0.3
    asked, tree = draft_step(link, log, timeout=0.02)
    assert asked and tree is None and link.lagging and link.stats.late == 1
    log["s"].append(7)
    assert link.request("s", Want(len(log["s"]) - 1, 7, 8), None) is False  # one request in flight at a time
    slow.delay = 0.0
    log["s"].append(8)
    n = len(log["s"])
    # the late answer comes 0.3 s on: until it has, a request is refused (one in flight); the
    # first one made after it reads it first and drops it
    wait_until(lambda: link.request("s", Want(n - 1, 8, 8), None), 10, "the late answer")
    got = link.take({"s": n - 1}, 5.0)
    assert "s" in got and got["s"][0].tokens[0] == 8
    assert not link.lagging and link.stats.trees == 2  # the late tree was taken in, not used


def test_a_sequence_the_drafter_lost_is_restarted_over_the_direct_port(drafter, direct):
    server, link, log = direct
    assert draft_step(link, log)[1] is not None
    resyncs = link.stats.resyncs
    drafter.end("s")  # the drafter forgets it (an idle sweep would): its next answer is an error
    log["s"].append(7)
    asked, tree = draft_step(link, log, timeout=5.0)
    assert asked and tree is None
    wait_until(lambda: length_of(drafter, "s") == len(log["s"]) - 1, what="the sequence started again")
    wait_until(lambda: link._seqs["s"].state == "ready", what="the link in sync")
    log["s"].append(8)
    assert draft_step(link, log)[1] is not None
    assert link.stats.resyncs == resyncs + 1


def test_a_drafter_back_on_a_new_direct_port_is_found_again(drafter, direct):
    server, link, log = direct
    assert draft_step(link, log)[1] is not None
    address, old_direct = f"127.0.0.1:{server.port}", server.direct_port
    server.stop(grace=0)
    log["s"].append(7)
    draft_step(link, log, timeout=5.0)  # the write or the read finds the connection gone
    wait_until(lambda: not link.up, what="the link down")
    server = serve(drafter, address, direct_address="127.0.0.1:0")
    try:
        wait_until(lambda: link.up and link._seqs["s"].state == "ready", what="the link back")
        assert link.speculate_address == f"127.0.0.1:{server.direct_port}" != f"127.0.0.1:{old_direct}"
        log["s"].append(8)
        assert draft_step(link, log)[1] is not None
    finally:
        server.stop(grace=0)


def test_a_drafter_without_a_direct_port_gets_grpcs_stream(drafter):
    server = serve(drafter, "127.0.0.1:0")
    try:
        with ngram_link(server) as (link, log):
            assert link.speculate_address == f"127.0.0.1:{server.port}"
            assert draft_step(link, log)[1] is not None
    finally:
        server.stop(grace=0)


def test_an_answer_that_does_not_parse_takes_the_link_down_not_the_engine(drafter):
    """The third answer on the direct port is garbage: `take` and `request` do not raise, the link
    reconnects, and drafting resumes."""
    from drafter_service.servicer import SERVICE
    from treeserve.h2grpc.server import Method

    server = serve(drafter, "127.0.0.1:0", direct_address="127.0.0.1:0")
    path = f"/{SERVICE}/Speculate"
    answer, calls = server.direct.methods[path].handle, []

    def garbled(message, call):
        calls.append(1)
        return b"\xff\xff\xff" if len(calls) == 3 else answer(message, call)

    server.direct.methods[path] = Method(garbled, streaming=True)
    try:
        with ngram_link(server) as (link, log):
            for _ in range(2):
                assert draft_step(link, log)[1] is not None
                log["s"].append(REPEAT[len(log["s"]) % 3])
            assert draft_step(link, log) == (True, None)  # the garbage: no tree, no exception
            assert link.stats.reconnects == 1
            wait_until(lambda: link.stats.reconnects == 2 and link.up and link._seqs["s"].state == "ready",
                       what="the link back")
            log["s"].append(REPEAT[len(log["s"]) % 3])
            assert draft_step(link, log)[1] is not None
    finally:
        server.stop(grace=0)


def test_a_link_given_up_by_another_thread_wakes_a_take_at_once(drafter, direct):
    """The worker thread marks the link down while the engine's thread waits in `take` for a slow
    drafter: the wait ends then, not at its timeout."""
    import threading

    server, link, log = direct
    slow = SlowDrafts(drafter)
    slow.delay = 3.0
    n = len(log["s"])
    assert link.request("s", Want(n - 1, log["s"][-1], 8), None)

    def give_up():
        time.sleep(0.2)
        with link._cv:
            link._mark_down_locked()

    threading.Thread(target=give_up, daemon=True).start()
    t0 = time.monotonic()
    assert link.take({"s": n - 1}, 5.0) == {}
    assert time.monotonic() - t0 < 2.5  # woken at 0.2 s, not at the drafter's 3 s
    slow.delay = 0.0


def test_a_request_made_after_a_slow_restart_supersedes_the_one_wanted_during_it(drafter, direct):
    """A sequence asked for a tree while the drafter was starting it again, and by the time the
    start is done the engine has moved on: the newer request goes out, not the stale one."""
    server, link, log = direct
    assert draft_step(link, log)[1] is not None
    start = drafter.start
    started, go = [], threading.Event()

    def slow_start(*args, **kwargs):
        go.wait(WAIT_S)  # until the request below is in
        out = start(*args, **kwargs)
        started.append(1)
        return out

    drafter.start = slow_start
    resyncs = link.stats.resyncs
    link._work.put(("start", "s"))  # as after the drafter lost it
    wait_until(lambda: link._seqs["s"].state == "syncing", what="restarting")
    log["s"].append(7)
    assert link.request("s", Want(len(log["s"]) - 1, 7, 8), None)  # wanted once the start is done
    go.set()
    wait_until(lambda: started and link.stats.resyncs == resyncs + 1, what="the restart done")
    log["s"].append(8)
    asked, tree = draft_step(link, log)
    assert asked and tree is not None and tree.tokens[0] == 8


def test_a_direct_port_that_refuses_the_stream_is_left_for_grpcs(drafter):
    """The drafter advertises a direct port that does not serve Speculate (UNIMPLEMENTED): the link
    does not reconnect to it over and over, it takes grpcio's stream and drafts there."""
    from drafter_service.servicer import SERVICE

    server = serve(drafter, "127.0.0.1:0", direct_address="127.0.0.1:0")
    del server.direct.methods[f"/{SERVICE}/Speculate"]
    try:
        with ngram_link(server) as (link, log):
            assert link.speculate_address == f"127.0.0.1:{server.direct_port}"
            assert draft_step(link, log, timeout=5.0)[1] is None  # refused (as soon as it opened, or now)
            wait_until(lambda: link.up and link._seqs["s"].state == "ready", what="the link back")
            assert link.speculate_address == f"127.0.0.1:{server.port}"
            log["s"].append(REPEAT[len(log["s"]) % 3])
            assert draft_step(link, log)[1] is not None
            assert link.stats.reconnects == 2
    finally:
        server.stop(grace=0)


class OlderDrafter(DrafterServicer):
    """A drafter that predates per-tree shapes: its Stats do not say it honours them."""

    def Stats(self, request, context):
        stats = super().Stats(request, context)
        stats.per_tree_shapes = False
        return stats


@pytest.mark.parametrize("servicer, honours", [(DrafterServicer, True), (OlderDrafter, False)])
def test_the_link_learns_whether_the_drafter_honours_per_tree_shapes(drafter, servicer, honours):
    """The engine asks for trees of another shape only where the drafter honours them (an older one
    would draft its own shape, and the engine would price those trees as the shape it asked for)."""
    server = Server("127.0.0.1:0")
    server.add(pbg.add_DrafterServicer_to_server, servicer(drafter, max_streams=4), "Drafter").start()
    link = DraftLink(f"127.0.0.1:{server.port}", {"s": [1, 2, 3]}.get, vocab_size=1000, max_tree_nodes=16,
                     call_timeout=5.0)
    try:
        wait_until(lambda: link.up, what="the link up")
        assert link.per_tree_shapes is honours
        assert link.default_shape == pb.TREE_SHAPE_NGRAM  # an n-gram drafter's
    finally:
        link.shutdown()
        server.stop(grace=0)
