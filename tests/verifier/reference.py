"""Expected answers, computed by driving the model runtime directly (no service in between)."""
from __future__ import annotations

import torch

from tests.verifier.harness import MAX_SEQUENCE_LENGTH
from treeserve import sampling
from verifier_service.results import choose, multi_draft_walk
from treeserve.sampling import Sampling
from treeserve.tree import TokenTree


class Reference:
    def __init__(self, model_dir, max_slots: int):
        from models import HybridLM

        self.lm = HybridLM.from_pretrained(model_dir, max_slots=max_slots, max_len=MAX_SEQUENCE_LENGTH)

    def sequence(self, prompt, s: Sampling = Sampling()) -> "RefSequence":
        return RefSequence(self.lm, list(prompt), s)

    def greedy(self, prompt, n: int) -> list[int]:
        return greedy(self.lm, prompt, n)


def greedy(lm, prompt, n: int) -> list[int]:
    """Plain greedy decoding with runtime `lm` in a slot of its own: the first n tokens after the prompt."""
    slot = lm.pool.alloc()
    try:
        out = [int(lm.prefill([slot], [list(prompt)])[0].argmax())]
        while len(out) < n:
            out.append(int(lm.decode([slot], [out[-1]])[0].argmax()))
        return out
    finally:
        lm.pool.free(slot)


class RefSequence:
    def __init__(self, lm, prompt: list[int], s: Sampling):
        self.lm, self.s = lm, s
        self.slot = lm.pool.alloc()
        logits = lm.prefill([self.slot], [prompt])
        self.length = len(prompt)
        self.first = int(choose(logits, s, torch.tensor([len(prompt)]))[0])
        self._pending = None

    def verify(self, tree: TokenTree, top_logprobs: int = 0):
        """(target_tokens, walk or None, top logprobs per node as (tokens, logprobs))."""
        res = self.lm.verify([self.slot], [tree])
        logits = res.logits
        self._pending = res.pending[0]
        pos = torch.tensor(tree.depths()) + self.length + 1
        tokens = [int(t) for t in choose(logits, self.s, pos)]
        walk = None
        if tree.draft is not None and not self.s.greedy:
            walk = multi_draft_walk(tree, sampling.transform(logits, self.s), self.length, self.s.seed)
        tops = []
        if top_logprobs:
            top = torch.log_softmax(logits, -1).topk(top_logprobs, -1)
            tops = [(r_i.tolist(), r_v.tolist()) for r_i, r_v in zip(top.indices, top.values)]
        return tokens, walk, tops

    def commit(self, path) -> None:
        self.lm.commit([(self._pending, list(path))])
        self.length += len(path)
        self._pending = None

    def close(self) -> None:
        self.lm.pool.free(self.slot)

