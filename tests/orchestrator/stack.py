"""Real service processes for the orchestrator tests, and plain decoding to compare against."""
from __future__ import annotations

import threading
import time
from typing import Optional, Sequence

import grpc
import torch

from orchestrator.client import GenerationClient, request
from orchestrator.procs import Child, free_port, stop_all
from treeserve.sampling import Sampling
from treeserve.server import channel
from treeserve.v1 import treeserve_pb2 as pb
from treeserve.v1 import treeserve_pb2_grpc as pbg
from verifier_service.results import choose

MAX_SEQUENCE_LENGTH = 512
MAX_TREE_NODES = 32
STARTUP_S = 300.0
PROMPT_TEXT = "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n\ndef add(a, b):\n"


def verifier(model_dir, port: int = 0, max_sequences: int = 6, prefix: Sequence[str] = (), host: str = "127.0.0.1",
             name: str = "verifier", extra: Sequence[str] = ()) -> Child:
    return Child(["verifier", "--model", model_dir, "--device", "cpu", "--host", host, "--port", port,
                  "--max-sequences", max_sequences, "--max-tree-nodes", MAX_TREE_NODES,
                  "--max-sequence-length", MAX_SEQUENCE_LENGTH, "--batch-window-ms", "1", *extra], name, prefix=prefix)


def drafter(model_dir=None, port: int = 0, prefix: Sequence[str] = (), host: str = "127.0.0.1",
            extra: Sequence[str] = ()) -> Child:
    source = ["--ngram"] if model_dir is None else ["--model", model_dir]
    return Child(["drafter", *source, "--host", host, "--port", port, "--node-budget", "8", "--max-depth", "4",
                  "--max-sequences", "16", "--ahead-trees", "2", "--ahead-fanout", "2", *extra], "drafter",
                 prefix=prefix)


def orchestrator(verifiers: Sequence[str], drafter_address: Optional[str], tokenizer=None, *extra,
                 prefix: Sequence[str] = ()) -> Child:
    # DEBUG: the log (a temp file named in failures) then shows every step's trees and answers
    # bounds far above any healthy wait: a slow draft on a busy machine must not make the link
    # lag (steps would then verify without trees), nor a restart outlast its replica's timeout
    args = ["--log-level", "DEBUG", "orchestrator", "--port", "0", "--draft-timeout-ms", "60000",
            "--replica-timeout-s", str(int(STARTUP_S))]
    for v in verifiers:
        args += ["--verifier", v]
    if drafter_address:
        args += ["--drafter", drafter_address]
    if tokenizer is not None:
        args += ["--tokenizer", tokenizer]
    return Child([*args, *extra], "orchestrator", prefix=prefix)


class RayHead:
    """A one-node Ray cluster started like a deployment's head node (`ray start --head`), bound
    to this test: SIGKILL of its process group ends it (its workers exit with the raylet)."""

    def __init__(self):
        import os
        import subprocess
        import sys

        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        self.log_path = f"/tmp/treeserve-rayhead-{os.getpid()}-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [ray_cli, "start", "--head", "--block", "--port", str(self.port), "--node-ip-address", "127.0.0.1",
             "--num-cpus", "1", "--include-dashboard=false", "--disable-usage-stats"],
            stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
            env=dict(os.environ, RAY_AUTH_MODE="disabled"))

    def wait(self, timeout: float = STARTUP_S) -> str:
        import socket

        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray head exited: {open(self.log_path, errors='replace').read()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return self.address
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("ray head did not start")
                time.sleep(0.3)

    def stop(self) -> None:
        import os
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self._log.close()


def treeserve(*args: str, timeout: float = 120.0) -> str:
    """Run a `treeserve` command to completion; returns its stdout."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "treeserve.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, f"treeserve {' '.join(map(str, args))} failed:\n{r.stdout}\n{r.stderr[-3000:]}"
    return r.stdout


def start(children: Sequence[Child]) -> list[str]:
    """Wait for every child; on failure stop them all and re-raise."""
    try:
        return [c.wait(STARTUP_S) for c in children]
    except BaseException:
        stop_all(children)
        raise


class Reference:
    """Plain decoding with the model runtime: the output speculation must reproduce."""

    def __init__(self, model_dir):
        from models import HybridLM

        self.lm = HybridLM.from_pretrained(model_dir, max_slots=2, max_len=MAX_SEQUENCE_LENGTH)
        self.eos = {0}
        self._lock = threading.Lock()
        self._cache: dict = {}

    def generate(self, prompt: Sequence[int], n: int, s: Sampling = Sampling()) -> list[int]:
        """The first n tokens after the prompt (stopping before EOS), sampled as the verifier does:
        the token at absolute position t is `choose(logits, s, t)`."""
        key = (tuple(prompt), n, s)
        with self._lock:
            if key in self._cache:
                return self._cache[key]
            lm = self.lm
            slot = lm.pool.alloc()
            try:
                out: list[int] = []
                logits = lm.prefill([slot], [list(prompt)])
                while len(out) < n:
                    pos = torch.tensor([len(prompt) + len(out)])
                    tok = int(choose(logits[:1], s, pos)[0])
                    if tok in self.eos:
                        break
                    out.append(tok)
                    if len(out) < n:
                        logits = lm.decode([slot], [tok])
            finally:
                lm.pool.free(slot)
            self._cache[key] = out
            return out


def verifier_stats(address: str):
    with channel(address) as ch:
        return pbg.VerifierStub(ch).Stats(pb.StatsRequest(), timeout=10)


def drafter_stats(address: str):
    with channel(address) as ch:
        return pbg.DrafterStub(ch).Stats(pb.StatsRequest(), timeout=10)


def wait_until(predicate, timeout: float = 15.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


class Background:
    """A Generate stream consumed in a thread: `messages` grows as they arrive."""

    def __init__(self, client: GenerationClient, req, on_message=None):
        self.messages: list = []
        self.error: Optional[grpc.RpcError] = None
        self.call = client.stream(req, timeout=300)
        self._on_message = on_message
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        try:
            for msg in self.call:
                self.messages.append(msg)
                if self._on_message is not None:
                    self._on_message(self)
        except grpc.RpcError as exc:
            self.error = exc

    @property
    def token_ids(self) -> list[int]:
        return [t for m in self.messages for t in m.token_ids]

    @property
    def finished(self) -> bool:
        return bool(self.messages) and self.messages[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED

    def join(self, timeout: float = 300.0):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "stream did not end"
        return self


__all__ = ["request", "free_port", "GenerationClient"]
