"""N-gram drafting (prompt lookup): no model.

The text so far (committed tokens, then the root) is searched for earlier occurrences of its own
suffix. Each occurrence proposes the tokens that followed it. Occurrences are ranked by how long a
suffix they match (longest first, up to `max_match`), then by recency; distinct continuations are
merged into one prefix tree (`TokenTree.from_sequences`) in that order until the node budget is
spent, so shared prefixes cost one node and the most reliable continuation is kept whole.
"""
from __future__ import annotations

import numpy as np

from drafter_service.proposer import Draft
from drafter_service.state import DraftState
from treeserve.tree import TokenTree


class NgramProposer:
    name = "ngram"
    uses_model = False

    def __init__(self, max_match: int = 8, min_match: int = 1, max_continuations: int = 8):
        self.max_match = max_match
        self.min_match = min_match
        self.max_continuations = max_continuations

    def propose(self, state: DraftState, root: int, budget: int, depth: int) -> Draft:
        text = np.append(state.history.view(), np.int64(root))
        conts = continuations(text, depth, self.max_match, self.min_match, self.max_continuations)
        return Draft(TokenTree.from_sequences(int(root), conts, max_nodes=budget))


def continuations(text: np.ndarray, length: int, max_match: int, min_match: int, limit: int) -> list[list[int]]:
    """Up to `limit` distinct continuations (each at most `length` tokens) of earlier occurrences of
    the suffix of `text`, best match first."""
    n = len(text)
    if n < 2 or length <= 0:
        return []
    ends = np.flatnonzero(text[:-1] == text[-1])  # occurrences of the last token, before it
    if ends.size == 0:
        return []
    match = np.ones(ends.size, dtype=np.int64)
    alive = np.ones(ends.size, dtype=bool)
    for k in range(1, max_match):
        if k >= n:
            break
        ok = alive & (ends - k >= 0)
        idx = np.where(ok, ends - k, 0)
        ok &= text[idx] == text[n - 1 - k]
        match += ok
        alive = ok
        if not alive.any():
            break
    keep = match >= min_match
    ends, match = ends[keep], match[keep]
    # longest match first, then the most recent occurrence
    order = np.lexsort((-ends, -match))
    out: list[list[int]] = []
    seen: set[tuple[int, ...]] = set()
    for i in order:
        start = int(ends[i]) + 1
        cont = tuple(int(t) for t in text[start : start + length])
        if not cont or cont in seen:
            continue
        seen.add(cont)
        out.append(list(cont))
        if len(out) >= limit:
            break
    return out
