"""The orchestrator's Ray actors.

- `Coordinator` (one per deployment, named): the replica registry (register / unregister a
  verifier by address), admission and routing of new requests to the least-loaded replica, the
  request -> replica map used by Cancel, and re-homing of requests whose replica went down.
- `EngineActor` (one per verifier replica, created by the coordinator on `register`): hosts an
  `engine.Engine`, whose step loop runs in a thread inside the actor. Tokens leave through the
  engine's outbox: each front long-polls `drain(front, ack)` and gets every event it has not
  acknowledged in one batch (at least once: a lost answer comes again), so the Ray call rate
  follows the step rate, never the token rate, and the step loop itself never waits on Ray.

Both actors are threaded (max_concurrency > 1): a long poll must not block submissions.

An engine actor that dies (its process killed, its node lost) is dropped from the registry with
every request routed to it, when a call to it fails or a front's long poll finds it gone; routing
goes on over the other replicas, and `register` of its verifier starts a new engine.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from typing import Optional

import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError

from orchestrator.engine import Engine, EngineConfig, Hooks
from orchestrator.names import (COORDINATOR, ENGINE_ANSWERS, ENGINE_DEAD, ENGINE_UNKNOWN, ENGINE_UNREACHABLE,
                                engine_actor_name)
from orchestrator.request import RequestSpec, RequestState

log = logging.getLogger("treeserve.orchestrator.actors")

_UNAVAILABLE, _EXHAUSTED, _NOT_FOUND = 14, 8, 5
FINISHED_TIMEOUT_S = 10.0  # longest wait for the coordinator to take note of ended requests
DRAIN_ON_SHUTDOWN_S = 5.0  # how long a retiring engine waits for its fronts to take its last events


class _CoordinatorHooks(Hooks):
    def __init__(self, coordinator, verifier: str, namespace: str):
        self._coord = coordinator
        self._verifier = verifier
        self._ns = namespace

    def finished(self, request_ids):
        # waited for: the engine publishes the requests' last events once the coordinator forgot them
        ray.get(self._coord.finished.remote(self._verifier, request_ids), timeout=FINISHED_TIMEOUT_S)

    def forward_cancel(self, request_id, engine, reason, admission=""):
        ray.get_actor(engine, namespace=self._ns).cancel.remote(request_id, reason, admission)

    def replica_down(self, states):
        return ray.get(self._coord.replica_down.remote(self._verifier, states))

    def replica_up(self):
        self._coord.replica_up.remote(self._verifier)


@ray.remote(num_cpus=0, max_concurrency=64)
class EngineActor:
    def __init__(self, config: EngineConfig, namespace: str, log_level: str = "INFO"):
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        coord = ray.get_actor(COORDINATOR, namespace=namespace)
        self._engine = Engine(config, _CoordinatorHooks(coord, config.verifier, namespace)).start()

    def info(self) -> dict:
        return {"name": self._engine.name, "capacity": self._engine.info.max_sequences, "info": self._engine.info}

    def submit(self, spec: RequestSpec) -> Optional[tuple[int, str]]:
        return self._engine.submit(spec)

    def adopt(self, state: RequestState) -> bool:
        return self._engine.adopt(state)

    def cancel(self, request_id: str, reason: str, admission: str = "") -> None:
        self._engine.cancel(request_id, reason, admission)

    def drain(self, front: str, timeout: float, ack: int = 0) -> tuple[int, list]:
        return self._engine.outbox.drain(front, timeout, ack)

    def stats(self) -> dict:
        return self._engine.stats()

    def ping(self) -> bool:
        return True

    def shutdown(self) -> None:
        self._engine.stop()
        # the coordinator kills this actor next: let the fronts take the last events first
        self._engine.outbox.wait_drained(DRAIN_ON_SHUTDOWN_S)


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


class CoordinatorCore:
    """The coordinator's logic, a plain class (`Coordinator` is it as a Ray actor). `defaults`:
    the EngineConfig every replica's engine starts from (drafter address, timeouts, service
    token); `register` fills in the verifier address."""

    def __init__(self, namespace: str, defaults: EngineConfig, log_level: str = "INFO"):
        logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        self._log_level = log_level
        self._ns = namespace
        self._defaults = defaults
        self._lock = threading.Lock()
        self._replicas: dict[str, _Replica] = {}
        self._where: dict[str, str] = {}  # request id -> verifier address
        self._moving: set[str] = set()  # request ids `replica_down` is handing to another engine now
        # cancels of requests whose engine has not answered their submission yet: sent once it has
        # (sent at once, one could reach the engine before the request and be dropped there)
        self._early_cancels: dict[str, tuple[str, str]] = {}
        self._submitting: set[str] = set()
        self._ended_in_move: dict[str, str] = {}  # of those, the ones that ended there already -> verifier

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
        early = None  # (reason, admission) of a cancel that came while an engine was being asked
        for rep in order:
            if not self._reserve(rep, spec.request_id):
                continue
            try:
                refusal = ray.get(rep.engine.submit.remote(spec))
            except RayActorError as exc:
                early = self._submitted(spec.request_id) or early
                self._unreserve(rep, spec.request_id)
                self._engine_failed(rep, exc)
                error = (_UNAVAILABLE, f"the engine of verifier replica {rep.verifier} does not answer")
                continue
            early = self._submitted(spec.request_id) or early
            if refusal is None:
                if early is not None and (not early[1] or early[1] == spec.admission):
                    rep.engine.cancel.remote(spec.request_id, *early)
                return rep.name, None
            self._unreserve(rep, spec.request_id)
            error = tuple(refusal)
            if refusal[0] not in (_EXHAUSTED, _UNAVAILABLE):  # full or stopping: another replica may take it
                break
        return None, error

    def _reserve(self, rep: _Replica, request_id: str) -> bool:
        """Count the request on `rep` before asking its engine (undone on refusal), so concurrent
        submissions never overfill it."""
        with self._lock:
            # `rep` may have been retired or replaced since the submission looked at the replicas
            if rep.load >= rep.capacity or rep.draining or self._replicas.get(rep.verifier) is not rep:
                return False
            rep.load += 1
            self._where[request_id] = rep.verifier
            self._submitting.add(request_id)
            return True

    def _submitted(self, request_id: str) -> Optional[tuple[str, str]]:
        """The engine answered the submission: the cancel that came meanwhile, if one did."""
        with self._lock:
            self._submitting.discard(request_id)
            return self._early_cancels.pop(request_id, None)

    def _unreserve(self, rep: _Replica, request_id: str) -> None:
        with self._lock:
            rep.load = max(0, rep.load - 1)
            if self._where.get(request_id) == rep.verifier:
                del self._where[request_id]

    def cancel(self, request_id: str, reason: str = "cancelled", admission: str = "") -> bool:
        """admission: only the request admitted with it (`Engine.cancel`); empty: whichever is live."""
        with self._lock:
            verifier = self._where.get(request_id)
            rep = self._replicas.get(verifier) if verifier else None
            if rep is not None and request_id in self._submitting:
                self._early_cancels[request_id] = (reason, admission)  # `submit` sends it
                return True
        if rep is None:
            return False
        rep.engine.cancel.remote(request_id, reason, admission)
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
                elif rid in self._moving:  # it ended on its new engine before `replica_down` counted it there
                    self._ended_in_move[rid] = verifier
            retire = rep is not None and rep.draining and rep.load == 0
        if retire:
            # on a thread: the engine waits for this call before it publishes its last events,
            # and retiring waits (bounded) until the fronts have taken those
            threading.Thread(target=self._retire, args=(verifier,), name="retire", daemon=True).start()

    def replica_down(self, verifier: str, states: list[RequestState]) -> dict[str, str]:
        """A replica lost its verifier: move what we can elsewhere. Returns {request id: engine}."""
        with self._lock:
            if verifier in self._replicas:
                self._replicas[verifier].healthy = False
        taken: dict[str, str] = {}
        for state in states:
            rid = state.request_id
            with self._lock:
                order = [r for r in self._by_load() if r.verifier != verifier and r.load < r.capacity]
                self._moving.add(rid)
            try:
                for rep in order:
                    try:
                        adopted = ray.get(rep.engine.adopt.remote(state))
                    except RayActorError as exc:
                        self._engine_failed(rep, exc)
                        continue
                    if adopted:
                        with self._lock:
                            old = self._replicas.get(verifier)
                            if old is not None:
                                old.load = max(0, old.load - 1)
                            if self._ended_in_move.get(rid) == rep.verifier:  # done already: nothing to count
                                if self._where.get(rid) == verifier:
                                    del self._where[rid]
                            else:
                                rep.load += 1
                                self._where[rid] = rep.verifier
                        taken[rid] = rep.name
                        break
            finally:
                with self._lock:
                    self._moving.discard(rid)
                    self._ended_in_move.pop(rid, None)
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
        out = []
        for rep in reps:
            try:
                out.append(ray.get(rep.engine.stats.remote()))
            except RayActorError as exc:
                self._engine_failed(rep, exc)
        return out

    def check_engine(self, engine: str) -> str:
        """A front lost its long poll to `engine`: drop the replica if the engine is dead (its
        requests' ids become free at once). One of names.ENGINE_*."""
        with self._lock:
            reps = [r for r in self._replicas.values() if r.name == engine]
        if not reps:
            return ENGINE_UNKNOWN
        for rep in reps:
            try:
                ray.get(rep.engine.ping.remote(), timeout=10)
            except RayActorError as exc:
                self._engine_failed(rep, exc)
                return ENGINE_DEAD if isinstance(exc, ActorDiedError) else ENGINE_UNREACHABLE
            except GetTimeoutError:
                pass  # busy, not dead
        return ENGINE_ANSWERS

    # ---- internals ----------------------------------------------------------------------
    def _by_load(self) -> list[_Replica]:
        live = [r for r in self._replicas.values() if r.healthy and not r.draining]
        return sorted(live, key=lambda r: (r.load / max(1, r.capacity), r.load))

    def _describe(self, rep: _Replica) -> dict:
        return {"verifier": rep.verifier, "engine": rep.name, "capacity": rep.capacity, "load": rep.load,
                "healthy": rep.healthy, "draining": rep.draining}

    def _engine_failed(self, rep: _Replica, exc: RayActorError) -> None:
        """A call to an engine actor failed: a dead one is dropped (`_drop_dead`); one that is only
        unreachable for now (ActorUnavailableError) is skipped this time."""
        if isinstance(exc, ActorDiedError):
            self._drop_dead(rep, exc)
        else:
            log.warning("engine %s of verifier %s does not answer: %s", rep.name, rep.verifier, exc)

    def _drop_dead(self, rep: _Replica, exc: Exception) -> None:
        """Take a replica whose engine actor died out of the registry, with every request routed
        to it (their fronts learn of it from their long polls), so that its ids are free again and
        `register` of its verifier starts a new engine."""
        with self._lock:
            if self._replicas.get(rep.verifier) is not rep:
                return  # dropped already, or replaced by a new registration
            del self._replicas[rep.verifier]
            lost = [rid for rid, verifier in self._where.items() if verifier == rep.verifier]
            for rid in lost:
                del self._where[rid]
        log.error("engine %s of verifier %s died (%s): replica dropped with its %d requests; register the verifier "
                  "again to start a new engine", rep.name, rep.verifier, type(exc).__name__, len(lost))
        try:
            ray.kill(rep.engine)
        except Exception:  # noqa: BLE001 - gone already
            pass

    def _retire(self, verifier: str) -> None:
        """Stop a draining replica's engine once it is idle. Checked again here, under the lock: a
        `register` of the verifier since the decision (it clears `draining`) keeps it."""
        with self._lock:
            rep = self._replicas.get(verifier)
            if rep is None or not rep.draining or rep.load > 0:
                return
            del self._replicas[verifier]
        try:
            ray.get(rep.engine.shutdown.remote(), timeout=15)
        finally:
            ray.kill(rep.engine)
        log.info("unregistered verifier %s", verifier)


Coordinator = ray.remote(num_cpus=0, max_concurrency=64)(CoordinatorCore)


def _node_of(host: str) -> Optional[str]:
    """The Ray node id whose address is `host`, if any."""
    try:
        for node in ray.nodes():
            if node.get("Alive") and node.get("NodeManagerAddress") == host:
                return node["NodeID"]
    except Exception:  # noqa: BLE001
        return None
    return None
