"""The draft model's LM head over the tokens it may draft, and the map between its columns and
token ids.

Draft logits have one *column* per draftable token. Without trimming the columns are the token ids
themselves (the whole vocabulary, or the ids below `--vocab-limit` when the draft's vocabulary is
padded past the target's): the head is a prefix of the LM-head rows and no mapping is needed. With
a trimmed vocabulary (`drafter_service.vocab`) column c is token `ids[c]`: the kept rows of the LM
head are gathered once here, so every draft step multiplies by a (K, d_model) matrix instead of
(V, d_model), and everything downstream (softmax, top-k, Gumbel draws) works on K columns.
Consumers turn columns back into token ids on the device (`to_tokens`) before anything leaves it.
"""
from __future__ import annotations

from typing import Sequence

import torch

from drafter_service.vocab import TrimmedVocab, VocabFileError, tokenizer_fingerprint


class DraftHead:
    """vocab_size: the id space of the drafter (tokens it accepts; drafted tokens are below it).
    size: number of columns K. ids: (K,) int64 token id of each column on the model's device, or
    None when column c is token c (K == vocab_size)."""

    def __init__(self, lm, trim: TrimmedVocab | None = None, vocab_limit: int | None = None,
                 source: str = "trimmed vocabulary"):
        full = int(lm.config.vocab_size)
        self.vocab_size = min(full, vocab_limit) if vocab_limit else full
        self._logits = lm.logits
        weight = lm.lm_head_weight
        if trim is None:
            self.ids = None
            self.weight = weight[: self.vocab_size]
            self.size = self.vocab_size
            self._columns = None
            return
        kept = _check(lm, trim, full, source)
        # --vocab-limit applies to the trimmed set too: ids past it are padding of the draft's vocabulary
        kept = [t for t in kept if t < self.vocab_size]
        if not kept:
            raise VocabFileError(f"{source}: no kept id is below the vocabulary limit {self.vocab_size}")
        self.ids = torch.tensor(kept, dtype=torch.int64, device=weight.device)
        self.weight = weight.index_select(0, self.ids).contiguous()
        self.size = len(kept)
        self._columns = torch.full((self.vocab_size,), -1, dtype=torch.int64, device=weight.device)
        self._columns[self.ids] = torch.arange(self.size, dtype=torch.int64, device=weight.device)

    @property
    def trimmed(self) -> bool:
        return self.ids is not None

    def logits(self, hidden: torch.Tensor, rows: Sequence[int] | None = None) -> torch.Tensor | None:
        """hidden (T, d_model) final-norm states -> (len(rows), K) fp32 logits of `rows` (None: all
        T rows; empty: nothing is computed and None is returned)."""
        if rows is not None:
            rows = list(rows)
            if not rows:
                return None
            if rows != list(range(hidden.shape[0])):
                hidden = hidden[torch.tensor(rows, dtype=torch.int64).to(hidden.device, non_blocking=True)]
        return self._logits(hidden, self.weight)

    def logits_at(self, hidden: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """hidden (T, d_model), rows (n,) int64 on the device -> (n, K) fp32 logits (no host sync)."""
        return self._logits(hidden[rows], self.weight)

    def to_tokens(self, columns: torch.Tensor) -> torch.Tensor:
        """Token ids (int64) of column indices, any shape, on the device."""
        return columns.long() if self.ids is None else self.ids[columns.long()]

    def columns_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """Column of each token id (int64, any shape), -1 for tokens that are never drafted."""
        tokens = tokens.long()
        inside = (tokens >= 0) & (tokens < self.vocab_size)
        if self._columns is None:
            return torch.where(inside, tokens, torch.full_like(tokens, -1))
        return torch.where(inside, self._columns[tokens.clamp(0, self.vocab_size - 1)], torch.full_like(tokens, -1))

    def describe(self) -> str:
        if self.ids is None:
            return f"{self.size} tokens"
        return f"{self.size} of {self.vocab_size} tokens (trimmed)"


def _check(lm, trim: TrimmedVocab, full: int, source: str) -> list[int]:
    """The kept ids, after checking the file fits this draft model."""
    if trim.vocab_size > full:
        raise VocabFileError(f"{source}: built for a vocabulary of {trim.vocab_size} ids, but the draft model has "
                             f"{full}; was it built with another tokenizer?")
    tok = getattr(lm, "tokenizer", None)
    if tok is not None and trim.tokenizer_sha256 is not None and tokenizer_fingerprint(tok) != trim.tokenizer_sha256:
        raise VocabFileError(f"{source}: built with a different tokenizer than the draft model's (fingerprints "
                             "differ); rebuild it with `treeserve trim-vocab --tokenizer DRAFT_DIR ...`")
    eos = lm.config.eos_token_id
    eos = () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
    missing = [int(t) for t in eos if int(t) not in set(trim.ids)]
    if missing:
        raise VocabFileError(f"{source}: the draft model's end-of-text token {missing[0]} is not kept; rebuild the "
                             "file with `treeserve trim-vocab` (it keeps special tokens)")
    return list(trim.ids)
