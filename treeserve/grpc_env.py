"""The gRPC core settings treeserve's processes run with.

gRPC's C core reads its settings from the environment once, when the `grpc` module loads. So they
are put there when the `treeserve` package is imported (`treeserve/__init__.py`), and every other
package of the project imports `treeserve` before anything that loads `grpc`. A process that
loaded `grpc` before importing treeserve keeps gRPC's own defaults.

The one setting: sockets are served by the completion-queue poller, not by the EventEngine.
Since grpcio 1.80 the Python stack reads and writes sockets on EventEngine threads, which hand
every message to the thread that waits on the completion queue: one more thread wake-up per
message, each way. With the poller, the waiting thread reads the socket itself. On the GPU host
(16 cores kept awake, `bench/grpc_roundtrip.py`, bidirectional stream) a bare round trip took
0.198 ms against 0.236, and the verifier's batch-1 step lost its slow tail (p90 4.2-4.4 ms against
6.3-7.3 at a 3.5 ms forward, `bench/verifier_service.py`; BENCHMARKS.md, seventh round).

It is gRPC's own switch (`GRPC_EXPERIMENTS`, turning four EventEngine experiments off), applied
only to the grpcio releases where Python uses the EventEngine and these experiments exist (1.80
to 1.84; the project pins 1.84). A `GRPC_EXPERIMENTS` already in the environment, even an empty
one, is left as it is: set it to "" to run on gRPC's defaults.

Ray links a gRPC core of its own, an older one that does not know two of these names and logs an
error line for each when it starts. `hidden_from_ray()` keeps the setting from it: Ray's processes
start without it, and a Ray worker that imports treeserve sets it again for its own grpcio (Ray's
workers do not load grpcio themselves).
"""
from __future__ import annotations

import contextlib
import os
from importlib import metadata
from typing import Iterator, MutableMapping

EXPERIMENTS = "GRPC_EXPERIMENTS"
POLLER_NOT_EVENT_ENGINE = ",".join(
    "-" + name
    for name in ("event_engine_client", "event_engine_listener", "event_engine_callback_cq",
                 "event_engine_for_all_other_endpoints")
)
RELEASES = ((1, 80), (1, 84))  # first and last grpcio (major, minor) the setting applies to


def grpcio_version() -> str | None:
    """The installed grpcio's version, read without loading it (None when it is not installed)."""
    try:
        return metadata.version("grpcio")
    except metadata.PackageNotFoundError:
        return None


def applies_to(version: str | None) -> bool:
    if version is None:
        return False
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    return RELEASES[0] <= (major, minor) <= RELEASES[1]


def set_defaults(environ: MutableMapping[str, str] = os.environ, version: str | None = None) -> None:
    """Put treeserve's gRPC settings into `environ` unless it chose its own. `version`: grpcio's
    (default: the installed one)."""
    if EXPERIMENTS in environ:
        return
    if applies_to(version if version is not None else grpcio_version()):
        environ[EXPERIMENTS] = POLLER_NOT_EVENT_ENGINE


@contextlib.contextmanager
def hidden_from_ray(environ: MutableMapping[str, str] = os.environ) -> Iterator[None]:
    """Within: treeserve's own setting is out of `environ`, so that processes started meanwhile
    (Ray's, with their own gRPC core) start without it; a user's own GRPC_EXPERIMENTS stays."""
    ours = environ.get(EXPERIMENTS) == POLLER_NOT_EVENT_ENGINE
    if ours:
        del environ[EXPERIMENTS]
    try:
        yield
    finally:
        if ours:
            environ[EXPERIMENTS] = POLLER_NOT_EVENT_ENGINE
