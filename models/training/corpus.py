"""Build a Python-source training corpus from the text already on the machine.

Sources default to the running interpreter's standard library and its site-packages. Files are
read, normalised (UTF-8, ``\\n`` line ends), kept only if they parse as Python and look like
hand-written code, de-duplicated by the SHA-256 of their content, and ordered by that hash, so the
same input tree always gives byte-identical output whatever the paths or file-system order. The
held-out split is a function of the content hash alone (a corpus so small that no file falls
under the threshold holds out its lowest-bucket file instead). A byte cap takes files in hash order,
which makes it a deterministic pseudo-random subset.

Output directory:

- ``train.txt`` / ``valid.txt``: documents joined by ``<|endoftext|>``
- ``files.tsv``: ``sha256  split  bytes  name`` for every file used, in output order
- ``manifest.json``: counts, bytes, SHA-256 of the outputs, sources, settings

CLI: ``python -m models.training.corpus --out DIR [--max-bytes N] [--source DIR ...]``
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import multiprocessing
import os
import platform
import site
import sys
import sysconfig
import warnings
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

EOT = "<|endoftext|>"
_SKIP_DIRS = {"__pycache__", "site-packages", "dist-packages", ".git", "node_modules"}


@dataclass(frozen=True)
class CorpusSettings:
    max_bytes: int = 128 * 2**20  # total of train + valid: ~40 M tokens at vocab 4096
    valid_permille: int = 20  # 2% held out, chosen by content hash
    min_file_bytes: int = 64
    max_file_bytes: int = 256 * 2**10  # larger files are mostly generated tables
    max_line_chars: int = 400  # longer lines mean data or minified code
    syntax_check: bool = True


@dataclass(frozen=True)
class SourceFile:
    sha256: str
    name: str  # "<source label>/<path relative to that source>"
    text: str


def is_valid_hash(sha256: str, valid_permille: int) -> bool:
    """Held-out membership from the content hash alone: stable under any change to other files."""
    return int(sha256[:8], 16) % 1000 < valid_permille


def held_out_hashes(files: list[SourceFile], valid_permille: int) -> set[str]:
    """Hashes of the validation files: those under the threshold, or (small corpora where none is)
    the single file with the lowest hash bucket, so there is always something to score on."""
    chosen = {f.sha256 for f in files if is_valid_hash(f.sha256, valid_permille)}
    if not chosen and len(files) > 1 and valid_permille > 0:
        chosen = {min(files, key=lambda f: (int(f.sha256[:8], 16) % 1000, f.sha256)).sha256}
    return chosen


def default_sources() -> list[tuple[str, Path]]:
    """``(label, root)`` for the interpreter's stdlib and site-packages directories."""
    roots: list[tuple[str, Path]] = [("stdlib", Path(sysconfig.get_paths()["stdlib"]))]
    seen = {roots[0][1].resolve()}
    site_dirs = list(site.getsitepackages()) + [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    for i, d in enumerate(sorted(set(site_dirs))):
        p = Path(d)
        if p.is_dir() and p.resolve() not in seen:
            seen.add(p.resolve())
            roots.append((f"site{i}" if i else "site", p))
    return roots


def _walk_py(root: Path) -> list[Path]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info"))
        found.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return found


def _normalise(raw: bytes, settings: CorpusSettings) -> str | None:
    """Decoded text with ``\\n`` line ends, or None if the file should not be used."""
    if not (settings.min_file_bytes <= len(raw) <= settings.max_file_bytes):
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    if EOT in text or "\x00" in text or not text.strip():
        return None
    if max(map(len, text.split("\n"))) > settings.max_line_chars:
        return None
    return text


def _parses(text: str) -> bool:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escapes etc. warn at parse time
        try:
            compile(text, "<corpus>", "exec", flags=ast.PyCF_ONLY_AST, dont_inherit=True)
        except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
            return False
    return True


def collect(sources: list[tuple[str, Path]], settings: CorpusSettings) -> list[SourceFile]:
    """Unique candidate files (before the syntax check and the cap), ordered by content hash.

    Among byte-identical files the lexicographically smallest name is kept.
    """
    by_hash: dict[str, SourceFile] = {}
    for label, root in sources:
        for path in _walk_py(root):
            try:
                raw = path.read_bytes()
            except OSError:
                continue
            text = _normalise(raw, settings)
            if text is None:
                continue
            digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
            name = f"{label}/{path.relative_to(root).as_posix()}"
            kept = by_hash.get(digest)
            if kept is None or name < kept.name:
                by_hash[digest] = SourceFile(digest, name, text)
    return [by_hash[h] for h in sorted(by_hash)]


def _check_batch(texts: list[str]) -> list[bool]:
    return [_parses(t) for t in texts]


def select(files: list[SourceFile], settings: CorpusSettings, workers: int) -> list[SourceFile]:
    """Files in hash order that parse, until the byte cap; parsing runs in parallel, in order."""
    chosen: list[SourceFile] = []
    total = 0
    batch = 512
    pool = None
    if settings.syntax_check and workers > 1:
        # fork: works from any caller (spawn needs an importable __main__); workers only parse text
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
    try:
        for start in range(0, len(files), batch * max(workers, 1)):
            window = files[start:start + batch * max(workers, 1)]
            if not settings.syntax_check:
                ok = [True] * len(window)
            elif pool is None:
                ok = _check_batch([f.text for f in window])
            else:
                parts = [[f.text for f in window[i:i + batch]] for i in range(0, len(window), batch)]
                ok = [v for part in pool.map(_check_batch, parts) for v in part]
            for f, good in zip(window, ok):
                size = len(f.text.encode("utf-8"))
                if not good or total + size > settings.max_bytes:
                    continue
                chosen.append(f)
                total += size
            if total >= settings.max_bytes - settings.min_file_bytes:
                break
    finally:
        if pool is not None:
            pool.shutdown()
    return chosen


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_corpus(files: list[SourceFile], out: Path, settings: CorpusSettings,
                 sources: list[tuple[str, Path]]) -> dict:
    """Writes train.txt, valid.txt, files.tsv and manifest.json; returns the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    held_out = held_out_hashes(files, settings.valid_permille)
    splits = {"train": [], "valid": []}
    for f in files:
        splits["valid" if f.sha256 in held_out else "train"].append(f)
    manifest: dict = {"format": "treeserve-corpus-1", "separator": EOT, "settings": asdict(settings)}
    for split, members in splits.items():
        path = out / f"{split}.txt"
        with open(path, "w", encoding="utf-8", newline="\n") as fh:
            fh.write(EOT.join(f.text for f in members))
        manifest[split] = {
            "files": len(members),
            "bytes": path.stat().st_size,
            "sha256": _sha256_file(path),
        }
    with open(out / "files.tsv", "w", encoding="utf-8", newline="\n") as fh:
        for f in files:
            split = "valid" if f.sha256 in held_out else "train"
            fh.write(f"{f.sha256}\t{split}\t{len(f.text.encode('utf-8'))}\t{f.name}\n")
    manifest["files_sha256"] = _sha256_file(out / "files.tsv")
    manifest["sources"] = [{"label": label, "path": str(root)} for label, root in sources]
    manifest["python"] = platform.python_version()
    manifest["corpus_sha256"] = hashlib.sha256(
        (manifest["train"]["sha256"] + manifest["valid"]["sha256"]).encode()
    ).hexdigest()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def build_corpus(out: str | Path, settings: CorpusSettings = CorpusSettings(),
                 sources: list[tuple[str, Path]] | None = None, workers: int | None = None) -> dict:
    """Collect, filter, cap and write a corpus to ``out``; returns the manifest dict."""
    sources = default_sources() if sources is None else [(label, Path(p)) for label, p in sources]
    workers = min(os.cpu_count() or 1, 16) if workers is None else workers
    candidates = collect(sources, settings)
    chosen = select(candidates, settings, workers)
    manifest = write_corpus(chosen, Path(out), settings, sources)
    manifest["candidates"] = len(candidates)
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--max-bytes", type=int, default=CorpusSettings.max_bytes, help="cap on train+valid bytes")
    ap.add_argument("--valid-permille", type=int, default=CorpusSettings.valid_permille)
    ap.add_argument("--source", action="append", default=None, metavar="DIR",
                    help="source tree (repeatable); default: stdlib and site-packages")
    ap.add_argument("--no-syntax-check", action="store_true", help="keep files that do not parse")
    ap.add_argument("--workers", type=int, default=None)
    args = ap.parse_args(argv)
    settings = CorpusSettings(max_bytes=args.max_bytes, valid_permille=args.valid_permille,
                              syntax_check=not args.no_syntax_check)
    sources = None
    if args.source:
        sources = [(f"src{i}", Path(s)) for i, s in enumerate(args.source)]
    m = build_corpus(args.out, settings, sources, args.workers)
    print(f"corpus: {m['train']['files']} train files ({m['train']['bytes']:,} B), "
          f"{m['valid']['files']} valid files ({m['valid']['bytes']:,} B) "
          f"from {m['candidates']} candidates; sha256 {m['corpus_sha256'][:16]} -> {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
