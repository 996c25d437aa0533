"""The orchestrator's Ray actors.

- `Coordinator` (one per deployment, named): the replica registry (register / unregister a
  verifier by address), admission and routing of new requests to the least-loaded replica, the
  request -> replica map used by Cancel, and re-homing of requests whose replica went down.
- `EngineActor` (one per verifier replica, created by the coordinator on `register`): hosts an
  `engine.Engine`, whose step loop runs in a thread inside the actor. Tokens leave through the
  engine's outbox: each front long-polls `drain(front)` and gets every event produced since its
  last call in one batch, so the Ray call rate follows the step rate, never the token rate, and
  the step loop itself never waits on Ray.

Both actors are threaded (max_concurrency > 1): a long poll must not block submissions.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from typing import Optional

import ray

from orchestrator.engine import Engine, EngineConfig, Hooks
from orchestrator.names import COORDINATOR, engine_actor_name
from orchestrator.request import RequestSpec, RequestState

log = logging.getLogger("treeserve.orchestrator.actors")

_UNAVAILABLE, _EXHAUSTED, _NOT_FOUND = 14, 8, 5


class _CoordinatorHooks(Hooks):
    def __init__(self, coordinator, verifier: str):
        self._coord = coordinator
        self._verifier = verifier

    def finished(self, request_ids):
        self._coord.finished.remote(self._verifier, request_ids)

    def replica_down(self, states):
        return ray.get(self._coord.replica_down.remote(self._verifier, states))

    def replica_up(self):
        self._coord.replica_up.remote(self._verifier)


@ray.remote(num_cpus=0, max_concurrency=64)
class EngineActor:
    def __init__(self, config: EngineConfig, namespace: str, log_level: str = "INFO"):
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        coord = ray.get_actor(COORDINATOR, namespace=namespace)
        self._engine = Engine(config, _CoordinatorHooks(coord, config.verifier)).start()

    def info(self) -> dict:
        return {"name": self._engine.name, "capacity": self._engine.info.max_sequences, "info": self._engine.info}

    def submit(self, spec: RequestSpec) -> Optional[tuple[int, str]]:
        return self._engine.submit(spec)

    def adopt(self, state: RequestState) -> bool:
        return self._engine.adopt(state)

    def cancel(self, request_id: str, reason: str) -> None:
        self._engine.cancel(request_id, reason)

    def drain(self, front: str, timeout: float) -> list:
        return self._engine.outbox.drain(front, timeout)

    def stats(self) -> dict:
        return self._engine.stats()

    def shutdown(self) -> None:
        self._engine.stop()


@dataclass
class _Replica:
    verifier: str
    engine: object  # actor handle
    name: str
    capacity: int
    info: object
    load: int = 0
    healthy: bool = True
    draining: bool = False


@ray.remote(num_cpus=0, max_concurrency=64)
class Coordinator:
    """`defaults`: the EngineConfig every replica's engine starts from (drafter address, timeouts,
    service token); `register` fills in the verifier address."""

    def __init__(self, namespace: str, defaults: EngineConfig, log_level: str = "INFO"):
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._log_level = log_level
        self._ns = namespace
        self._defaults = defaults
        self._lock = threading.Lock()
        self._replicas: dict[str, _Replica] = {}
        self._where: dict[str, str] = {}  # request id -> verifier address

    # ---- registry -----------------------------------------------------------------------
    def register(self, verifier: str, drafter: Optional[str] = None) -> dict:
        """Start an engine for a verifier replica (idempotent). `drafter` overrides the default
        drafter address for this replica. The engine is placed on the Ray node whose address is
        the verifier's host when there is one."""
        with self._lock:
            rep = self._replicas.get(verifier)
            if rep is not None:
                rep.draining = False
                return self._describe(rep)
        config = replace(self._defaults, verifier=verifier, name=engine_actor_name(verifier),
                         drafter=drafter if drafter is not None else self._defaults.drafter)
        options = dict(name=config.name, namespace=self._ns, get_if_exists=True)
        node = _node_of(verifier.rsplit(":", 1)[0])
        if node is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
        engine = EngineActor.options(**options).remote(config, self._ns, self._log_level)
        try:
            meta = ray.get(engine.info.remote())
        except Exception:
            ray.kill(engine)
            raise
        rep = _Replica(verifier, engine, meta["name"], meta["capacity"], meta["info"])
        with self._lock:
            self._replicas[verifier] = rep
        log.info("registered verifier %s (%d sequences)", verifier, rep.capacity)
        return self._describe(rep)

    def unregister(self, verifier: str) -> bool:
        """Stop routing new requests to a replica; its engine stops once its requests are done."""
        with self._lock:
            rep = self._replicas.get(verifier)
            if rep is None:
                return False
            rep.draining = True
            idle = rep.load == 0
        if idle:
            self._retire(verifier)
        return True

    def replicas(self) -> list[dict]:
        with self._lock:
            return [self._describe(r) for r in self._replicas.values()]

    def limits(self) -> Optional[dict]:
        """The tightest limits over the registered replicas (None before the first)."""
        with self._lock:
            infos = [r.info for r in self._replicas.values()]
        if not infos:
            return None
        return {
            "vocab_size": min(i.vocab_size for i in infos),
            "max_sequence_length": min(i.max_sequence_length for i in infos),
            "max_tree_nodes": min(i.max_tree_nodes for i in infos),
            "eos_token_ids": infos[0].eos_token_ids,
            "model": infos[0].model,
        }

    # ---- requests -----------------------------------------------------------------------
    def submit(self, spec: RequestSpec) -> tuple[Optional[str], Optional[tuple[int, str]]]:
        """Route a new request: (engine name, None) or (None, (grpc code number, message))."""
        with self._lock:
            if spec.request_id in self._where:
                return None, (6, f"request id {spec.request_id!r} is already live")  # ALREADY_EXISTS
            order = self._by_load()
        if not order:
            return None, (_UNAVAILABLE, "no verifier replica is available")
        error = (_EXHAUSTED, "every verifier replica is full")
        for rep in order:
            with self._lock:  # reserve the slot before asking; undone on refusal
                if rep.load >= rep.capacity:
                    continue
                rep.load += 1
                self._where[spec.request_id] = rep.verifier
            refusal = ray.get(rep.engine.submit.remote(spec))
            if refusal is None:
                return rep.name, None
            with self._lock:
                rep.load -= 1
                self._where.pop(spec.request_id, None)
            error = tuple(refusal)
            if refusal[0] != _EXHAUSTED:
                break
        return None, error

    def cancel(self, request_id: str, reason: str = "cancelled") -> bool:
        with self._lock:
            verifier = self._where.get(request_id)
            rep = self._replicas.get(verifier) if verifier else None
        if rep is None:
            return False
        rep.engine.cancel.remote(request_id, reason)
        return True

    def finished(self, verifier: str, request_ids: list[str]) -> None:
        retire = False
        with self._lock:
            rep = self._replicas.get(verifier)
            for rid in request_ids:
                if self._where.get(rid) == verifier:
                    del self._where[rid]
                    if rep is not None:
                        rep.load = max(0, rep.load - 1)
            retire = rep is not None and rep.draining and rep.load == 0
        if retire:
            self._retire(verifier)

    def replica_down(self, verifier: str, states: list[RequestState]) -> dict[str, str]:
        """A replica lost its verifier: move what we can elsewhere. Returns {request id: engine}."""
        with self._lock:
            if verifier in self._replicas:
                self._replicas[verifier].healthy = False
        taken: dict[str, str] = {}
        for state in states:
            with self._lock:
                order = [r for r in self._by_load() if r.verifier != verifier and r.load < r.capacity]
            for rep in order:
                if ray.get(rep.engine.adopt.remote(state)):
                    with self._lock:
                        rep.load += 1
                        self._where[state.request_id] = rep.verifier
                        old = self._replicas.get(verifier)
                        if old is not None:
                            old.load = max(0, old.load - 1)
                    taken[state.request_id] = rep.name
                    break
        if taken:
            log.info("moved %d requests off verifier %s", len(taken), verifier)
        return taken

    def replica_up(self, verifier: str) -> None:
        with self._lock:
            if verifier in self._replicas:
                self._replicas[verifier].healthy = True

    def stats(self) -> list[dict]:
        with self._lock:
            reps = list(self._replicas.values())
        return [ray.get(r.engine.stats.remote()) for r in reps]

    # ---- internals ----------------------------------------------------------------------
    def _by_load(self) -> list[_Replica]:
        live = [r for r in self._replicas.values() if r.healthy and not r.draining]
        return sorted(live, key=lambda r: (r.load / max(1, r.capacity), r.load))

    def _describe(self, rep: _Replica) -> dict:
        return {"verifier": rep.verifier, "engine": rep.name, "capacity": rep.capacity, "load": rep.load,
                "healthy": rep.healthy, "draining": rep.draining}

    def _retire(self, verifier: str) -> None:
        with self._lock:
            rep = self._replicas.pop(verifier, None)
        if rep is not None:
            try:
                ray.get(rep.engine.shutdown.remote(), timeout=15)
            finally:
                ray.kill(rep.engine)
            log.info("unregistered verifier %s", verifier)


def _node_of(host: str) -> Optional[str]:
    """The Ray node id whose address is `host`, if any."""
    try:
        for node in ray.nodes():
            if node.get("Alive") and node.get("NodeManagerAddress") == host:
                return node["NodeID"]
    except Exception:  # noqa: BLE001
        return None
    return None
