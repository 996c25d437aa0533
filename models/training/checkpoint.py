"""Write a trained model as a standard Hugging Face checkpoint directory with a model card.

Directory contents: ``config.json``, ``generation_config.json``, ``model.safetensors`` (in the save
dtype), the tokenizer files, ``training.json`` (the run record) and ``card.md`` (the same, for people).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from models.training.tokenizer import copy_tokenizer

SAVE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def save_checkpoint(model: torch.nn.Module, out_dir: str | Path, tokenizer_dir: str | Path, record: dict,
                    save_dtype: str = "fp16") -> Path:
    """Save ``model`` (a copy cast to ``save_dtype``; the original is untouched) plus tokenizer and card."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    copy_of = copy.deepcopy(model).to(device="cpu", dtype=SAVE_DTYPES[save_dtype]).eval()
    copy_of.save_pretrained(str(out), safe_serialization=True)
    copy_tokenizer(tokenizer_dir, out)
    (out / "training.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    (out / "card.md").write_text(render_card(record))
    return out


def checkpoint_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in Path(path).iterdir() if f.is_file())


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def render_card(r: dict) -> str:
    """Markdown model card from a training record (see ``train.train`` for the keys)."""
    m, t, d = r["model"], r["training"], r["data"]
    lines = [
        f"# {r['preset']} ({m['architecture']})",
        "",
        f"A small {'hybrid Mamba2/attention target' if r['kind'] == 'target' else 'Mamba2 drafter'} model "
        "trained from scratch on Python source code for the treeserve speculative-decoding stack.",
        "",
        "## Model",
        "",
        f"- architecture: `{m['architecture']}`, {m['parameters']:,} parameters, saved as {r['save_dtype']}",
        f"- layers: {m['layers']}",
        f"- d_model {m['d_model']}, vocabulary {m['vocab_size']}",
        "",
        "## Data",
        "",
        f"- corpus: {d['corpus_train_files']:,} training files ({d['corpus_train_bytes']:,} bytes) "
        f"from the Python {d['corpus_python']} standard library and site-packages",
        f"- corpus sha256: `{d['corpus_sha256']}`",
        f"- corpus manifest.json sha256: `{d['manifest_sha256']}`",
        f"- tokenizer: byte-level BPE, tokenizer.json sha256 `{d['tokenizer_sha256']}`",
        f"- training stream: {d['train_tokens']:,} tokens; validation stream: {d['valid_tokens']:,} tokens",
        "",
        "## Training",
        "",
        f"- steps: {t['steps']:,}; tokens seen: {t['tokens_seen']:,} "
        f"({t['tokens_seen'] / max(d['train_tokens'], 1):.2f} epochs)",
        f"- batch: {t['batch_size']} × {t['seq_len']} tokens; AdamW lr {t['lr']:g} "
        f"(warmup {t['warmup_steps']} steps, cosine to {t['min_lr_ratio']:g}×), weight decay {t['weight_decay']:g}, "
        f"clip {t['grad_clip']:g}",
        f"- device: {t['device']} ({t['device_name']}), compute {t['dtype']}, seed {t['seed']}",
        f"- wall time: {t['wall_seconds']:.1f} s of a {t['budget_seconds']:.0f} s budget; "
        f"stopped by: {t['stop_reason']}",
        f"- throughput: {_fmt(t['tokens_per_second'], ',.0f')} tokens/s",
        f"- software: torch {t['torch']}, transformers {t['transformers']}",
        "",
        "## Quality",
        "",
        f"- final training loss (mean of last steps): {_fmt(r['final_train_loss'], '.4f')}",
        f"- validation loss: {_fmt(r['valid_loss'], '.4f')} nats/token over "
        f"{r['valid_tokens_scored']:,} held-out tokens "
        f"(perplexity {_fmt(r['valid_ppl'], '.2f')})",
        "",
        "Load with `transformers.AutoModelForCausalLM.from_pretrained(dir)` and "
        "`AutoTokenizer.from_pretrained(dir)`.",
        "",
    ]
    return "\n".join(lines)
