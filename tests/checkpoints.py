"""Tiny real checkpoints for tests: a byte-level BPE tokenizer and random-weight NemotronH target /
Mamba2 drafter saved with transformers' own `save_pretrained`, so loading goes through the same
code users run on their own model directories."""
from __future__ import annotations

import pathlib

import torch

TEXT = (
    "def add(a, b):\n    return a + b\n\n"
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n"
    "for i in range(10):\n    print(i * i)\n\n"
    "import os\nimport sys\n\nif __name__ == '__main__':\n    main()\n"
) * 4


def make_tokenizer(out: pathlib.Path, vocab_size: int = 320) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.save_pretrained(out)


def make_target(out: pathlib.Path, vocab_size: int, seed: int = 0) -> None:
    """NemotronH: mamba, attention, mlp, mamba (ngroups 2, GQA 4:2)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    torch.manual_seed(seed)
    cfg = NemotronHConfig(
        vocab_size=vocab_size, hidden_size=64, layers_block_type=["linear_attention", "full_attention", "mlp", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2, conv_kernel=4, expand=2,
        chunk_size=16, use_mamba_kernels=False, max_position_embeddings=1024, eos_token_id=0, pad_token_id=0,
        bos_token_id=0, tie_word_embeddings=False,
    )
    model = NemotronHForCausalLM(cfg).eval()
    model.save_pretrained(out)


def make_drafter(out: pathlib.Path, vocab_size: int, seed: int = 1) -> None:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    torch.manual_seed(seed)
    cfg = Mamba2Config(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, state_size=16,
        n_groups=1, conv_kernel=4, expand=2, chunk_size=16, use_cache=True, eos_token_id=0, pad_token_id=0,
        bos_token_id=0, tie_word_embeddings=True,
    )
    model = Mamba2ForCausalLM(cfg).eval()
    model.save_pretrained(out)


def make_pair(root: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """Writes root/target and root/drafter (each with the same tokenizer); returns both paths."""
    target, drafter = root / "target", root / "drafter"
    for d in (target, drafter):
        make_tokenizer(d)
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(target))
    make_target(target, vocab)
    make_drafter(drafter, vocab)
    return target, drafter
