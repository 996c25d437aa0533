"""Token streams, their cache, training windows and validation windows; make_pair's preparation."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from models.training.corpus import EOT
from models.training.data import WindowSampler, encode_split, validation_windows
from models.training.tokenizer import load_tokenizer


def test_stream_is_documents_joined_by_eot_and_cached(small_corpus, small_tokenizer):
    stream = encode_split(small_corpus, small_tokenizer, "valid")
    assert stream.dtype == np.uint16
    cached = list((small_corpus / "tokens").glob("*.valid.npy"))
    assert len(cached) == 1
    np.testing.assert_array_equal(np.load(cached[0]), stream)
    tok = load_tokenizer(small_tokenizer)
    docs = [d for d in (small_corpus / "valid.txt").read_text().split(EOT) if d]
    assert int((stream == 0).sum()) == len(docs) and stream[-1] == 0
    assert tok.decode(stream.tolist()) == "".join(d + EOT for d in docs)
    np.testing.assert_array_equal(encode_split(small_corpus, small_tokenizer, "valid"), stream)


def test_windows_are_seeded_and_in_range():
    stream = np.arange(1000, dtype=np.uint16)
    a, b = WindowSampler(stream, 16, seed=5), WindowSampler(stream, 16, seed=5)
    wa, wb = a.next(4), b.next(4)
    assert wa.shape == (4, 17) and (wa == wb).all()
    assert ((wa[:, 1:] - wa[:, :-1]) == 1).all()  # contiguous slices of the stream
    assert not (WindowSampler(stream, 16, seed=6).next(4) == wa).all()


def test_validation_windows_cover_stream_once():
    stream = np.arange(100, dtype=np.uint16)
    w = validation_windows(stream, 10, max_tokens=45)
    assert w.shape == (4, 11)
    assert w[1:, 0].tolist() == w[:-1, -1].tolist()  # one-token overlap: each target scored once
    short = validation_windows(np.arange(5, dtype=np.uint16), 10, max_tokens=100)
    assert short.shape == (1, 5)
    with pytest.raises(ValueError):
        validation_windows(np.zeros(1, dtype=np.uint16), 10, 100)


def test_make_pair_prepare_only_reuses_corpus(small_corpus, tmp_path):
    from models.training.make_pair import make_pair

    shutil.copytree(small_corpus, tmp_path / "corpus", ignore=shutil.ignore_patterns("tokens"))
    summary = make_pair("tiny", tmp_path, minutes=1.0, device="cpu", vocab_size=300, prepare_only=True)
    manifest = json.loads((small_corpus / "manifest.json").read_text())
    assert summary["corpus"]["corpus_sha256"] == manifest["corpus_sha256"]
    assert (tmp_path / "tokenizer" / "tokenizer.json").exists()
    assert len(list((tmp_path / "corpus" / "tokens").glob("*.npy"))) == 2
    assert summary["train_tokens"] > summary["valid_tokens"] > 0
