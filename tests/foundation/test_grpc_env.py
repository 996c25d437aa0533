"""treeserve's gRPC core settings: which releases get them, that a user's own choice wins, that
importing any of the project's packages sets them before grpc loads, and that the installed
grpcio knows every name in them (an unknown one is logged and ignored by gRPC: the setting would
silently do nothing)."""
import os
import subprocess
import sys

import pytest

from orchestrator.cluster import GCS_PORT_WAIT, GCS_PORT_WAIT_S
from treeserve import grpc_env

known_release = pytest.mark.skipif(not grpc_env.applies_to(grpc_env.grpcio_version()),
                                   reason="the installed grpcio is outside the releases the setting is for")


@pytest.mark.parametrize("version, applies", [
    ("1.84.0", True), ("1.80.1", True), ("1.79.2", False), ("1.85.0", False), ("2.0.0", False),
    ("1.84.0rc1", True), ("garbage", False), (None, False),
])
def test_releases(version, applies):
    env: dict = {}
    grpc_env.set_defaults(env, version=version or "")
    assert grpc_env.applies_to(version) is applies
    assert env == ({grpc_env.EXPERIMENTS: grpc_env.POLLER_NOT_EVENT_ENGINE} if applies else {})


@pytest.mark.parametrize("own", ["", "-event_engine_client", "some_other_experiment"])
def test_a_chosen_value_is_kept(own):
    env = {grpc_env.EXPERIMENTS: own}
    grpc_env.set_defaults(env, version="1.84.0")
    assert env == {grpc_env.EXPERIMENTS: own}


def _child(code: str, **env) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in (grpc_env.EXPERIMENTS, GCS_PORT_WAIT)}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=120, check=True)


@known_release
@pytest.mark.parametrize("module", ["treeserve", "verifier_service.servicer", "drafter_service.servicer",
                                    "orchestrator.engine", "bench.grpc_roundtrip"])
def test_importing_the_project_sets_it_before_grpc_loads(module):
    # the child checks the environment from a hook that runs when grpc's core module loads
    code = (
        "import os, sys, importlib.abc\n"
        "seen = []\n"
        "class Spy(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'grpc' and not seen: seen.append(os.environ.get('GRPC_EXPERIMENTS'))\n"
        "sys.meta_path.insert(0, Spy())\n"
        f"import {module}\n"
        "import grpc\n"
        "print(repr(seen[0]))\n"
    )
    out = _child(code).stdout.strip().splitlines()[-1]
    assert out == repr(grpc_env.POLLER_NOT_EVENT_ENGINE)


@known_release
def test_grpc_knows_every_name_and_serves_with_it():
    code = (
        "import treeserve, grpc\n"
        "from concurrent import futures\n"
        "from grpc_health.v1 import health, health_pb2, health_pb2_grpc\n"
        "server = grpc.server(futures.ThreadPoolExecutor(2))\n"
        "health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)\n"
        "port = server.add_insecure_port('127.0.0.1:0'); server.start()\n"
        "with grpc.insecure_channel(f'127.0.0.1:{port}') as ch:\n"
        "    r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30)\n"
        "print(r.status == health_pb2.HealthCheckResponse.SERVING)\n"
        "server.stop(0)\n"
    )
    done = _child(code)
    assert done.stdout.strip().splitlines()[-1] == "True"
    assert "Unknown experiment" not in done.stderr, done.stderr


@pytest.mark.parametrize("own", [None, "", "some_other_experiment"])
def test_hidden_from_ray_takes_out_only_our_setting(own):
    env = {} if own is None else {grpc_env.EXPERIMENTS: own}
    grpc_env.set_defaults(env, version="1.84.0")
    before = dict(env)
    with grpc_env.hidden_from_ray(env):
        assert env == ({} if own is None else before)
    assert env == before


@known_release
def test_ray_starts_without_unknown_experiment_errors():
    """A real local Ray cluster started by the orchestrator from a process with treeserve's setting:
    Ray's gRPC core logs no unknown experiment, the setting is back afterwards, and a Ray worker
    that imports treeserve runs its grpcio with it."""
    code = (
        "import os, treeserve, ray\n"
        "from orchestrator.cluster import init_ray\n"
        "init_ray(None, 'grpc-env-test', quiet=True)\n"
        "@ray.remote\n"
        "def worker():\n"
        "    import os, treeserve, grpc\n"
        "    return os.environ.get('GRPC_EXPERIMENTS')\n"
        "print(repr(os.environ.get('GRPC_EXPERIMENTS')), repr(ray.get(worker.remote())),\n"
        "      os.environ.get('RAY_gcs_server_port_wait_time_s'))\n"
        "ray.shutdown()\n"
    )
    done = _child(code, RAY_AUTH_MODE="disabled")
    assert "Unknown experiment" not in done.stderr + done.stdout
    ours = repr(grpc_env.POLLER_NOT_EVENT_ENGINE)
    # and Ray's GCS had longer than its own 30 s to come up (a small machine loading models beside it)
    assert done.stdout.strip().splitlines()[-1] == f"{ours} {ours} {GCS_PORT_WAIT_S}"
