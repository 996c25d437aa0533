"""Trimmed draft vocabulary files: counting, selection, the file format, the CLI, and clear errors
for files that do not fit."""
import collections
import json

import numpy as np
import pytest

from drafter_service import vocab as V
from drafter_service.vocab import TrimmedVocab, VocabFileError

TEXTS = {
    "a.py": "def add(a, b):\n    return a + b\n" * 5,
    "b.txt": "for i in range(10):\n    print(i * i)\n" * 3 + "<|endoftext|>",
    "skip.json": '{"never": "counted"}',
}


@pytest.fixture(scope="module")
def tok(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[1])


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    for name, text in TEXTS.items():
        (d / ("sub" if name == "b.txt" else ".") / name).write_text(text)
    return d


def expected_counts(tok, names):
    c = collections.Counter()
    for name in names:
        c.update(tok(TEXTS[name], add_special_tokens=False)["input_ids"])
    return c


def test_counts_every_token_of_matching_files(tok, corpus):
    files = V.text_files([corpus])
    assert [f.name for f in files] == ["a.py", "b.txt"]  # json skipped, fixed order
    counts = V.count_tokens(tok, files)
    want = expected_counts(tok, ["a.py", "b.txt"])
    assert counts.sum() == sum(want.values())
    assert {t: int(counts[t]) for t in np.flatnonzero(counts)} == dict(want)
    assert counts[tok.eos_token_id] == 1  # the separator is counted as the special token


def test_select_by_size_and_by_coverage():
    counts = np.array([0, 50, 10, 30, 10, 0, 0, 0])
    ids, cover = V.select(counts, specials=(0,), size=2)
    assert ids == (1, 3, 0) and abs(cover - 80 / 100) < 1e-12  # most frequent first, special added
    ids, _ = V.select(counts, specials=(), size=100)
    assert ids == (1, 3, 2, 4)  # ties by id; unseen tokens never kept
    ids, cover = V.select(counts, specials=(7,), coverage=0.85)
    assert ids == (1, 3, 2, 7) and abs(cover - 0.9) < 1e-12
    assert V.select(counts, coverage=1.0)[0] == (1, 3, 2, 4)
    for bad in (dict(size=0), dict(coverage=0.0), dict(coverage=1.5), dict(), dict(size=3, coverage=0.5)):
        with pytest.raises(ValueError):
            V.select(counts, **bad)
    with pytest.raises(ValueError, match="no tokens"):
        V.select(np.zeros(4, dtype=np.int64), size=2)


def test_build_save_load_round_trip(tok, corpus, tmp_path):
    built = V.build(tok, [corpus], size=5)
    want = expected_counts(tok, ["a.py", "b.txt"])
    top5 = [t for t, _ in sorted(want.items(), key=lambda kv: (-kv[1], kv[0]))[:5]]
    assert built.ids == tuple(top5) + (tok.eos_token_id,)  # the separator occurs once: it comes last
    assert tok.eos_token_id in built.ids and built.special_ids == (tok.eos_token_id,)
    assert built.vocab_size == len(tok) and built.tokenizer_sha256 == V.tokenizer_fingerprint(tok)
    path = built.save(tmp_path / "m" / V.DEFAULT_NAME)
    assert TrimmedVocab.load(path) == built
    assert TrimmedVocab.load(path.parent) == built  # a directory means its vocab_subset.json
    data = json.loads(path.read_text())
    assert data["format"] == V.FORMAT and data["ids"] == list(built.ids)


def test_cli_writes_the_file(tiny_pair, corpus, tmp_path, capsys):
    from treeserve.cli import main

    out = tmp_path / "v.json"
    assert main(["trim-vocab", "--tokenizer", str(tiny_pair[1]), "--text", str(corpus), "--coverage", "0.9",
                 "--out", str(out)]) == 0
    got = TrimmedVocab.load(out)
    assert got.coverage >= 0.9 and "token ids kept" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no text files"):
        V.main(["--tokenizer", str(tiny_pair[1]), "--text", str(corpus), "--glob", "*.md", "--size", "4",
                "--out", str(out)])


def write(tmp_path, data, name="v.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


GOOD = {"format": V.FORMAT, "version": 1, "vocab_size": 320, "special_ids": [0], "ids": [5, 0, 7]}


@pytest.mark.parametrize("data,message", [
    ("not json {", "not a readable JSON"),
    ([1, 2], "not a trimmed-vocabulary file"),
    ({**GOOD, "format": "other"}, "not a trimmed-vocabulary file"),
    ({**GOOD, "version": 9}, "version 9"),
    ({k: v for k, v in GOOD.items() if k != "ids"}, "missing field 'ids'"),
    ({**GOOD, "ids": []}, "no token ids"),
    ({**GOOD, "ids": [5, "x"]}, "list of integers"),
    ({**GOOD, "ids": [5, 0, 5]}, "more than once"),
    ({**GOOD, "ids": [5, 0, 320]}, "outside the vocabulary"),
    ({**GOOD, "ids": [5, 7]}, "special token ids \\[0\\]"),
], ids=["json", "list", "format", "version", "no-ids", "empty", "types", "duplicate", "range", "special"])
def test_bad_files_give_clear_errors(tmp_path, data, message):
    path = write(tmp_path, data)
    with pytest.raises(VocabFileError, match=message) as info:
        TrimmedVocab.load(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(VocabFileError, match="no such trimmed-vocabulary file"):
        TrimmedVocab.load(tmp_path / "nope.json")


def test_files_that_do_not_fit_the_draft_model(tiny_pair, tok, tmp_path):
    from drafter_service.draftlm import DraftModel

    fp = V.tokenizer_fingerprint(tok)
    cases = {
        "bigger": ({**GOOD, "vocab_size": 50000, "ids": [0, 40000]}, "vocabulary of 50000 ids"),
        "tokenizer": ({**GOOD, "tokenizer_sha256": "0" * 64}, "different tokenizer"),
        "eos": ({**GOOD, "special_ids": [], "ids": [5, 7], "tokenizer_sha256": fp}, "end-of-text token 0"),
    }
    for name, (data, message) in cases.items():
        path = write(tmp_path, data, f"{name}.json")
        with pytest.raises(VocabFileError, match=message):
            DraftModel.load(str(tiny_pair[1]), max_slots=2, max_len=64, trim=path)
    # and the drafter's command line turns them into one clear line
    from drafter_service.cli import add_arguments, build
    import argparse

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--model", str(tiny_pair[1]), "--trim-vocab", str(tmp_path / "eos.json"),
                         "--max-sequences", "1", "--no-draft-ahead"])
    with pytest.raises(SystemExit, match="--trim-vocab: .*end-of-text"):
        build(args)
