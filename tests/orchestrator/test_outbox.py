"""The engine's outbox: at-least-once batches (a lost answer is sent again until acknowledged),
and fronts that stopped draining dropped with their events."""
import time

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


def test_a_front_that_neither_drains_nor_submits_is_dropped_with_its_events():
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
    assert box.drop_silent() == []  # nothing left of it
    clock.now += 61
    assert box.drop_silent() == ["live"]  # its batch and its new event: nobody drained for 61 s
    box.touch("gone")  # it submitted a request: alive, and what comes for it now stays
    box.put("gone", [ev(2)])  # (its reader of this engine may start after the first events)
    clock.now += 59
    assert box.drop_silent() == []
    assert [e.seq for e in box.drain("gone", 0.0, ack=0)[1]] == [2]


def test_a_stopping_engine_waits_for_the_fronts_still_draining_to_acknowledge():
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
    batch, _ = box.drain("reading", 0.0, ack=0)
    assert not box.wait_drained(0.0)  # taken, but the answer may yet be lost
    box.drain("reading", 0.0, ack=batch)
    assert box.wait_drained(0.0)


def test_two_drains_of_one_front_at_once_both_carry_what_either_took():
    """A reader that gave up on a drain (it seemed lost) and sent another: both wait, and whichever
    answer arrives holds the events; the other's batch is not lost by being replaced."""
    import threading

    box = Outbox()
    answers = []
    waiting = [threading.Thread(target=lambda: answers.append(box.drain("f", 10.0, ack=0))) for _ in range(2)]
    for t in waiting:
        t.start()
    deadline = time.monotonic() + 10
    while len(box._cv._waiters) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    box.put("f", [ev(0)])
    for t in waiting:
        t.join(10)
    assert time.monotonic() - t0 < 5  # the second did not wait out its 10 s
    assert [[e.seq for e in events] for _, events in answers] == [[0], [0]]
    last = answers[-1][0]
    assert box.drain("f", 0.0, ack=last) == (last, [])  # the last batch made acknowledges both
