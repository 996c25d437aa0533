"""The engine's outbox: at-least-once batches (a lost answer is sent again until acknowledged),
and fronts that stopped draining dropped with their events."""
from orchestrator.engine import READING_S, Outbox
from orchestrator.request import Event


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def ev(seq: int) -> Event:
    return Event("r", seq, tokens=(seq,))


def test_a_batch_comes_again_until_it_is_acknowledged():
    box = Outbox()
    box.put("f", [ev(0), ev(1)])
    first, events = box.drain("f", 0.0, ack=0)
    assert [e.seq for e in events] == [0, 1] and first != 0
    box.put("f", [ev(2)])
    lost, events = box.drain("f", 0.0, ack=0)  # the answer above never arrived: no ack for it
    assert [e.seq for e in events] == [0, 1, 2] and lost != first
    box.put("f", [ev(3)])
    batch, events = box.drain("f", 0.0, ack=lost)
    assert [e.seq for e in events] == [3]
    assert box.drain("f", 0.0, ack=batch) == (batch, [])  # all acknowledged: nothing, the ack stands
    assert box.drain("f", 0.0, ack=batch) == (batch, [])


def test_fronts_are_apart_and_a_reader_in_process_acknowledges_nothing():
    box = Outbox()
    box.put("a", [ev(0)])
    box.put("b", [ev(5)])
    assert [e.seq for e in box.drain("a", 0.0)[1]] == [0]
    assert box.drain("a", 0.0) == (0, [])  # ack None: nothing kept to send again
    assert [e.seq for e in box.drain("b", 0.0, ack=0)[1]] == [5]


def test_a_front_that_stops_draining_is_dropped_with_its_events():
    clock = Clock()
    box = Outbox(silent_s=60.0, clock=clock)
    box.put("gone", [ev(0)])  # never drained: its time runs from its first events
    box.put("live", [ev(0)])
    clock.now += 30
    box.drain("live", 0.0, ack=0)  # taken, not yet acknowledged
    assert box.drop_silent() == []
    clock.now += 31
    box.put("live", [ev(1)])
    assert box.drop_silent() == ["gone"]
    box.put("gone", [ev(1)])  # dropped: nobody would take it
    assert box.drop_silent() == []
    clock.now += 61
    assert box.drop_silent() == ["live"]  # its batch and its new event: nobody drained for 61 s
    box.put("gone", [ev(2)])
    assert box.drain("gone", 0.0, ack=0)[1] == []  # back, with what was put while it was away lost
    box.put("gone", [ev(3)])
    assert [e.seq for e in box.drain("gone", 0.0, ack=0)[1]] == [3]


def test_a_stopping_engine_waits_only_for_fronts_still_draining():
    clock = Clock()
    box = Outbox(clock=clock)
    box.put("stopped", [ev(0)])
    box.drain("stopped", 0.0, ack=0)
    box.put("stopped", [ev(1)])  # its last front's last event: that front stopped reading
    clock.now += READING_S + 1
    assert box.wait_drained(0.0)
    box.drain("reading", 0.0, ack=0)
    box.put("reading", [ev(0)])
    assert not box.wait_drained(0.0)
    box.drain("reading", 0.0, ack=0)
    assert box.wait_drained(0.0)
