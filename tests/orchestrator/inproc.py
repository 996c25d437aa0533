"""A verifier served from the test's own process (one model, one batcher, a gRPC server), and a
TCP proxy in front of a server that can cut every open connection once: a network blip.

Engines in this process, or in Ray workers, talk to them over real sockets; the test reads the
verifier's sequence count directly (`LocalVerifier.active`)."""
from __future__ import annotations

import socket
import threading


class LocalVerifier:
    """`verifier_service.servicer.VerifierServer` on the tiny target, in this process."""

    def __init__(self, model_dir, max_sequences: int = 4, max_tree_nodes: int = 8, max_sequence_length: int = 128):
        from models import HybridLM
        from verifier_service.limits import Limits
        from verifier_service.servicer import ModelInfo, VerifierServer

        limits = Limits(max_sequences=max_sequences, max_tree_nodes=max_tree_nodes,
                        max_sequence_length=max_sequence_length, batch_window_ms=1).validate()
        lm = HybridLM.from_pretrained(model_dir, max_slots=limits.max_sequences, max_len=limits.max_sequence_length)
        self._server = VerifierServer(lm, limits, "127.0.0.1:0", ModelInfo("target", "cpu", (0,)))
        self.port = self._server.port
        self.address = f"127.0.0.1:{self.port}"

    def active(self) -> int:
        """Sequences the verifier holds now (slots in use)."""
        return len(self._server.engine.table)

    def stop(self) -> None:
        self._server.stop()


class CuttingProxy:
    """Forwards TCP connections from `address` to `target`; `cut()` closes every connection open
    now, and later connections are forwarded again."""

    def __init__(self, target_port: int):
        self._target = ("127.0.0.1", target_port)
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.cuts = 0
        threading.Thread(target=self._accept, name="proxy", daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            doomed, self._open = self._open, []
            self.cuts += 1
        for s in doomed:
            _close(s)

    def stop(self) -> None:
        _close(self._listener)
        self.cut()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # stopped
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._open += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    _close(src)
    _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()
