"""Random-weight checkpoints of the benchmark shapes, written to disk as a user's checkpoint would be,
for benchmarks that load a model the way the services do (`treeserve verifier --model DIR`).

    python -m bench.random_checkpoint --shape mamba2-2.7b --out /tmp/m27 --device cuda
    python -m bench.random_checkpoint --shape mamba2-2.7b --out /tmp/m27 --tokenizer models/demo/target

The shapes are `bench.model_runtime.hf_config`'s. Weights follow the usual Mamba2 conventions
(A_log = log(1..H); D, dt_bias and norms 1; biases 0; everything else N(0, 0.02)), drawn from a fixed
seed on `--device` (a GPU draws a 2.7B model in seconds) and saved as bf16 safetensors.
`--init repeating` draws token embeddings of std 1 and the projections into the residual stream of
std 1e-4 (`REPEATING`): a model whose greedy text runs in cycles, so that n-gram drafting is
accepted once a cycle has come round. A step costs what the shape costs whatever the values, so
such a model measures what the serving stack makes of a given acceptance at a realistic shape.

`--tokenizer DIR` copies that checkpoint's tokenizer files and sizes the vocabulary to its tokenizer,
so text goes in and out and a draft model of the same tokenizer can draft for it: `bench e2e
--target OUT` then runs the serving stack at a realistic layer shape with the embedded demo drafter.
What such a model says is noise: acceptance against it measures how a random model repeats itself,
not how well a drafter predicts text.
"""
from __future__ import annotations

import argparse
import pathlib
import shutil
from dataclasses import dataclass

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


@dataclass(frozen=True)
class Init:
    """Standard deviations of the random weights: the token embeddings, the projections that write
    into the residual stream (a mixer's or attention's output projection, an MLP's down
    projection), and every other matrix."""

    embedding: float = 0.02
    residual: float = 0.02
    other: float = 0.02


DEFAULT = Init()
# Each layer's contribution small beside the token's own embedding: the next token is nearly a
# function of the current one, so greedy text soon runs round a cycle of that function, which
# prompt lookup (n-gram drafting) predicts once it has gone round once. The compute is the shape's.
REPEATING = Init(embedding=1.0, residual=1e-4)
INITS = {"default": DEFAULT, "repeating": REPEATING}
RESIDUAL_WRITERS = ("out_proj.weight", "o_proj.weight", "down_proj.weight")


def random_tensors(shapes: dict, device: str, init: Init = DEFAULT) -> dict:
    """{name: bf16 CPU tensor} for {name: torch.Size}, by the conventions of the module docstring."""
    import torch

    gen = torch.Generator(device=device).manual_seed(0)
    out = {}
    for name, shape in shapes.items():
        if name.endswith("A_log"):
            t = torch.log(torch.arange(1, shape.numel() + 1, dtype=torch.float32, device=device)).view(shape)
        elif name.endswith(("dt_bias", ".D")) or "norm" in name:
            t = torch.ones(shape, device=device)
        elif name.endswith("bias"):
            t = torch.zeros(shape, device=device)
        else:
            std = (init.embedding if "embed" in name else init.residual if name.endswith(RESIDUAL_WRITERS)
                   else init.other)
            t = torch.empty(shape, device=device, dtype=torch.bfloat16).normal_(0.0, std, generator=gen)
        out[name] = t.to(torch.bfloat16).contiguous().cpu()
    return out


def write_checkpoint(shape: str, out: pathlib.Path, *, layers: int | None = None, device: str = "cpu",
                     tokenizer: pathlib.Path | None = None, init: Init = DEFAULT) -> None:
    """config.json and model.safetensors of `shape` (`layers` of them) in `out` (created); with
    `tokenizer`, that checkpoint's tokenizer files too and a vocabulary of its tokenizer's size."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench.model_runtime import hf_config

    cfg = hf_config(shape, layers)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        tokenizer = pathlib.Path(tokenizer)
        cfg.vocab_size = len(AutoTokenizer.from_pretrained(str(tokenizer)))
        copied = [f for f in TOKENIZER_FILES if (tokenizer / f).is_file()]
        if "tokenizer_config.json" not in copied:
            raise FileNotFoundError(f"{tokenizer}: no tokenizer_config.json to copy")
        for f in copied:
            shutil.copyfile(tokenizer / f, out / f)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    save_file(random_tensors(shapes, device, init), str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.save_pretrained(out)
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # a server process started next needs the memory, not this one


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", required=True, help="a bench.model_runtime shape (mamba2-2.7b, hybrid-8b, mamba2-tiny, ...)")
    ap.add_argument("--out", required=True, type=pathlib.Path)
    ap.add_argument("--layers", type=int, default=None, help="keep only the first N layers")
    ap.add_argument("--device", default="cpu", help="where the weights are drawn (cuda is far faster)")
    ap.add_argument("--tokenizer", type=pathlib.Path, default=None,
                    help="copy this checkpoint's tokenizer and size the vocabulary to it")
    ap.add_argument("--init", choices=sorted(INITS), default="default",
                    help="default: every matrix N(0, 0.02); repeating: a model whose greedy text runs in cycles")
    args = ap.parse_args(argv)
    write_checkpoint(args.shape, args.out, layers=args.layers, device=args.device, tokenizer=args.tokenizer,
                     init=INITS[args.init])
    print(f"wrote {args.shape} ({args.layers or 'all'} layers, {args.init} weights) to {args.out}")


if __name__ == "__main__":
    main()
