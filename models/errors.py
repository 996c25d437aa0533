"""Errors the model runtime raises: each names what went wrong and where."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint directory cannot be loaded: unsupported architecture, missing or mis-shaped tensor.

    `path` is the file (or directory) and `tensor` the tensor name involved, when there is one.
    """

    def __init__(self, message: str, path: str | None = None, tensor: str | None = None):
        where = []
        if path is not None:
            where.append(f"file {path}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.path = path
        self.tensor = tensor


class SlotsExhausted(RuntimeError):
    """Every state slot is in use; free one (or build the model with more `max_slots`)."""


class SequenceTooLong(ValueError):
    """A prompt or tree would take a sequence past the pool's `max_len`."""


class StaleHandle(ValueError):
    """A commit names a verification whose slot has changed since (already committed, decoded, freed...)."""
