"""Random trees for service tests."""
from __future__ import annotations

import random
from typing import Sequence

from treeserve.tree import SparseDist, TokenTree


def random_tree(rng: random.Random, root: int, vocab: int, size: int, hint: Sequence[int] = (), p_hint: float = 0.7) -> TokenTree:
    """`size` nodes under `root`. With probability p_hint per step the first branch follows `hint`
    (the tokens the target is expected to produce), so some steps accept several nodes."""
    tokens, parents = [root], [-1]
    used: set[tuple[int, int]] = set()
    node = 0
    for tok in hint:
        if len(tokens) >= size or rng.random() > p_hint:
            break
        used.add((node, tok))
        tokens.append(tok)
        parents.append(node)
        node = len(tokens) - 1
    while len(tokens) < size:
        p, t = rng.randrange(len(tokens)), rng.randrange(vocab)
        if (p, t) in used:
            continue
        used.add((p, t))
        tokens.append(t)
        parents.append(p)
    return TokenTree(tuple(tokens), tuple(parents))


def with_drafts(rng: random.Random, tree: TokenTree, vocab: int, flat: bool = False) -> TokenTree:
    """The same tree carrying a draft distribution at every node with children: the children's
    tokens, two more tokens and some residual mass. `flat`: every token gets 1/vocab (a near-flat
    target then accepts most children)."""
    draft = []
    for i in range(tree.size):
        kids = [tree.tokens[c] for c in tree.children(i)]
        if not kids:
            draft.append(None)
            continue
        extra = [t for t in rng.sample(range(vocab), len(kids) + 2) if t not in kids][:2]
        toks = kids + extra
        w = [rng.random() + 0.05 for _ in toks]
        probs = tuple(1.0 / vocab if flat else 0.9 * x / sum(w) for x in w)
        draft.append(SparseDist(tuple(toks), probs, 1.0 - sum(probs)))
    return TokenTree(tree.tokens, tree.parents, tuple(draft))
