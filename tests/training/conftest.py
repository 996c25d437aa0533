"""Shared fixtures: one small real corpus (from stdlib packages) and a tokenizer trained on it."""
from __future__ import annotations

import sysconfig
from pathlib import Path

import pytest

from models.training.corpus import CorpusSettings, build_corpus
from models.training.tokenizer import train_tokenizer

TINY_VOCAB = 384


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory) -> Path:
    """~0.5 MB of real Python (json, email, asyncio from the running stdlib), no syntax check."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path_factory.mktemp("training") / "corpus"
    sources = [(name, stdlib / name) for name in ("json", "email", "asyncio")]
    build_corpus(out, CorpusSettings(max_bytes=600_000, valid_permille=60), sources, workers=1)
    return out


@pytest.fixture(scope="session")
def small_tokenizer(small_corpus) -> Path:
    return train_tokenizer(small_corpus, small_corpus.parent / "tokenizer", vocab_size=TINY_VOCAB)
