"""Corpus builder: determinism over a fixed tree, de-duplication, filters, stable hash split, cap."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from models.training.corpus import EOT, CorpusSettings, build_corpus, is_valid_hash


def _module(i: int) -> str:
    return f"def function_{i}(x):\n    \"\"\"Return x scaled by {i}.\"\"\"\n    return x * {i} + {i % 7}\n"


def _make_tree(root: Path, n: int, reverse: bool = False) -> None:
    """n distinct modules in nested packages plus deliberate junk; creation order optionally reversed."""
    entries = [(f"pkg{i % 5}/sub{i % 3}/mod_{i}.py", _module(i).encode()) for i in range(n)]
    entries += [
        ("pkg0/dup_a.py", _module(0).encode()),  # byte-identical to mod_0: dropped
        ("pkg1/crlf.py", _module(1).replace("\n", "\r\n").encode()),  # identical after normalising
        ("pkg2/latin1.py", "s = 'caf\xe9'\n".encode("latin-1") * 10),  # not UTF-8
        ("pkg3/broken.py", b"def f(:\n    return (\n" * 5),  # does not parse
        ("pkg4/tiny.py", b"x = 1\n"),  # below min_file_bytes
        ("pkg4/wide.py", ("x = '" + "a" * 1000 + "'\n").encode()),  # data-like line
        ("pkg4/notes.txt", b"not python " * 20),  # wrong extension
        ("pkg4/__pycache__/cached.py", _module(10_001).encode()),  # skipped directory
    ]
    for rel, data in (reversed(entries) if reverse else entries):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)


def _build(tree: Path, out: Path, **settings) -> dict:
    return build_corpus(out, CorpusSettings(**settings), [("src", tree)], workers=1)


def test_same_tree_gives_identical_bytes(tmp_path):
    a, b = tmp_path / "a" / "tree", tmp_path / "b" / "other_name"
    _make_tree(a, 120)
    _make_tree(b, 120, reverse=True)  # different path and creation order, same content
    ma, mb = _build(a, tmp_path / "out_a"), _build(b, tmp_path / "out_b")
    for name in ("train.txt", "valid.txt", "files.tsv"):
        assert (tmp_path / "out_a" / name).read_bytes() == (tmp_path / "out_b" / name).read_bytes()
    assert ma["corpus_sha256"] == mb["corpus_sha256"]
    manifest = json.loads((tmp_path / "out_a" / "manifest.json").read_text())
    assert manifest["train"]["sha256"] == hashlib.sha256((tmp_path / "out_a" / "train.txt").read_bytes()).hexdigest()
    # a rebuild into the same place is byte-identical, manifest included
    first = (tmp_path / "out_a" / "manifest.json").read_bytes()
    _build(a, tmp_path / "out_a")
    assert (tmp_path / "out_a" / "manifest.json").read_bytes() == first


def test_dedup_and_filters(tmp_path):
    tree = tmp_path / "tree"
    _make_tree(tree, 30)
    m = _build(tree, tmp_path / "out")
    rows = [line.split("\t") for line in (tmp_path / "out" / "files.tsv").read_text().splitlines()]
    names = [r[3] for r in rows]
    assert m["train"]["files"] + m["valid"]["files"] == len(rows) == 30
    assert len({r[0] for r in rows}) == len(rows)
    assert "src/pkg0/dup_a.py" in names and "src/pkg0/sub0/mod_0.py" not in names  # smallest name kept
    assert "src/pkg1/crlf.py" in names and "src/pkg1/sub1/mod_1.py" not in names  # same text after CRLF fix
    for junk in ("latin1", "broken", "tiny", "wide", "notes", "cached"):
        assert not any(junk in n for n in names), junk
    text = (tmp_path / "out" / "train.txt").read_text() + (tmp_path / "out" / "valid.txt").read_text()
    assert "\r" not in text
    assert [r[0] for r in rows] == sorted(r[0] for r in rows)  # hash order


def test_split_is_stable_when_files_are_added(tmp_path):
    small, large = tmp_path / "small", tmp_path / "large"
    _make_tree(small, 200)
    _make_tree(large, 300)
    _build(small, tmp_path / "o1", valid_permille=50)
    _build(large, tmp_path / "o2", valid_permille=50)

    def split_of(out):
        return {r.split("\t")[0]: r.split("\t")[1] for r in (out / "files.tsv").read_text().splitlines()}

    s1, s2 = split_of(tmp_path / "o1"), split_of(tmp_path / "o2")
    assert 0 < sum(v == "valid" for v in s1.values()) < 40
    assert all(s2[h] == v for h, v in s1.items())
    assert all((v == "valid") == is_valid_hash(h, 50) for h, v in s2.items())
    valid_docs = (tmp_path / "o2" / "valid.txt").read_text().split(EOT)
    assert len(valid_docs) == sum(v == "valid" for v in s2.values())


def test_cap_takes_a_prefix_in_hash_order(tmp_path):
    tree = tmp_path / "tree"
    _make_tree(tree, 100)
    full = _build(tree, tmp_path / "full")
    capped = _build(tree, tmp_path / "capped", max_bytes=3000)
    total = capped["train"]["bytes"] + capped["valid"]["bytes"]
    assert 0 < total <= 3000 + len(EOT) * 60
    full_rows = (tmp_path / "full" / "files.tsv").read_text().splitlines()
    capped_rows = (tmp_path / "capped" / "files.tsv").read_text().splitlines()
    assert capped_rows == full_rows[: len(capped_rows)]
    assert full["train"]["files"] > capped["train"]["files"]


def test_cli_writes_outputs(tmp_path):
    from models.training.corpus import main

    tree = tmp_path / "tree"
    _make_tree(tree, 20)
    assert main(["--out", str(tmp_path / "cli"), "--source", str(tree), "--workers", "1"]) == 0
    assert {p.name for p in (tmp_path / "cli").iterdir()} >= {"train.txt", "valid.txt", "files.tsv", "manifest.json"}
    shutil.rmtree(tmp_path / "cli")


def test_parallel_syntax_check_matches_serial(tmp_path):
    tree = tmp_path / "tree"
    _make_tree(tree, 40)
    build_corpus(tmp_path / "serial", CorpusSettings(), [("src", tree)], workers=1)
    build_corpus(tmp_path / "parallel", CorpusSettings(), [("src", tree)], workers=2)
    assert (tmp_path / "serial" / "train.txt").read_bytes() == (tmp_path / "parallel" / "train.txt").read_bytes()


@pytest.mark.parametrize("permille", [0, 1000])
def test_split_extremes(tmp_path, permille):
    tree = tmp_path / "tree"
    _make_tree(tree, 10)
    m = _build(tree, tmp_path / "out", valid_permille=permille)
    assert (m["valid"]["files"] == 10) == (permille == 1000)
    assert (m["train"]["files"] == 10) == (permille == 0)
