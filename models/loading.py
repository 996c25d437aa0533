"""Reading a Hugging Face checkpoint directory: config, safetensors weights, tokenizer.

Nothing is ever downloaded: the directory must hold `config.json` and `*.safetensors`. Every
runtime parameter is built from the checkpoint tensors its architecture module names, with each
tensor's presence and shape checked (a `CheckpointError` names the file and tensor otherwise).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Mapping

import torch

from models.arch import ARCHITECTURES, supported_model_types
from models.arch.common import Source
from models.config import HybridConfig
from models.errors import CheckpointError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def read_config(path: str | os.PathLike):
    """(architecture module, normalised HybridConfig, transformers config) for a checkpoint directory."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError("no config.json in the checkpoint directory", path=str(path))
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"config.json is not valid JSON: {e}", path=str(cfg_file)) from None
    model_type = raw.get("model_type")
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        raise CheckpointError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}",
            path=str(cfg_file),
        )
    from transformers import AutoConfig

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        hf = AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers' own validation (inconsistent sizes, bad fields)
        raise CheckpointError(f"transformers rejects this config: {e}", path=str(cfg_file)) from e
    return arch, normalise(arch, hf, str(cfg_file)), hf


def normalise(arch, hf, where: str = "<config>") -> HybridConfig:
    return arch.normalise(hf, where)


def arch_for(model_type: str):
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        raise CheckpointError(f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}")
    return arch


class TensorSource:
    """Named checkpoint tensors, under their canonical names (`arch.checkpoint_key`)."""

    def __contains__(self, name: str) -> bool:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def where(self, name: str) -> str:
        raise NotImplementedError


class SafetensorsDir(TensorSource):
    """All `*.safetensors` files of a directory, opened lazily (one tensor read at a time)."""

    def __init__(self, path: str | os.PathLike, canonical: Callable[[str], str]):
        from safetensors import safe_open

        self.path = Path(path)
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise CheckpointError("no *.safetensors files in the checkpoint directory", path=str(self.path))
        self._handles = {}
        self._index: dict[str, tuple[Path, str]] = {}
        for f in files:
            try:
                h = safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:
                raise CheckpointError(f"cannot read safetensors file: {e}", path=str(f)) from e
            self._handles[f] = h
            for key in h.keys():
                name = canonical(key)
                if name in self._index:
                    raise CheckpointError(f"tensor stored twice (also in {self._index[name][0].name})", path=str(f), tensor=key)
                self._index[name] = (f, key)

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def get(self, name: str) -> torch.Tensor:
        f, key = self._index[name]
        return self._handles[f].get_tensor(key)

    def where(self, name: str) -> str:
        return str(self._index[name][0]) if name in self._index else str(self.path)


class StateDictSource(TensorSource):
    """An in-memory state dict (e.g. a transformers model's), for benchmarks and tests."""

    def __init__(self, state: Mapping[str, torch.Tensor], canonical: Callable[[str], str], label: str = "<state dict>"):
        self._state = {canonical(k): v for k, v in state.items()}
        self.label = label

    def __contains__(self, name: str) -> bool:
        return name in self._state

    def get(self, name: str) -> torch.Tensor:
        return self._state[name]

    def where(self, name: str) -> str:
        return self.label


def _read(source: TensorSource, name: str, shape) -> torch.Tensor:
    """Checkpoint tensor `name`, checked to be there and of `shape`."""
    if name not in source:
        raise CheckpointError("missing tensor", path=source.where(name), tensor=name)
    t = source.get(name)
    if tuple(t.shape) != tuple(shape):
        raise CheckpointError(
            f"tensor has shape {tuple(t.shape)}, the config implies {tuple(shape)}",
            path=source.where(name),
            tensor=name,
        )
    return t


def gather_weights(
    wmap: Mapping[str, Source], source: TensorSource, target_shapes: Mapping[str, torch.Size]
) -> dict[str, torch.Tensor]:
    """Build every runtime parameter (CPU or source device, source dtype; fp32 where the source
    folds row scales or low-rank adapters in) from its checkpoint tensors."""
    out: dict[str, torch.Tensor] = {}
    for target, src in wmap.items():
        parts = []
        adapters = src.adapters or (None,) * len(src.names)
        for name, shape, adapter in zip(src.names, src.shapes, adapters):
            t = _read(source, name, shape)
            if adapter is not None:  # folded low-rank adapter: in fp32, before the parameter's dtype
                up_shape, down_shape = adapter.shapes(shape)
                up, down = _read(source, adapter.up, up_shape), _read(source, adapter.down, down_shape)
                t = t.float() + up.float() @ down.float()
            parts.append(t)
        if any(adapters):  # every part in fp32, like the adapted ones
            parts = [t.float() for t in parts]
        if len(parts) == 1 and not src.stack:
            w = parts[0]
        else:
            w = torch.stack(parts, 0) if src.stack else torch.cat(parts, 0)
        factors = src.row_factors()
        if factors is not None:  # folded multipliers: in fp32, before the parameter's dtype
            factors = factors.to(w.device).view(-1, *([1] * (w.dim() - 1)))
            w = w.float() * factors
        if target not in target_shapes:
            raise CheckpointError(f"internal error: no runtime parameter {target!r}")
        out[target] = w.reshape(target_shapes[target])
    missing = set(target_shapes) - set(out)
    if missing:
        raise CheckpointError(f"internal error: no checkpoint source for {sorted(missing)}")
    return out


def load_tokenizer(path: str | os.PathLike):
    """`AutoTokenizer` of the directory, or None when it has no tokenizer files."""
    path = Path(path)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
