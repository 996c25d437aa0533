"""The coordinator and the front with Ray in this process: an orchestrator (`runtime.Orchestrator`,
its private Ray instance) in front of one in-process verifier registered under two addresses, so
two replicas with an engine actor each. Request ids are free again as soon as a client heard the
end, and a dead engine actor leaves the rotation."""
from __future__ import annotations

import grpc
import pytest

from orchestrator.names import engine_actor_name
from tests.orchestrator import stack
from tests.orchestrator.inproc import LocalVerifier
from tests.orchestrator.stack import Background, GenerationClient, request, wait_until
from treeserve.v1 import treeserve_pb2 as pb

NAMESPACE = "treeserve-coordinator-test"
PROMPT = [5, 17, 42, 8, 99, 3, 11, 23]


@pytest.fixture(scope="module")
def deployment(tiny_pair):
    import ray

    from orchestrator.cluster import init_ray
    from orchestrator.runtime import Orchestrator, OrchestratorConfig

    # Ray's head processes first, while this process runs no gRPC threads: forked beside a serving
    # gRPC server (gRPC then skips its fork handlers), Ray's GCS server sometimes never started
    init_ray(None, NAMESPACE, quiet=True)
    verifier = orch = None
    try:
        verifier = LocalVerifier(tiny_pair[0], max_sequences=8, max_sequence_length=256)
        replicas = [f"127.0.0.1:{verifier.port}", f"localhost:{verifier.port}"]
        orch = Orchestrator(OrchestratorConfig(verifiers=replicas, port=0, namespace=NAMESPACE,
                                               tokenizer=str(tiny_pair[0]), quiet=True)).start()
        yield orch, replicas
    finally:
        try:
            if orch is not None:
                orch.stop()
        finally:
            try:
                if ray.is_initialized():
                    ray.shutdown()
            finally:
                if verifier is not None:
                    verifier.stop()


@pytest.fixture(scope="module")
def client(deployment):
    with GenerationClient(f"127.0.0.1:{deployment[0].port}") as c:
        yield c


def registered(orch) -> dict[str, int]:
    """{verifier address: load} of the registered replicas."""
    import ray

    return {r["verifier"]: r["load"] for r in ray.get(orch.coordinator.replicas.remote())}


def kill_engine(verifier: str) -> None:
    import ray

    ray.kill(ray.get_actor(engine_actor_name(verifier), namespace=NAMESPACE))


def test_a_request_id_is_free_again_once_its_client_heard_the_end(client):
    """The same id at once after each end: a stop string (the front cancels the request, which
    the engine is still running), and a natural end."""
    full = client.generate(request(stack.PROMPT_TEXT, max_new_tokens=24, speculation="off", request_id="again"),
                           timeout=300)
    assert full.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)
    starts = [i for i in range(2, len(full.text) - 2) if "\ufffd" not in full.text[i:i + 2]]
    if not starts:
        pytest.skip("random output has no clean characters to stop on")
    stop = full.text[starts[0]:starts[0] + 2]
    for _ in range(5):
        res = client.generate(request(stack.PROMPT_TEXT, max_new_tokens=100, speculation="off", stop=[stop],
                                      request_id="again"), timeout=300)
        assert res.finish_reason == pb.FINISH_REASON_STOP
        assert res.text == full.text[:full.text.index(stop)]
    for _ in range(3):
        res = client.generate(request(PROMPT, max_new_tokens=2, speculation="off", request_id="again"), timeout=300)
        assert res.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)


def test_a_dead_engine_leaves_the_rotation(deployment, client):
    orch, replicas = deployment
    wait_until(lambda: set(registered(orch).values()) == {0}, 30, "idle replicas")
    # 1. the engine of a request in flight dies: the request fails UNAVAILABLE, and its id is
    # free again at once (the front's long poll told the coordinator)
    doomed = Background(client, request(PROMPT, max_new_tokens=100, speculation="off", request_id="doomed"))
    wait_until(lambda: len(doomed.token_ids) >= 2, 120, "first tokens")
    [victim] = [v for v, load in registered(orch).items() if load == 1]
    [survivor] = [v for v in replicas if v != victim]
    kill_engine(victim)
    doomed.join()
    assert doomed.error is not None and doomed.error.code() == grpc.StatusCode.UNAVAILABLE, doomed.error
    res = client.generate(request(PROMPT, max_new_tokens=3, speculation="off", request_id="doomed"), timeout=300)
    assert len(res.token_ids) >= 1
    assert registered(orch) == {survivor: 0}
    for i in range(3):
        client.generate(request(PROMPT, max_new_tokens=3, speculation="off", request_id=f"after-{i}"), timeout=300)

    # 2. registering the verifier again starts a new engine; when that one dies while no front
    # watches it, the next submission routed to it finds out, drops it and goes to the other
    import ray

    ray.get(orch.coordinator.register.remote(victim))
    busy = Background(client, request(PROMPT, max_new_tokens=100, speculation="off", request_id="busy"))
    wait_until(lambda: len(busy.token_ids) >= 1, 120, "first tokens")
    assert registered(orch) == {survivor: 1, victim: 0}  # so the next request goes to the victim first
    kill_engine(victim)
    res = client.generate(request(PROMPT, max_new_tokens=3, speculation="off", request_id="to-the-dead"), timeout=300)
    assert len(res.token_ids) >= 1
    assert set(registered(orch)) == {survivor}
    assert client.cancel("busy")
    busy.join()
    assert busy.messages[-1].finish_reason == pb.FINISH_REASON_CANCELLED

    # 3. and once registered again it serves
    ray.get(orch.coordinator.register.remote(victim))
    busy = Background(client, request(PROMPT, max_new_tokens=100, speculation="off", request_id="busy-again"))
    wait_until(lambda: len(busy.token_ids) >= 1, 120, "first tokens")
    assert registered(orch) == {survivor: 1, victim: 0}
    res = client.generate(request(PROMPT, max_new_tokens=3, speculation="off", request_id="new-engine"), timeout=300)
    assert len(res.token_ids) >= 1
    steps = {s["verifier"]: s["steps"] for s in ray.get(orch.coordinator.stats.remote())}
    assert steps[victim] > 0
    assert client.cancel("busy-again")
    busy.join()
    wait_until(lambda: registered(orch) == {survivor: 0, victim: 0}, 30, "both replicas idle")


def test_stopping_a_router_ends_its_readers(deployment):
    """`Router.stop` returns only once its reader threads have left `ray.get`: Ray shut down
    under a thread still blocked in it can crash the process (the orchestrator stops its router
    just before `ray.shutdown`)."""
    from orchestrator.request import RequestSpec, Speculation
    from orchestrator.router import Router
    from treeserve.sampling import Sampling

    router = Router(NAMESPACE, "a-second-front")
    spec = RequestSpec("second-front", tuple(PROMPT), Sampling(), 50, Speculation(mode="off", adaptive=False),
                       router.front)
    inbox, error = router.submit(spec)
    assert error is None, error
    assert inbox.get(timeout=120) is not None  # its engine's reader runs
    readers = list(router._readers.values())
    assert readers and all(t.is_alive() for t in readers)
    assert router.cancel("second-front")
    assert router.stop()
    assert not any(t.is_alive() for t in readers)
    router._ensure_reader(inbox.engine)  # a stopped router starts no reader
    assert not any(t.is_alive() for t in router._readers.values())
    wait_until(lambda: set(registered(deployment[0]).values()) == {0}, 30, "idle replicas")
