"""Hybrid-model runtime: load a Hugging Face checkpoint (Mamba2, NemotronH, Bamba, GraniteMoeHybrid,
FalconH1, Zamba2), keep per-sequence state in slots, and run batched prefill / decode / tree verification /
commit (docs/internals.md).

Names are imported on first use, so `import models.<submodule>` stays light.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "HybridLM": "models.runtime",
    "StatePool": "models.state",
    "Pending": "models.verify",
    "VerifyResult": "models.verify",
    "HybridConfig": "models.config",
    "MambaSpec": "models.config",
    "AttentionSpec": "models.config",
    "MLPSpec": "models.config",
    "MoESpec": "models.config",
    "ParallelSpec": "models.config",
    "SharedAttentionSpec": "models.config",
    "CheckpointError": "models.errors",
    "SequenceTooLong": "models.errors",
    "SlotsExhausted": "models.errors",
    "StaleHandle": "models.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
