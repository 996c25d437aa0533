"""Shared fixtures: one saved checkpoint and transformers model per architecture for the session."""
from __future__ import annotations

import pytest

from tests.models.hf_zoo import make_model

_CACHE: dict[str, tuple] = {}


@pytest.fixture(scope="session")
def saved(tmp_path_factory):
    """saved(arch) -> (checkpoint dir, transformers model), built once per session."""

    def get(arch: str):
        if arch not in _CACHE:
            model = make_model(arch)
            path = tmp_path_factory.mktemp(arch)
            model.save_pretrained(path)
            _CACHE[arch] = (path, model)
        return _CACHE[arch]

    return get
