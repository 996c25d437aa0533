"""Print a continuation from a trained checkpoint, to eyeball that it writes Python.

CLI: ``python -m models.training.sample --model DIR --prompt "def " [--tokens 96] [--temperature 0]``
"""

from __future__ import annotations

import argparse
import sys

import torch


def generate(model_dir: str, prompt: str, max_new_tokens: int = 96, temperature: float = 0.0,
             seed: int = 0, device: str = "cpu") -> str:
    """Prompt plus continuation; greedy when ``temperature`` is 0."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    ids = tok(prompt, return_tensors="pt").input_ids.to(device)
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 \
        else {"do_sample": False}
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **sampling)
    return tok.decode(out[0], skip_special_tokens=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="sample a continuation from a checkpoint directory")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", default="def ")
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    print(generate(args.model, args.prompt, args.tokens, args.temperature, args.seed, args.device), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
