"""Byte-level BPE tokenizer trained on the corpus, saved in Hugging Face format.

Byte-level pre-tokenisation with no normaliser makes ``decode(encode(x)) == x`` for any text.
The single special token ``<|endoftext|>`` (id 0) separates documents and doubles as BOS, EOS,
PAD and UNK, so every id the models see is either a byte-pair or the separator.

``train_tokenizer(corpus_dir, out_dir, vocab_size=4096)`` writes ``tokenizer.json``,
``tokenizer_config.json`` and ``special_tokens_map.json``; ``AutoTokenizer.from_pretrained(out_dir)``
loads it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from models.training.corpus import EOT

DEFAULT_VOCAB = 4096
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def iter_documents(path: Path, max_bytes: int | None = None) -> Iterator[str]:
    """Documents of a corpus split file, in order, stopping after about ``max_bytes`` characters."""
    with open(path, encoding="utf-8", newline="") as fh:
        text = fh.read() if max_bytes is None else fh.read(max_bytes)
    yield from (doc for doc in text.split(EOT) if doc)


def build_bpe(documents: Iterator[str], vocab_size: int = DEFAULT_VOCAB, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE ``Tokenizer`` (the ``tokenizers`` object) on ``documents``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents, trainer=trainer)
    return tok


def save_hf(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 4096) -> Path:
    """Write the tokenizer as a Hugging Face fast tokenizer directory."""
    from transformers import PreTrainedTokenizerFast

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        unk_token=EOT,
        pad_token=EOT,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(out))
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT, "pad_token": EOT}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return out


def train_tokenizer(corpus_dir: str | Path, out_dir: str | Path, vocab_size: int = DEFAULT_VOCAB,
                    max_bytes: int | None = 24 * 2**20) -> Path:
    """Train on (a prefix of) ``corpus_dir/train.txt`` and save to ``out_dir``.

    The corpus is already in hash order, so a prefix is an unbiased sample.
    """
    tok = build_bpe(iter_documents(Path(corpus_dir) / "train.txt", max_bytes), vocab_size)
    return save_hf(tok, out_dir)


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def tokenizer_sha256(path: str | Path) -> str:
    """Identity of a saved tokenizer: SHA-256 of its tokenizer.json."""
    return hashlib.sha256((Path(path) / "tokenizer.json").read_bytes()).hexdigest()


def copy_tokenizer(src: str | Path, dst: str | Path) -> None:
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        f = Path(src) / name
        if f.exists():
            (dst / name).write_bytes(f.read_bytes())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="train a byte-level BPE tokenizer on a corpus directory")
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB)
    ap.add_argument("--max-bytes", type=int, default=24 * 2**20, help="train on this prefix of train.txt")
    args = ap.parse_args(argv)
    out = train_tokenizer(args.corpus, args.out, args.vocab_size, args.max_bytes)
    print(f"tokenizer: vocab {args.vocab_size}, sha256 {tokenizer_sha256(out)[:16]} -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
