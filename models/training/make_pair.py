"""Build corpus, tokenizer, target and drafter in one go, within a total wall-clock budget.

CLI::

    python -m models.training.make_pair --preset demo|medium|tiny --out DIR --minutes M \\
        [--device cuda|cpu] [--corpus-bytes N] [--vocab-size 4096] [--sequential]

Layout of ``DIR``: ``corpus/``, ``tokenizer/``, ``target/``, ``drafter/`` (checkpoint directories)
and ``summary.json``. Corpus and tokenizer already present in ``DIR`` are reused, so a second
call only trains. ``--minutes`` bounds the whole command: after data preparation the remaining
time, less a reserve, goes to training. On CUDA the two models
train at the same time in two processes (small models leave the GPU mostly idle); on CPU they run
one after the other, the target taking ``--target-share`` of the time, with smaller steps
(``CPU_TRAIN_ARGS``). Each child gets an absolute deadline, so its start-up counts against the
budget; the reserve covers evaluation and saving. Every child saves its checkpoint when its
budget ends or when it receives SIGTERM, which this driver forwards.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from models.training.corpus import CorpusSettings, build_corpus
from models.training.data import encode_split
from models.training.tokenizer import DEFAULT_VOCAB, tokenizer_sha256, train_tokenizer

PAIR_BUDGET_BYTES = {"demo": 16 * 2**20}  # the embedded default pair must stay this small
# CPU runs are ~100x slower than an H100: small steps so the schedule gets a few hundred of them,
# and fewer held-out tokens scored. Explicit train arguments after "--" take precedence.
CPU_TRAIN_ARGS = {"--batch-size": "8", "--seq-len": "256", "--warmup": "20", "--val-tokens": str(64 * 1024)}


def log(msg: str) -> None:
    print(f"[make_pair {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _pump(stream, prefix: str) -> None:
    for line in iter(stream.readline, ""):
        print(f"{prefix}{line}", end="", flush=True)


class Children:
    """Child training processes whose output is relayed line by line and who get our SIGTERM."""

    def __init__(self):
        self.procs: list[subprocess.Popen] = []
        self.threads: list[threading.Thread] = []

    def start(self, cmd: list[str], prefix: str) -> subprocess.Popen:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        t = threading.Thread(target=_pump, args=(proc.stdout, prefix), daemon=True)
        t.start()
        self.procs.append(proc)
        self.threads.append(t)
        return proc

    def wait(self) -> list[int]:
        codes = [p.wait() for p in self.procs]
        for t in self.threads:
            t.join(timeout=5)
        return codes

    def terminate(self, signum, _frame) -> None:
        log(f"received {signal.Signals(signum).name}: asking trainers to stop and save")
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)


def _train_cmd(config: str, out: Path, deadline: float, device: str, seed: int, extra: list[str]) -> list[str]:
    """Command line of one training child; its loop ends at ``deadline`` whatever its start-up took."""
    minutes = max(deadline - time.time(), 1.0) / 60
    cmd = [sys.executable, "-m", "models.training.train", "--config", config, "--corpus", str(out / "corpus"),
           "--tokenizer", str(out / "tokenizer"), "--out", str(out / config.split("-")[-1]),
           "--minutes", f"{minutes:.4f}", "--deadline", f"{deadline:.3f}", "--device", device, "--seed", str(seed)]
    if not device.startswith("cuda"):
        for flag, value in CPU_TRAIN_ARGS.items():
            if flag not in extra:
                cmd += [flag, value]
    return cmd + extra


def _read_record(path: Path) -> dict | None:
    try:
        return json.loads((path / "training.json").read_text())
    except (OSError, ValueError):
        return None


def _dir_bytes(path: Path, names: tuple[str, ...]) -> int:
    return sum((path / n).stat().st_size for n in names if (path / n).exists())


def make_pair(preset: str, out: str | Path, minutes: float, device: str, corpus_bytes: int | None = None,
              vocab_size: int = DEFAULT_VOCAB, concurrent: bool | None = None, target_share: float = 0.7,
              reserve_s: float | None = None, seed: int = 0, tokenizer_bytes: int = 24 * 2**20,
              extra_train_args: list[str] | None = None, prepare_only: bool = False) -> dict:
    """Run the whole pipeline into ``out``; returns the summary (also written to summary.json).

    With ``prepare_only`` it stops after corpus, tokenizer and token caches (summary without models).
    """
    t0 = time.time()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    concurrent = device.startswith("cuda") if concurrent is None else concurrent
    reserve_s = (30.0 if device.startswith("cuda") else 75.0) if reserve_s is None else reserve_s
    phases: dict[str, float] = {}

    corpus_dir = out / "corpus"
    if (corpus_dir / "manifest.json").exists():
        manifest = json.loads((corpus_dir / "manifest.json").read_text())
        log(f"reusing corpus {corpus_dir} ({manifest['train']['bytes']:,} train bytes)")
    else:
        settings = CorpusSettings(max_bytes=corpus_bytes or CorpusSettings.max_bytes)
        log(f"building corpus (cap {settings.max_bytes:,} bytes) from stdlib and site-packages")
        manifest = build_corpus(corpus_dir, settings)
    log(f"corpus: {manifest['train']['files']:,} train files {manifest['train']['bytes']:,} B, "
        f"{manifest['valid']['files']:,} valid files {manifest['valid']['bytes']:,} B, "
        f"sha256 {manifest['corpus_sha256'][:16]}")
    phases["corpus_s"] = time.time() - t0

    tok_dir = out / "tokenizer"
    t1 = time.time()
    if (tok_dir / "tokenizer.json").exists():
        log(f"reusing tokenizer {tok_dir}")
    else:
        log(f"training byte-level BPE tokenizer, vocab {vocab_size}")
        train_tokenizer(corpus_dir, tok_dir, vocab_size, tokenizer_bytes)
    n_train = len(encode_split(corpus_dir, tok_dir, "train"))
    n_valid = len(encode_split(corpus_dir, tok_dir, "valid"))
    phases["tokenizer_s"] = time.time() - t1
    log(f"tokenizer sha256 {tokenizer_sha256(tok_dir)[:16]}; streams: train {n_train:,} tokens, valid {n_valid:,}")
    if prepare_only:
        summary = {"preset": preset, "prepared": str(out), "phases": phases, "train_tokens": n_train,
                   "valid_tokens": n_valid, "tokenizer_sha256": tokenizer_sha256(tok_dir),
                   "corpus": {k: manifest[k] for k in ("corpus_sha256", "train", "valid", "python")}}
        log(f"prepared in {time.time() - t0:.0f}s; train with the same --out to reuse it")
        return summary

    end = t0 + minutes * 60.0 - reserve_s  # training loops end here; the reserve covers evaluation and saving
    remaining = end - time.time()
    if remaining < 20.0:
        log(f"warning: only {remaining:.0f}s left for training; training 20s anyway")
        end, remaining = time.time() + 20.0, 20.0
    extra = list(extra_train_args or [])
    for role in ("target", "drafter"):  # a record left by an earlier run must not pass for this one's
        (out / role / "training.json").unlink(missing_ok=True)
    children = Children()
    previous = {s: signal.signal(s, children.terminate) for s in (signal.SIGTERM, signal.SIGINT)}
    t2 = time.time()
    try:
        if concurrent:
            log(f"training {preset}-target and {preset}-drafter concurrently until +{remaining:.0f}s on {device}")
            children.start(_train_cmd(f"{preset}-target", out, end, device, seed, extra), "[target ] ")
            children.start(_train_cmd(f"{preset}-drafter", out, end, device, seed, extra), "[drafter] ")
            codes = children.wait()
        else:
            # The target's evaluation and saving happen inside the drafter's share: half the reserve.
            target_end = time.time() + target_share * remaining - reserve_s / 2
            codes = []
            for role, deadline in (("target", target_end), ("drafter", end)):
                deadline = max(deadline, time.time() + 20.0)
                log(f"training {preset}-{role} until +{deadline - time.time():.0f}s on {device}")
                children.start(_train_cmd(f"{preset}-{role}", out, deadline, device, seed, extra),
                               f"[{role:7s}] ")
                codes.append(children.wait()[-1])
                children.procs.clear()
                children.threads.clear()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    phases["training_s"] = time.time() - t2

    summary = {
        "preset": preset,
        "device": device,
        "minutes": minutes,
        "concurrent": concurrent,
        "corpus": {k: manifest[k] for k in ("corpus_sha256", "train", "valid", "python")},
        "tokenizer_sha256": tokenizer_sha256(tok_dir),
        "train_tokens": n_train,
        "valid_tokens": n_valid,
        "exit_codes": codes,
        "phases": phases,
        "models": {},
    }
    weight_files = ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
                    "tokenizer_config.json", "special_tokens_map.json")
    pair_bytes = 0
    for role in ("target", "drafter"):
        rec = _read_record(out / role)
        if rec is None:
            summary["models"][role] = None
            log(f"{role}: no checkpoint written")
            continue
        size = _dir_bytes(out / role, weight_files)
        pair_bytes += size
        summary["models"][role] = {
            "path": str(out / role),
            "parameters": rec["model"]["parameters"],
            "valid_loss": rec["valid_loss"],
            "valid_ppl": rec["valid_ppl"],
            "final_train_loss": rec["final_train_loss"],
            "steps": rec["training"]["steps"],
            "tokens_seen": rec["training"]["tokens_seen"],
            "tokens_per_second": rec["training"]["tokens_per_second"],
            "stop_reason": rec["training"]["stop_reason"],
            "bytes": size,
        }
        log(f"{role}: valid loss {rec['valid_loss']:.4f} (ppl {rec['valid_ppl']:.2f}), "
            f"{rec['training']['steps']} steps, {rec['training']['tokens_seen']:,} tokens, {size / 2**20:.2f} MiB")
    summary["pair_bytes"] = pair_bytes
    limit = PAIR_BUDGET_BYTES.get(preset)
    summary["pair_within_budget"] = None if limit is None else pair_bytes <= limit
    summary["total_seconds"] = time.time() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    log(f"pair: {pair_bytes / 2**20:.2f} MiB" + (f" (limit {limit / 2**20:.0f} MiB)" if limit else "")
        + f"; total {summary['total_seconds']:.0f}s; summary -> {out / 'summary.json'}")
    return summary


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description="build corpus + tokenizer + target + drafter")
    ap.add_argument("--preset", choices=["tiny", "demo", "medium"], default="demo")
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, required=True, help="budget for the whole command")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--corpus-bytes", type=int, default=None, help=f"default {CorpusSettings.max_bytes:,}")
    ap.add_argument("--tokenizer-bytes", type=int, default=24 * 2**20, help="train the BPE on this much text")
    ap.add_argument("--prepare-only", action="store_true", help="stop after corpus, tokenizer and token caches")
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB)
    ap.add_argument("--sequential", action="store_true", help="train one model after the other (default on CPU)")
    ap.add_argument("--target-share", type=float, default=0.7, help="target's share of sequential training time")
    ap.add_argument("--reserve", type=float, default=None,
                    help="seconds kept for evaluation and saving (default 30 on CUDA, 75 on CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("train_args", nargs="*", help="after --: extra arguments for both train runs")
    args = ap.parse_args(argv)
    summary = make_pair(args.preset, args.out, args.minutes, args.device, args.corpus_bytes, args.vocab_size,
                        False if args.sequential else None, args.target_share, args.reserve, args.seed,
                        args.tokenizer_bytes, args.train_args, args.prepare_only)
    if args.prepare_only:
        return 0
    ok = all(m is not None for m in summary["models"].values()) and not any(summary["exit_codes"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
