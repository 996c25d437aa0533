"""Assembling an orchestrator: Ray, the coordinator, the replicas' engines and the public server.

`ray_address=None` starts a private single-node Ray instance with 127.0.0.1 as its node address
and no dashboard (Ray 2.60 still listens on every interface: firewall the machine if that
matters); otherwise the process joins an existing cluster (`ray start --head` / `ray start
--address`), and finds or creates the coordinator there by name, so several fronts can share it.
"""
from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass, field
from typing import Optional

from orchestrator import names
from orchestrator.cluster import init_ray
from orchestrator.engine import EngineConfig
from orchestrator.generation import FrontLimits, GenerationServicer
from treeserve.server import GRACE_SECONDS

log = logging.getLogger("treeserve.orchestrator")

DEFAULT_NAMESPACE = names.DEFAULT_NAMESPACE


@dataclass
class OrchestratorConfig:
    verifiers: list[str]
    drafter: Optional[str] = None
    ray_address: Optional[str] = None
    namespace: str = DEFAULT_NAMESPACE
    host: str = "127.0.0.1"
    port: int = 50051
    auth_token: Optional[str] = None  # required from clients of the Generation service
    service_token: Optional[str] = None  # sent to the verifier and drafter services
    tokenizer: Optional[str] = None  # directory with the target's tokenizer (text prompts, text output)
    draft_timeout_s: float = 1.0
    replica_timeout_s: float = 60.0
    connect_timeout_s: float = 300.0
    limits: FrontLimits = field(default_factory=FrontLimits)
    metrics_port: int = 0
    shutdown_grace_s: float = GRACE_SECONDS  # how long a SIGTERM/SIGINT lets calls in flight finish
    quiet: bool = False  # no Ray / actor log lines on this process's output (the demo)


def coordinator(namespace: str, defaults: EngineConfig, detached: bool):
    """The deployment's coordinator, created by the first front (with `defaults` for its engines).
    On a shared cluster it is detached, so it outlives the front that created it."""
    from orchestrator.actors import Coordinator

    level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
    return Coordinator.options(name=names.COORDINATOR, namespace=namespace, get_if_exists=True,
                               lifetime="detached" if detached else None).remote(namespace, defaults, level)


def load_tokenizer(path: Optional[str]):
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


class RegistrationFailed(RuntimeError):
    """A listed verifier could not be registered (unreachable, or its engine failed to start)."""


def _innermost(exc: BaseException) -> str:
    """The last line of an exception's text that names an error: what Ray's wrapped tracebacks
    end with, the engine's own exception."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line.split(":", 1)[0] or "Unreachable" in line.split(":", 1)[0]]
    return (named or lines or [type(exc).__name__])[-1]


class Orchestrator:
    """Ray + coordinator + engines + the Generation server. `start()` returns once every listed
    verifier is registered and the server is listening on `self.port`."""

    def __init__(self, config: OrchestratorConfig):
        self.config = config
        self.server = None
        self.port = 0
        self.coordinator = None
        self._router = None

    def prepare(self) -> "Orchestrator":
        """Ray and the coordinator: everything that does not need the verifiers yet (so it can
        overlap with their model loading)."""
        if self.coordinator is not None:
            return self
        c = self.config
        init_ray(c.ray_address, c.namespace, c.quiet)
        defaults = EngineConfig(verifier="", drafter=c.drafter, service_token=c.service_token,
                                draft_timeout_s=c.draft_timeout_s, replica_timeout_s=c.replica_timeout_s,
                                connect_timeout_s=c.connect_timeout_s)
        # Holding the handle keeps a non-detached coordinator (and its engines) alive.
        self.coordinator = coordinator(c.namespace, defaults, detached=c.ray_address is not None)
        return self

    def start(self) -> "Orchestrator":
        import ray

        from orchestrator.router import Router
        from treeserve.server import Server, start_metrics
        from treeserve.v1 import treeserve_pb2_grpc as pbg

        c = self.config
        self.prepare()
        for address in c.verifiers:
            log.info("registering verifier %s (waiting up to %g s for it to answer)", address, c.connect_timeout_s)
            try:
                info = ray.get(self.coordinator.register.remote(address))
            except Exception as exc:  # noqa: BLE001 - Ray wraps whatever the engine's start-up raised
                raise RegistrationFailed(f"verifier {address} could not be registered: {_innermost(exc)}") from exc
            log.info("verifier %s registered (engine %s)", address, info["engine"])
        tokenizer = load_tokenizer(c.tokenizer)
        # unique per process: a front restarted in a container has the same host name and pid, and
        # must not take over the old process's events (nor keep its orphans from being cancelled)
        front = f"front-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self._router = Router(c.namespace, front)
        servicer = GenerationServicer(self._router, tokenizer, c.limits)
        # a worker per open stream (at most limits.max_streams) and some for Cancel and the rest
        self.server = Server(f"{c.host}:{c.port}", max_workers=c.limits.worker_count(), auth_token=c.auth_token,
                             grace_s=c.shutdown_grace_s)
        self.server.add(pbg.add_GenerationServicer_to_server, servicer, "Generation")
        self.server.start()
        self.port = self.server.port
        start_metrics(c.metrics_port)
        return self

    def wait(self) -> None:
        self.server.wait()
        self.shutdown_ray()

    def stop(self) -> None:
        try:
            if self.server is not None:
                self.server.stop(grace=1.0)
        finally:
            self.shutdown_ray()

    def shutdown_ray(self) -> None:
        import ray

        if self._router is not None and not self._router.stop():
            log.warning("a thread of this front is still inside a Ray call as Ray shuts down")
        if ray.is_initialized():
            ray.shutdown()
