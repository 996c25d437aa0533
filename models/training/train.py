"""Train one preset model on a corpus under a wall-clock budget and save a checkpoint directory.

CLI::

    python -m models.training.train --config demo-target --corpus DIR --tokenizer DIR --out DIR \\
        --minutes 5 [--device cuda|cpu] [--dtype bf16|fp32] [--steps N] [--seed S]

The learning rate follows warmup then cosine decay over *progress*, the larger of the step
fraction (with ``--steps``) and the elapsed fraction of the budget, so a run always ends its
schedule when it runs out of time. The loop stops at the budget, after ``--steps``, on SIGTERM /
SIGINT, or on repeated non-finite losses; in every case it evaluates the held-out loss and saves.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from models.training.checkpoint import SAVE_DTYPES, checkpoint_bytes, save_checkpoint
from models.training.data import WindowSampler, encode_split, validation_windows
from models.training.presets import PRESETS, Preset, get_preset
from models.training.ssd_scan import fast_scan
from models.training.tokenizer import tokenizer_sha256


class StopFlag:
    """Set by SIGTERM/SIGINT so the loop can finish its step, evaluate and save."""

    def __init__(self):
        self.reason: str | None = None

    def __call__(self, signum, _frame):
        self.reason = signal.Signals(signum).name


def log(msg: str) -> None:
    print(msg, flush=True)


def build_model(preset: Preset, vocab_size: int, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(preset.build_config(vocab_size), dtype=torch.float32)


def lr_at(step: int, progress: float, s) -> float:
    """Warmup by steps, then cosine from ``s.lr`` to ``s.lr * s.min_lr_ratio`` over progress in [0, 1]."""
    warm = min(1.0, (step + 1) / max(s.warmup_steps, 1))
    cos = 0.5 * (1.0 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return s.lr * warm * (s.min_lr_ratio + (1.0 - s.min_lr_ratio) * cos)


def make_optimizer(model: torch.nn.Module, s, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; no decay on vectors (norms, biases) or the SSM's A_log / D / dt_bias."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        (no_decay if p.ndim < 2 or leaf in ("A_log", "D", "dt_bias") else decay).append(p)
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, fused=device.type == "cuda")


def next_token_loss(model, window: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``window[:, 1:]`` given ``window[:, :-1]``; ``window (B, T+1)``."""
    logits = model(input_ids=window[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), window[:, 1:].reshape(-1))


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch: int, device: torch.device, autocast) -> float:
    """Mean next-token loss (nats) over ``windows (n, T+1)``."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch].to(device, non_blocking=True)
        with autocast():
            total += next_token_loss(model, w).item() * w[:, 1:].numel()
        count += w[:, 1:].numel()
    model.train()
    return total / max(count, 1)


def _vocab_size(tokenizer_dir: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size(with_added_tokens=True)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def train(preset: Preset, corpus_dir: str | Path, tokenizer_dir: str | Path, out_dir: str | Path,
          minutes: float, device: str = "cpu", dtype: str = "fp32", max_steps: int | None = None,
          seed: int = 0, save_dtype: str = "fp16", log_every_s: float = 15.0, compile_model: bool = False,
          stop: StopFlag | None = None, deadline: float | None = None) -> dict:
    """Train ``preset`` and save to ``out_dir``; returns the run record (also in training.json).

    The training loop runs for ``minutes``, or until the Unix time ``deadline`` if that comes first
    (a driver uses it so that start-up time counts against its own budget).
    """
    t_start = time.time()
    corpus_dir, tokenizer_dir, out_dir = Path(corpus_dir), Path(tokenizer_dir), Path(out_dir)
    s = preset.train
    dev = torch.device(device)
    stop = stop or StopFlag()
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    use_bf16 = dtype == "bf16"
    if use_bf16 and dev.type != "cuda":
        raise ValueError("bf16 autocast is for CUDA; use --dtype fp32 on CPU")

    def autocast():
        if use_bf16:
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    train_stream = encode_split(corpus_dir, tokenizer_dir, "train")
    valid_stream = encode_split(corpus_dir, tokenizer_dir, "valid")
    manifest = json.loads((corpus_dir / "manifest.json").read_text())
    vocab_size = _vocab_size(tokenizer_dir)

    model = build_model(preset, vocab_size, seed).to(dev)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    opt = make_optimizer(model, s, dev)
    step_fn = torch.compile(model) if compile_model else model
    sampler = WindowSampler(train_stream, s.seq_len, seed)
    micro = s.micro_batch or s.batch_size
    if s.batch_size % micro:
        raise ValueError(f"batch_size {s.batch_size} must be a multiple of micro_batch {micro}")
    budget = minutes * 60.0 if deadline is None else max(min(minutes * 60.0, deadline - time.time()), 0.0)
    log(f"[{preset.name}] {type(model).__name__} {n_params / 1e6:.2f}M params, vocab {vocab_size}, "
        f"train stream {len(train_stream):,} tokens, device {dev}, {dtype}, budget {budget:.0f}s"
        + (f", max {max_steps} steps" if max_steps else ""))

    step, tokens_seen, bad_steps = 0, 0, 0
    recent: list[float] = []
    first_loss = None
    stop_reason = "budget"
    t_loop = time.time()
    last_log = t_loop
    try:
        with fast_scan():
            while True:
                elapsed = time.time() - t_loop
                progress = max(elapsed / budget if budget > 0 else 1.0, step / max_steps if max_steps else 0.0)
                if max_steps is not None and step >= max_steps:
                    stop_reason = "steps"
                    break
                if elapsed >= budget and step > 0:
                    stop_reason = "budget"
                    break
                if stop.reason:
                    stop_reason = stop.reason
                    break
                lr = lr_at(step, progress, s)
                for g in opt.param_groups:
                    g["lr"] = lr
                batch = sampler.next(s.batch_size).to(dev, non_blocking=True)
                loss_sum = 0.0
                for i in range(0, s.batch_size, micro):
                    with autocast():
                        loss = next_token_loss(step_fn, batch[i:i + micro]) * (micro / s.batch_size)
                    loss.backward()
                    loss_sum += loss.detach()
                loss_val = float(loss_sum)
                if not math.isfinite(loss_val):
                    opt.zero_grad(set_to_none=True)
                    bad_steps += 1
                    if bad_steps >= 5:
                        stop_reason = "non-finite loss"
                        break
                    continue
                torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                step += 1
                tokens_seen += s.batch_size * s.seq_len
                first_loss = loss_val if first_loss is None else first_loss
                recent = (recent + [loss_val])[-20:]
                now = time.time()
                if now - last_log >= log_every_s or step == 1:
                    last_log = now
                    log(f"[{preset.name}] step {step:6d}  {100 * progress:5.1f}%  loss {np.mean(recent):.4f}  "
                        f"lr {lr:.2e}  {tokens_seen / max(now - t_loop, 1e-9):,.0f} tok/s  {now - t_loop:6.0f}s")
    except torch.OutOfMemoryError:
        stop_reason = "out of memory"
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        log(f"[{preset.name}] out of memory at step {step}: evaluating and saving what was trained")
    train_seconds = time.time() - t_loop

    windows = validation_windows(valid_stream, s.seq_len, s.val_tokens)
    with fast_scan():
        valid_loss = evaluate(model, windows, micro, dev, autocast)
    record = {
        "preset": preset.name,
        "kind": preset.kind,
        "save_dtype": save_dtype,
        "model": {
            "architecture": type(model).__name__,
            "parameters": n_params,
            "layers": getattr(model.config, "hybrid_override_pattern", None)
            or f"{model.config.num_hidden_layers} × Mamba2",
            "d_model": model.config.hidden_size,
            "vocab_size": vocab_size,
            "arch": preset.arch,
        },
        "data": {
            "corpus_sha256": manifest["corpus_sha256"],
            "manifest_sha256": _sha256(corpus_dir / "manifest.json"),
            "corpus_train_files": manifest["train"]["files"],
            "corpus_train_bytes": manifest["train"]["bytes"],
            "corpus_python": manifest.get("python", "?"),
            "tokenizer_sha256": tokenizer_sha256(tokenizer_dir),
            "train_tokens": int(len(train_stream)),
            "valid_tokens": int(len(valid_stream)),
        },
        "training": {
            **{k: v for k, v in asdict(s).items()},
            "steps": step,
            "tokens_seen": tokens_seen,
            "first_loss": first_loss,
            "skipped_steps": bad_steps,
            "device": str(dev),
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "dtype": dtype,
            "seed": seed,
            "compiled": compile_model,
            "budget_seconds": budget,
            "wall_seconds": train_seconds,
            "total_seconds": None,
            "tokens_per_second": tokens_seen / train_seconds if train_seconds > 0 else None,
            "stop_reason": stop_reason,
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
        },
        "final_train_loss": float(np.mean(recent)) if recent else None,
        "valid_loss": valid_loss,
        "valid_ppl": math.exp(valid_loss) if valid_loss < 50 else float("inf"),
        "valid_tokens_scored": int(windows[:, 1:].numel()),
    }
    record["training"]["total_seconds"] = time.time() - t_start
    save_checkpoint(model, out_dir, tokenizer_dir, record, save_dtype)
    record["checkpoint_bytes"] = checkpoint_bytes(out_dir)
    (out_dir / "training.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    log(f"[{preset.name}] done: {step} steps, {tokens_seen:,} tokens, {train_seconds:.0f}s ({stop_reason}); "
        f"train loss {record['final_train_loss'] or float('nan'):.4f}, valid loss {valid_loss:.4f} "
        f"(ppl {record['valid_ppl']:.2f}); saved {record['checkpoint_bytes'] / 2**20:.2f} MiB -> {out_dir}")
    return record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="train a preset model on a corpus within a wall-clock budget")
    ap.add_argument("--config", required=True, choices=sorted(PRESETS), help="preset name")
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, required=True, help="training-loop budget")
    ap.add_argument("--deadline", type=float, default=None, help="Unix time by which the training loop ends")
    ap.add_argument("--val-tokens", type=int, default=None, help="held-out tokens scored at the end")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    ap.add_argument("--save-dtype", choices=sorted(SAVE_DTYPES), default="fp16")
    ap.add_argument("--steps", type=int, default=None, help="stop after this many optimiser steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=None)
    ap.add_argument("--micro-batch", type=int, default=None)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--warmup", type=int, default=None, help="warmup steps")
    ap.add_argument("--compile", action="store_true", help="torch.compile the training forward")
    ap.add_argument("--log-every", type=float, default=15.0, help="seconds between progress lines")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    preset = get_preset(args.config, batch_size=args.batch_size, micro_batch=args.micro_batch,
                        seq_len=args.seq_len, lr=args.lr, val_tokens=args.val_tokens,
                        warmup_steps=args.warmup)
    dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    stop = StopFlag()
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    record = train(preset, args.corpus, args.tokenizer, args.out, args.minutes, args.device, dtype,
                   args.steps, args.seed, args.save_dtype, args.log_every, args.compile, stop, args.deadline)
    return 0 if math.isfinite(record["valid_loss"]) else 1


if __name__ == "__main__":
    sys.exit(main())
