"""Trimmed draft vocabulary: the target tokens a draft model may propose, chosen by frequency.

A large-vocabulary drafter spends much of each draft step in its LM head (one row of weights per
token). Most of those tokens are rare, so the drafter can compute logits over the most frequent
ones only: a smaller matmul and smaller softmax / top-k per tree level. Drafted distributions
are then zero outside the kept set, which speculative acceptance handles exactly (a token the draft
never proposes is simply never accepted as a draft; the target still emits it as a bonus).

The kept set is counted from text with the drafter's tokenizer and stored as a small JSON file,
conventionally `vocab_subset.json` inside or beside the draft checkpoint:

    {"format": "treeserve.draft-vocab", "version": 1, "vocab_size": 4096,
     "tokenizer_sha256": "…", "special_ids": [0], "ids": [most frequent first, …],
     "counted_tokens": 46273313, "coverage": 0.9987}

Special tokens (end of text and the tokenizer's other specials) are always kept.

CLI (also `treeserve trim-vocab`):

    python -m drafter_service.vocab --tokenizer models/demo/drafter --text CORPUS_DIR \\
        --size 2048 --out models/demo/drafter/vocab_subset.json
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import pathlib
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import numpy as np

FORMAT = "treeserve.draft-vocab"
VERSION = 1
DEFAULT_NAME = "vocab_subset.json"
DEFAULT_GLOBS = ("*.txt", "*.py")
_CHUNK_CHARS = 1 << 20  # tokenised in pieces of about this many characters (line-aligned)


class VocabFileError(ValueError):
    """A trimmed-vocabulary file that cannot be used (malformed, or for another tokenizer/model)."""


@dataclass(frozen=True)
class TrimmedVocab:
    """The kept token ids, most frequent first, and what they were counted with.

    ids: kept ids (distinct, each in [0, vocab_size)), special ids included.
    vocab_size: size of the id space of the tokenizer the counts were made with.
    tokenizer_sha256: fingerprint of that tokenizer's vocabulary (`tokenizer_fingerprint`), so a
    file is not used with a draft model whose tokenizer numbers tokens differently.
    counted_tokens / coverage: tokens counted, and the share of them that are kept ids.
    """

    ids: tuple[int, ...]
    vocab_size: int
    special_ids: tuple[int, ...] = ()
    tokenizer_sha256: str | None = None
    counted_tokens: int = 0
    coverage: float | None = None

    def __post_init__(self):
        problem = self._problem()
        if problem:
            raise VocabFileError(problem)

    def _problem(self) -> str | None:
        if self.vocab_size < 1:
            return f"vocab_size must be positive, got {self.vocab_size}"
        if not self.ids:
            return "no token ids are kept"
        bad = [t for t in self.ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"token id {bad[0]} outside the vocabulary [0, {self.vocab_size})"
        if len(set(self.ids)) != len(self.ids):
            return "token ids are listed more than once"
        missing = sorted(set(self.special_ids) - set(self.ids))
        if missing:
            return f"special token ids {missing} are not kept"
        return None

    def __len__(self) -> int:
        return len(self.ids)

    # ---- file ---------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "vocab_size": self.vocab_size,
                "tokenizer_sha256": self.tokenizer_sha256, "special_ids": list(self.special_ids),
                "counted_tokens": self.counted_tokens, "coverage": self.coverage, "ids": list(self.ids)}

    def save(self, path: str | os.PathLike) -> pathlib.Path:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), separators=(",", ":")) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> "TrimmedVocab":
        """Read a file written by `save`; a directory means its `vocab_subset.json`."""
        path = pathlib.Path(path)
        if path.is_dir():
            path = path / DEFAULT_NAME
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise VocabFileError(f"{path}: no such trimmed-vocabulary file") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise VocabFileError(f"{path}: not a readable JSON file ({exc})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise VocabFileError(f"{path}: not a trimmed-vocabulary file (expected \"format\": \"{FORMAT}\"); "
                                 "build one with `treeserve trim-vocab`")
        if data.get("version") != VERSION:
            raise VocabFileError(f"{path}: version {data.get('version')!r} is not supported (this build reads "
                                 f"version {VERSION})")
        try:
            ids = _int_list(data["ids"], "ids")
            specials = _int_list(data.get("special_ids", []), "special_ids")
            vocab_size = int(data["vocab_size"])
            sha = data.get("tokenizer_sha256")
            coverage = data.get("coverage")
            return cls(ids, vocab_size, specials, None if sha is None else str(sha),
                       int(data.get("counted_tokens", 0)), None if coverage is None else float(coverage))
        except KeyError as exc:
            raise VocabFileError(f"{path}: missing field {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise VocabFileError(f"{path}: {exc}") from None

    def describe(self) -> str:
        cover = f", {self.coverage:.2%} of {self.counted_tokens:,} counted tokens" if self.coverage is not None else ""
        return f"{len(self.ids)} of {self.vocab_size} token ids kept{cover}"


def _int_list(value, name: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"{name!r} must be a list of integers")
    return tuple(value)


# ---- counting -------------------------------------------------------------------------------------
def tokenizer_fingerprint(tokenizer) -> str:
    """SHA-256 of the tokenizer's token -> id table (added tokens included)."""
    table = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(table, ensure_ascii=False).encode()).hexdigest()


def special_ids(tokenizer) -> tuple[int, ...]:
    """End-of-text and every other special token of the tokenizer."""
    ids = set(int(i) for i in getattr(tokenizer, "all_special_ids", []) or [])
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is not None:
        ids.add(int(eos))
    return tuple(sorted(ids))


def text_files(sources: Sequence[str | os.PathLike], globs: Sequence[str] = DEFAULT_GLOBS) -> list[pathlib.Path]:
    """Files named directly, and files under directories whose names match one of `globs`, in a
    fixed order (so the same inputs always give the same counts)."""
    out: list[pathlib.Path] = []
    for src in sources:
        path = pathlib.Path(src)
        if path.is_file():
            out.append(path)
        elif path.is_dir():
            found = [p for p in path.rglob("*") if p.is_file() and any(fnmatch.fnmatch(p.name, g) for g in globs)]
            out += sorted(found)
        else:
            raise FileNotFoundError(f"{path}: no such file or directory")
    return out


def _pieces(files: Iterable[pathlib.Path], max_chars: int | None) -> Iterator[str]:
    """The files' text in line-aligned pieces of about `_CHUNK_CHARS` characters."""
    left = max_chars
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if left is not None:
            text, left = text[:left], left - min(left, len(text))
        start = 0
        while start < len(text):
            end = min(len(text), start + _CHUNK_CHARS)
            if end < len(text):
                nl = text.rfind("\n", start, end)
                end = nl + 1 if nl > start else end
            yield text[start:end]
            start = end
        if left == 0:
            return


def count_tokens(tokenizer, files: Iterable[pathlib.Path], max_chars: int | None = None,
                 batch: int = 16) -> np.ndarray:
    """(len(tokenizer),) int64 occurrence count of every token id in the files' text."""
    counts = np.zeros(len(tokenizer), dtype=np.int64)

    def add(pieces: list[str]) -> None:
        for ids in tokenizer(pieces, add_special_tokens=False, verbose=False)["input_ids"]:
            if ids:
                counts[:] += np.bincount(np.asarray(ids, dtype=np.int64), minlength=len(counts))[: len(counts)]

    pending: list[str] = []
    for piece in _pieces(files, max_chars):
        pending.append(piece)
        if len(pending) >= batch:
            add(pending)
            pending = []
    if pending:
        add(pending)
    return counts


def select(counts: np.ndarray, specials: Sequence[int] = (), size: int | None = None,
           coverage: float | None = None) -> tuple[tuple[int, ...], float]:
    """Kept ids (most frequent first; ties by id) and the share of counted tokens they cover.

    size: keep the `size` most frequent tokens that occur at all; coverage: keep the fewest most
    frequent tokens whose counts reach that share. Special ids are added either way."""
    if (size is None) == (coverage is None):
        raise ValueError("give exactly one of size and coverage")
    total = int(counts.sum())
    if total == 0:
        raise ValueError("no tokens were counted (empty text?)")
    seen = np.flatnonzero(counts > 0)
    order = seen[np.lexsort((seen, -counts[seen]))]
    if size is not None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        n = min(size, len(order))
    else:
        if not 0.0 < coverage <= 1.0:
            raise ValueError(f"coverage must be in (0, 1], got {coverage}")
        cum = np.cumsum(counts[order])
        n = int(np.searchsorted(cum, coverage * total - 1e-9 * total)) + 1
        n = min(n, len(order))
    def freq(t: int) -> int:
        return int(counts[t]) if t < len(counts) else 0

    kept = sorted({int(t) for t in order[:n]} | {int(t) for t in specials}, key=lambda t: (-freq(t), t))
    return tuple(kept), sum(freq(t) for t in kept) / total


def build(tokenizer, sources: Sequence[str | os.PathLike], size: int | None = None, coverage: float | None = None,
          globs: Sequence[str] = DEFAULT_GLOBS, max_chars: int | None = None) -> TrimmedVocab:
    """Count the tokens of the text under `sources` and keep the most frequent (see `select`)."""
    files = text_files(sources, globs)
    if not files:
        raise ValueError(f"no text files found under {', '.join(str(s) for s in sources)} (globs {list(globs)})")
    counts = count_tokens(tokenizer, files, max_chars)
    specials = special_ids(tokenizer)
    ids, covered = select(counts, specials, size, coverage)
    return TrimmedVocab(ids, len(tokenizer), specials, tokenizer_fingerprint(tokenizer), int(counts.sum()),
                        round(covered, 6))


# ---- command line ---------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", required=True,
                   help="tokenizer directory (Hugging Face format), usually the draft checkpoint")
    p.add_argument("--text", nargs="+", required=True,
                   help="text files, or directories searched for files matching --glob (e.g. a corpus built by "
                        "models.training.corpus: its train.txt)")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--size", type=int, help="keep this many of the most frequent tokens (special tokens added)")
    how.add_argument("--coverage", type=float,
                     help="keep the fewest most frequent tokens that make up this share of the text (e.g. 0.99)")
    p.add_argument("--glob", action="append", default=None,
                   help=f"file-name pattern inside directories (repeatable; default {' '.join(DEFAULT_GLOBS)})")
    p.add_argument("--max-chars", type=int, default=None, help="count at most this many characters of text")
    p.add_argument("--out", required=True, help=f"output file (conventionally {DEFAULT_NAME} beside the checkpoint)")


def run(args: argparse.Namespace) -> int:
    from models.loading import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    if tok is None:
        raise SystemExit(f"--tokenizer {args.tokenizer}: no tokenizer files there")
    try:
        vocab = build(tok, args.text, args.size, args.coverage, tuple(args.glob or DEFAULT_GLOBS), args.max_chars)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"trim-vocab: {exc}") from None
    out = vocab.save(args.out)
    print(f"{out}: {vocab.describe()}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m drafter_service.vocab", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
