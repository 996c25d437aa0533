"""Joining or starting the Ray cluster a deployment's actors live in (light: no model code)."""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Optional

GCS_PORT_WAIT = "RAY_gcs_server_port_wait_time_s"
GCS_PORT_WAIT_S = 120


def init_ray(address: Optional[str], namespace: str, quiet: bool = False) -> None:
    """`quiet`: keep Ray's own messages and the actors' logs off this process's output."""
    import ray

    if ray.is_initialized():
        return
    from treeserve import grpc_env

    extra = dict(log_to_driver=not quiet, logging_level=logging.WARNING if quiet else logging.INFO)
    if address is not None:
        _wait_for_head(address)
    with grpc_env.hidden_from_ray():  # Ray's own gRPC core would log our setting's names as unknown
        if address is None:
            # Ray gives its GCS 30 s to publish its port; a small machine loading models beside it
            # can need more (seen on 2 busy cores). An operator's own setting wins.
            os.environ.setdefault(GCS_PORT_WAIT, str(GCS_PORT_WAIT_S))
            ray.init(address="local", include_dashboard=False, num_cpus=1, _node_ip_address="127.0.0.1",
                     namespace=namespace, object_store_memory=96 * 1024 * 1024, **extra)
        else:
            ray.init(address=address, namespace=namespace, **extra)


def _wait_for_head(address: str, timeout: float = 180.0) -> None:
    """Wait until the head's GCS port accepts connections (joining a head that is not up yet
    blocks for minutes inside Ray); e.g. when the head and the orchestrator start together."""
    if address == "auto" or ":" not in address:
        return
    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no Ray head answers at {address} after {timeout:.0f} s") from None
            time.sleep(0.5)
