"""Token streams for training: tokenise a corpus split once, cache it, cut it into windows.

A split becomes one ``uint16`` stream ``doc₀ EOT doc₁ EOT …``. The cache lives in
``<corpus>/tokens/`` and is keyed by the tokenizer's SHA-256, so changing either input re-tokenises.
Training windows start at seeded random offsets; validation windows are the first
``val_tokens`` of the held-out stream cut into contiguous pieces, so every run of a given
corpus/tokenizer pair scores on exactly the same tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from models.training.corpus import EOT
from models.training.tokenizer import tokenizer_sha256

_BATCH_CHARS = 4 * 2**20  # text per encode call: bounds the memory of tokenizers' Encoding objects


def encode_split(corpus_dir: str | Path, tokenizer_dir: str | Path, split: str) -> np.ndarray:
    """``(n,) uint16`` token stream of ``<corpus>/<split>.txt``, from the cache when present."""
    from tokenizers import Tokenizer

    corpus_dir, tokenizer_dir = Path(corpus_dir), Path(tokenizer_dir)
    cache = corpus_dir / "tokens" / f"{tokenizer_sha256(tokenizer_dir)[:16]}.{split}.npy"
    if cache.exists():
        return np.load(cache, mmap_mode="r")
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    if tok.get_vocab_size() > 2**16:
        raise ValueError("token cache stores uint16 ids: vocabulary must be at most 65536")
    eot = tok.token_to_id(EOT)
    docs = [d for d in (corpus_dir / f"{split}.txt").read_text(encoding="utf-8").split(EOT) if d]
    pieces: list[np.ndarray] = []
    batch: list[str] = []
    size = 0
    for i, doc in enumerate(docs):
        batch.append(doc)
        size += len(doc)
        if size >= _BATCH_CHARS or i == len(docs) - 1:
            for enc in tok.encode_batch_fast(batch, add_special_tokens=False):
                pieces.append(np.asarray(enc.ids + [eot], dtype=np.uint16))
            batch, size = [], 0
    stream = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)
    try:
        cache.parent.mkdir(exist_ok=True)
        tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as fh:
            np.save(fh, stream)
        os.replace(tmp, cache)  # atomic: concurrent trainers may race to write the same cache
    except OSError:
        pass  # read-only corpus: just do not cache
    return stream


class WindowSampler:
    """Random ``(batch, seq_len + 1)`` windows of a token stream, reproducible from ``seed``."""

    def __init__(self, stream: np.ndarray, seq_len: int, seed: int):
        if len(stream) < seq_len + 2:
            raise ValueError(f"token stream of {len(stream)} tokens is shorter than one window ({seq_len + 1})")
        self.stream = stream
        self.seq_len = seq_len
        self.rng = np.random.default_rng(seed)

    def next(self, batch: int) -> torch.Tensor:
        """``(batch, seq_len + 1)`` int64 token ids."""
        starts = self.rng.integers(0, len(self.stream) - self.seq_len - 1, size=batch)
        idx = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        return torch.from_numpy(np.asarray(self.stream[idx], dtype=np.int64))


def validation_windows(stream: np.ndarray, seq_len: int, max_tokens: int) -> torch.Tensor:
    """``(n, seq_len + 1)`` int64: contiguous windows from the start of the held-out stream.

    Consecutive windows overlap by one token so that every covered position is predicted once.
    A stream shorter than one window gives a single shorter window.
    """
    if len(stream) < 2:
        raise ValueError(f"validation stream of {len(stream)} tokens has nothing to predict")
    seq_len = min(seq_len, len(stream) - 1)
    n = max(min(max_tokens, len(stream) - 1) // seq_len, 1)
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(np.asarray(stream[idx], dtype=np.int64))
