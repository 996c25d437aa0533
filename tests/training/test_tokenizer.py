"""Byte-level BPE: exact round trip, Hugging Face loading, deterministic training."""
from __future__ import annotations

import pytest

from models.training.corpus import EOT
from models.training.tokenizer import build_bpe, load_tokenizer, tokenizer_sha256, train_tokenizer

from .conftest import TINY_VOCAB

SAMPLES = [
    "def f(x):\n    return x ** 2\n",
    "class A:\n\tpass\r\n\r\n",  # tabs and CRLF survive
    "s = 'naïve café — 東京 🐍'\n",
    "    \n\n   trailing   ",
    "",
    f"a = 1{EOT}b = 2",
    "x = '\\x00\\u2028'  # escapes stay text\n",
]


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(small_tokenizer, text):
    tok = load_tokenizer(small_tokenizer)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False) == text


def test_round_trip_on_held_out_corpus(small_corpus, small_tokenizer):
    tok = load_tokenizer(small_tokenizer)
    text = (small_corpus / "valid.txt").read_text()[:20000].replace(EOT, "")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    assert len(text) / len(ids) > 1.4  # merges learned something about Python


def test_auto_tokenizer_files_and_special_tokens(small_tokenizer):
    from transformers import AutoTokenizer

    names = {p.name for p in small_tokenizer.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= names
    tok = AutoTokenizer.from_pretrained(str(small_tokenizer))
    assert len(tok) == TINY_VOCAB
    assert tok.eos_token == EOT and tok.eos_token_id == 0 and tok.pad_token_id == 0
    assert tok(EOT, add_special_tokens=False)["input_ids"] == [0]


def test_training_is_deterministic(small_corpus, tmp_path):
    a = train_tokenizer(small_corpus, tmp_path / "a", vocab_size=300)
    b = train_tokenizer(small_corpus, tmp_path / "b", vocab_size=300)
    assert tokenizer_sha256(a) == tokenizer_sha256(b)


def test_vocab_size_is_configurable():
    docs = ["def add(a, b):\n    return a + b\n"] * 50 + ["import os\nprint(os.getcwd())\n"] * 50
    tok = build_bpe(iter(docs), vocab_size=280)
    assert 257 < tok.get_vocab_size() <= 280
