"""One module per supported architecture: config normalisation and checkpoint weight names.

Each module offers `MODEL_TYPES`, `normalise(hf_config, path) -> HybridConfig`,
`checkpoint_key(name) -> name` (aliases of published checkpoints) and
`weight_map(config, available) -> {runtime parameter: Source}`.
"""
from __future__ import annotations

from types import ModuleType

from models.arch import bamba, falcon_h1, granitemoehybrid, mamba2, nemotron_h, zamba2

_MODULES: tuple[ModuleType, ...] = (mamba2, nemotron_h, bamba, granitemoehybrid, falcon_h1, zamba2)

ARCHITECTURES: dict[str, ModuleType] = {t: m for m in _MODULES for t in m.MODEL_TYPES}


def supported_model_types() -> list[str]:
    return sorted(ARCHITECTURES)
