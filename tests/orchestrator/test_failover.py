"""Two verifier replicas and a drafter behind one orchestrator: load sharing, drafter and
verifier failures.

The Ray cluster is started like a deployment's head node (`ray start --head`); the orchestrator
joins it with the first replica, and the second replica is added to the running deployment with
`treeserve orchestrator --register` (docs/deploy.md), so the coordinator's registry is exercised
across processes.

When the test can create network namespaces, the verifiers run on one "host" and the drafter on
another (each its own namespace, linked to the orchestrator's by a veth pair), so every call
crosses a network link; otherwise everything runs on 127.0.0.1 and the two-host test is skipped.
"""
from __future__ import annotations

import threading

import pytest

from orchestrator.procs import stop_all
from tests.orchestrator import netns, stack
from tests.orchestrator.stack import Background, GenerationClient, request
from treeserve.v1 import treeserve_pb2 as pb

NAMESPACE = "treeserve-test"


@pytest.fixture(scope="module")
def hosts():
    """(verifier host, drafter host), or None when namespaces cannot be made here."""
    reason = netns.unavailable()
    if reason is not None:
        yield None, reason
        return
    made = []
    try:
        made.append(netns.Host(1))
        made.append(netns.Host(2))
        yield (made[0], made[1]), None
    finally:
        for h in made:
            h.delete()


class Services:
    def __init__(self, target: str, drafter_model: str, hosts):
        self.target, self.drafter_model = target, drafter_model
        self.v_host, self.d_host = hosts if hosts is not None else (None, None)
        vip = self.v_host.address if self.v_host else "127.0.0.1"
        dip = self.d_host.address if self.d_host else "127.0.0.1"
        self.verifiers = [f"{vip}:{stack.free_port()}" for _ in range(2)]
        # the first replica also serves its direct port, which its engine then takes (the second
        # serves VerifyStream on gRPC only); its metrics say how many connections the port holds
        self.direct_metrics = f"http://{vip}:{stack.free_port()}/metrics"
        self.drafter = f"{dip}:{stack.free_port()}"
        # the drafter serves Speculate on a direct port as well (as under `serve`): a killed and
        # restarted drafter is found again there; its metrics count the port's connections
        self.drafter_direct_port = stack.free_port()
        self.drafter_metrics = f"http://{dip}:{stack.free_port()}/metrics"
        self.children = {}

    def _where(self, host):
        return dict(prefix=host.prefix, host=host.address) if host else {}

    def start_verifier(self, i: int):
        port = self.verifiers[i].rsplit(":", 1)[1]
        extra = () if i else ("--direct-port", str(stack.free_port()),
                              "--metrics-port", self.direct_metrics.rsplit(":", 1)[1].split("/")[0])
        self.children[f"v{i}"] = c = stack.verifier(self.target, port=port, name=f"verifier-{i}", extra=extra,
                                                    **self._where(self.v_host))
        return c

    def start_drafter(self):
        port = self.drafter.rsplit(":", 1)[1]
        self.children["d"] = c = stack.drafter(self.drafter_model, port=port,
                                               extra=("--direct-port", str(self.drafter_direct_port),
                                                      "--metrics-port",
                                                      self.drafter_metrics.rsplit(":", 1)[1].split("/")[0]),
                                               **self._where(self.d_host))
        return c

    def start(self):
        self.head = stack.RayHead()
        # everything starts at once: the orchestrator waits for the head, its engine for the verifier
        kids = [self.start_verifier(0), self.start_verifier(1), self.start_drafter(),
                stack.orchestrator(self.verifiers[:1], self.drafter, self.target,
                                   "--ray-address", self.head.address, "--namespace", NAMESPACE)]
        self.children["o"] = kids[-1]
        self.orchestrator = stack.start(kids)[-1]
        stack.treeserve("orchestrator", "--ray-address", self.head.address, "--namespace", NAMESPACE,
                        "--register", self.verifiers[1], timeout=300)

    def stop(self):
        stop_all(list(self.children.values()))
        if getattr(self, "head", None) is not None:
            self.head.stop()


@pytest.fixture(scope="module")
def services(tiny_pair, hosts):
    s = Services(str(tiny_pair[0]), str(tiny_pair[1]), hosts[0])
    try:
        s.start()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(services):
    with GenerationClient(services.orchestrator) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return stack.Reference(tiny_pair[0])


@pytest.fixture(scope="module")
def prompt(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0])(stack.PROMPT_TEXT)["input_ids"]


def test_drafter_and_verifier_on_two_hosts(hosts, services, client, reference, prompt):
    if hosts[0] is None:
        pytest.skip(f"no separate network hosts: {hosts[1]}")
    v_host, d_host = hosts[0]
    assert services.verifiers[0].startswith(v_host.address) and services.drafter.startswith(d_host.address)
    res = client.generate(request(prompt, max_new_tokens=24, speculation="chain"), timeout=300)
    assert res.token_ids == reference.generate(prompt, 24)
    assert max(nodes for nodes, _, _ in res.steps) > 1  # trees came from the drafter's host
    assert stack.drafter_stats(services.drafter).trees > 0


def test_replicas_registered_with_the_coordinator(services):
    import json

    listed = json.loads(stack.treeserve("orchestrator", "--ray-address", services.head.address,
                                        "--namespace", NAMESPACE, "--list"))
    assert sorted(r["verifier"] for r in listed) == sorted(services.verifiers)
    assert all(r["healthy"] and r["capacity"] == 6 for r in listed)


def test_replicas_share_load(services, client, reference, prompt):
    before = [stack.verifier_stats(v).forward_passes for v in services.verifiers]
    prompts = [prompt, prompt[1:], prompt[2:], prompt[3:]]
    results = [None] * len(prompts)

    def run(i):
        results[i] = client.generate(request(prompts[i], max_new_tokens=16, speculation="chain"), timeout=300)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p, res in zip(prompts, results):
        assert res.token_ids == reference.generate(p, 16)
    after = [stack.verifier_stats(v).forward_passes for v in services.verifiers]
    assert all(a - b >= 4 for a, b in zip(after, before)), (before, after)


def metric(url: str, name: str) -> float:
    """The value of an unlabelled Prometheus metric at `url`."""
    import urllib.request

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    [line] = [ln for ln in text.splitlines() if ln.startswith(name + " ")]
    return float(line.split()[1])


def test_the_engine_of_a_replica_with_a_direct_port_takes_it(services):
    """Replica 0 advertises a direct port and its engine (in its Ray actor, across the network
    link when there is one) holds a connection to it; replica 1 advertises none. Both served the
    load-sharing test's requests with the reference's tokens. The engines' draft links hold
    connections to the drafter's direct port."""
    assert stack.verifier_stats(services.verifiers[0]).direct_port > 0
    assert stack.verifier_stats(services.verifiers[1]).direct_port == 0
    assert metric(services.direct_metrics, "treeserve_verifier_direct_connections") >= 1
    assert stack.drafter_stats(services.drafter).direct_port == services.drafter_direct_port
    assert metric(services.drafter_metrics, "treeserve_drafter_direct_connections") >= 1


def test_drafter_killed_mid_generation(services, client, reference, prompt):
    n = 60
    want = reference.generate(prompt, n)
    killed = threading.Event()

    def kill_after_some_tokens(bg):
        if not killed.is_set() and len(bg.token_ids) >= 8:
            killed.set()
            services.children["d"].kill()

    bg = Background(client, request(prompt, max_new_tokens=n, speculation="chain"), kill_after_some_tokens).join()
    assert bg.error is None, bg.error
    assert killed.is_set() and bg.token_ids == want
    assert bg.messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    # a restarted drafter is found again (the engines reconnect with backoff) and speculation resumes
    services.start_drafter().wait(stack.STARTUP_S)
    want = reference.generate(prompt, 24)

    def drafted_again() -> bool:
        res = client.generate(request(prompt, max_new_tokens=24, speculation="chain"), timeout=300)
        assert res.token_ids == want
        return max(nodes for nodes, _, _ in res.steps) > 1

    stack.wait_until(drafted_again, 120, "trees from the restarted drafter")
    stats = stack.drafter_stats(services.drafter)
    assert stats.trees > 0 and stats.direct_port == services.drafter_direct_port
    # the engine's link came back on the restarted drafter's direct port
    assert metric(services.drafter_metrics, "treeserve_drafter_direct_connections") >= 1


def test_verifier_failures_move_and_resume(services, client, reference, prompt):
    """Kill the replica serving the request: it continues on the other one. Then kill that one
    too and restart the first: the request resumes on the restarted replica. Output unchanged."""
    n = 64
    want = reference.generate(prompt, n)
    events = {}

    def serving() -> int:
        for i, v in enumerate(services.verifiers):
            if services.children[f"v{i}"].alive() and stack.verifier_stats(v).active_sequences > 0:
                return i
        raise AssertionError("no live replica holds the request")

    def restart_first():
        services.start_verifier(events["first"]).wait(stack.STARTUP_S)

    def chaos(bg):
        got = len(bg.token_ids)
        if "first" not in events and got >= 8:
            events["first"] = first = serving()
            services.children[f"v{first}"].kill()
            events["first_at"] = got
        elif "first" in events and "second" not in events and got >= events["first_at"] + 8:
            events["second"] = second = serving()
            assert second != events["first"]
            services.children[f"v{second}"].kill()
            events["restart"] = threading.Thread(target=restart_first)
            events["restart"].start()

    bg = Background(client, request(prompt, max_new_tokens=n, speculation="chain"), chaos).join(600)
    assert bg.error is None, bg.error
    assert "second" in events, "generation ended before both failures were injected"
    events["restart"].join()
    assert bg.token_ids == want
    assert stack.verifier_stats(services.verifiers[events["first"]]).forward_passes > 0


def test_unregister_a_dead_replica(services, client, reference, prompt):
    """After the failures above one replica is still down: take it out of the deployment; the
    other keeps serving."""
    import json

    dead = [i for i in range(2) if not services.children[f"v{i}"].alive()]
    assert len(dead) == 1
    gone, live = services.verifiers[dead[0]], services.verifiers[1 - dead[0]]
    out = json.loads(stack.treeserve("orchestrator", "--ray-address", services.head.address, "--namespace", NAMESPACE,
                                     "--unregister", gone))
    assert out == {"unregistered": True}
    listed = json.loads(stack.treeserve("orchestrator", "--ray-address", services.head.address,
                                        "--namespace", NAMESPACE, "--list"))
    assert [r["verifier"] for r in listed] == [live]
    before = stack.verifier_stats(live).forward_passes
    res = client.generate(request(prompt, max_new_tokens=8, speculation="off"), timeout=300)
    assert res.token_ids == reference.generate(prompt, 8)
    assert stack.verifier_stats(live).forward_passes > before
