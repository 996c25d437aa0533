"""Start a real verifier process (CPU) and wait until it serves."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import grpc

from orchestrator.procs import free_port

MAX_SEQUENCES = 12
MAX_TREE_NODES = 16
MAX_SEQUENCE_LENGTH = 192
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class VerifierProcess:
    def __init__(self, model_dir, *extra: str, startup_s: float = 300.0):
        self.metrics_port = free_port()
        cmd = [
            sys.executable, "-m", "treeserve.cli", "verifier", "--model", str(model_dir), "--device", "cpu",
            "--port", "0", "--max-sequences", str(MAX_SEQUENCES), "--max-tree-nodes", str(MAX_TREE_NODES),
            "--max-sequence-length", str(MAX_SEQUENCE_LENGTH), "--metrics-port", str(self.metrics_port), *extra,
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        self.stderr_path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"verifier-{os.getpid()}-{id(self)}.log")
        self._stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.address = self._wait_listening(startup_s)
        self._wait_serving(startup_s)

    def _wait_listening(self, timeout: float) -> str:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not line or not line[0].startswith("verifier listening on "):
            self.stop()
            raise RuntimeError(f"verifier did not start: {line!r}\n{open(self.stderr_path).read()[-4000:]}")
        return line[0].strip().rsplit(" ", 1)[1]

    def _wait_serving(self, timeout: float) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(service="treeserve.v1.Verifier"), timeout=5)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("verifier never reported SERVING")
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._stderr.close()
