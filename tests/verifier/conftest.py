"""A real verifier process on the tiny target (CPU), shared by the service tests, plus the same
model loaded in-process as the reference the answers are checked against."""
from __future__ import annotations

import pytest

from tests.verifier.harness import MAX_SEQUENCES, VerifierProcess


@pytest.fixture(scope="session")
def verifier(tiny_pair):
    proc = VerifierProcess(tiny_pair[0], "--direct-port", "0")  # VerifyStream's tests run on both ports
    yield proc
    proc.stop()


@pytest.fixture()
def client(verifier):
    from verifier_service.client import VerifierClient

    with VerifierClient(verifier.address, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def reference(tiny_pair):
    """The same target loaded in this process, driven directly through the runtime API."""
    from tests.verifier.reference import Reference

    return Reference(tiny_pair[0], max_slots=MAX_SEQUENCES)


@pytest.fixture()
def fresh_id(client):
    """fresh_id() -> a new sequence id; every id handed out is released after the test."""
    import itertools

    made: list[str] = []
    counter = itertools.count()

    def make(prefix: str = "seq") -> str:
        sid = f"{prefix}-{len(made)}-{next(counter)}-{id(made) % 10007}"
        made.append(sid)
        return sid

    yield make
    for sid in made:
        client.release(sid)
