"""Which children a tree node gets, from the draft model's logits at that node.

Three rules, picked by the sequence's sampling settings and whether the tree will carry draft
distributions (multi-draft speculative sampling needs them; greedy and target-only sampling do not):

- `greedy` (temperature 0): children are the top-k tokens by the draft's own softmax; no q reported.
- `ranked` (temperature > 0, tree without distributions, e.g. fused trees): top-k tokens of the
  transformed distribution (same temperature / top-k / top-p as the target); no q reported.
- `drawn` (temperature > 0, tree with distributions): children are drawn *without replacement* from
  q by Gumbel-top-k, and q is reported exactly. q is the target's transform of the draft logits
  when its support has at most `support` tokens; otherwise the transform truncated to its `support`
  most likely tokens and renormalised. Either way the reported `SparseDist` lists every token with
  positive mass (residual 0), so the verifier's acceptance uses exactly the distribution sampled from.

Draws use counter-based noise (`treeserve.sampling.uniforms`, stream STREAM_DRAFT) keyed by the
sequence seed, the tree's committed length, a per-node salt and the token id, so the same (state,
root, tree position) always yields the same children: draft-ahead relies on this to reproduce fresh
drafting.

Logits come per *column* of the draft head (`head.DraftHead`): with a trimmed vocabulary column c is
token `ids[c]`. Everything is ranked and drawn over the columns, which are mapped to token ids on
the device; a trimmed q is therefore zero outside the kept tokens and is reported as exactly that.
Each call brings its results to the host in one transfer.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from treeserve import sampling
from treeserve.sampling import Sampling
from treeserve.tree import SparseDist

if TYPE_CHECKING:
    from drafter_service.head import DraftHead

# Largest support of a reported draft distribution (tokens listed per node).
DEFAULT_SUPPORT = 64


class PickRule(enum.Enum):
    GREEDY = "greedy"
    RANKED = "ranked"
    DRAWN = "drawn"


@dataclass(frozen=True)
class Children:
    """Candidate children of one node, in the order they would be added to the tree.

    `logq[k]` is the log-probability of `tokens[k]` under the distribution used for ranking (the
    draft softmax when greedy, the transformed q otherwise). `dist` is the exact distribution the
    tokens were drawn from (DRAWN only)."""

    tokens: tuple[int, ...]
    logq: tuple[float, ...]
    dist: SparseDist | None = None


def rule_for(s: Sampling, with_dists: bool) -> PickRule:
    if s.greedy:
        return PickRule.GREEDY
    return PickRule.DRAWN if with_dists else PickRule.RANKED


class ChildPicker:
    """Turns (n, K) draft logits over the head's columns into `Children` (token ids) for n nodes.

    columns: the draft head whose columns the logits are over (None: column c is token c)."""

    def __init__(self, s: Sampling, rule: PickRule, support: int = DEFAULT_SUPPORT,
                 columns: "DraftHead | None" = None):
        if rule is not PickRule.GREEDY and s.greedy:
            raise ValueError(f"rule {rule.value} needs temperature > 0")
        self.sampling = s
        self.rule = rule
        self.support = support
        self.columns = columns

    def bind(self, columns: "DraftHead") -> "ChildPicker":
        """The same picker for logits over `columns`."""
        return self if columns is self.columns else ChildPicker(self.sampling, self.rule, self.support, columns)

    @property
    def reports_dists(self) -> bool:
        return self.rule is PickRule.DRAWN

    def ranking_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """(n, K) logits -> (n, K) float32 probabilities over the same columns, used to rank
        candidates (and to predict outcomes for draft-ahead)."""
        if self.rule is PickRule.GREEDY:
            return torch.softmax(logits.float(), dim=-1)
        return sampling.transform(logits, self.sampling)

    def pick(self, logits: torch.Tensor, k: int, position: int, salts: Sequence[int]) -> list[Children]:
        """logits (n, K); k: most children per node; position: the tree's committed length (keys the
        noise); salts: n distinct per-node integers (stable node ids of the tree being built)."""
        n, width = logits.shape
        if n == 0:
            return []
        if self.rule is PickRule.DRAWN:
            return self._draw(logits, k, position, salts)
        probs = self.ranking_probs(logits)
        top_p, top_c = torch.topk(probs, min(k, width), dim=-1)
        top_p, top_t = _to_host(top_p, self._tokens(top_c))
        out = []
        for row_p, row_t in zip(top_p.tolist(), top_t.astype("int64").tolist()):
            keep = [(t, math.log(p)) for p, t in zip(row_p, row_t) if p > 0.0]
            out.append(Children(tuple(t for t, _ in keep), tuple(lp for _, lp in keep)))
        return out

    def draft_distribution(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The q that DRAWN samples from, per row: (n, m) token ids and (n, m) float32 probs
        (zero-padded where a row's support is smaller than m). Rows sum to 1."""
        q = sampling.transform(logits, self.sampling)
        m = min(self.support, q.shape[-1])
        probs, cols = torch.topk(q, m, dim=-1)
        probs = probs.double()
        probs = probs / probs.sum(-1, keepdim=True)
        return self._tokens(cols), probs.float()

    def _tokens(self, cols: torch.Tensor) -> torch.Tensor:
        return cols.long() if self.columns is None else self.columns.to_tokens(cols)

    def _draw(self, logits: torch.Tensor, k: int, position: int, salts: Sequence[int]) -> list[Children]:
        tokens, probs = self.draft_distribution(logits)
        # noise index: (node, token id); the id space, not the column count, so that the noise of a
        # token does not depend on which other tokens the head keeps
        vocab = logits.shape[-1] if self.columns is None else self.columns.vocab_size
        salt = torch.tensor(list(salts), dtype=torch.long).to(tokens.device, non_blocking=True)[:, None]
        u_index = salt * vocab + tokens
        pos = torch.full_like(u_index, int(position))
        u = sampling.uniforms(self.sampling.seed, pos, sampling.STREAM_DRAFT, u_index)
        gumbel = -torch.log(-torch.log(u))
        # Gumbel-top-k over the float32 probabilities that are reported: the draw follows exactly the
        # listed q (Gumbel-max is invariant to the normalising constant).
        scores = torch.where(probs > 0, torch.log(probs.double()) + gumbel, torch.full_like(gumbel, -math.inf))
        order = torch.argsort(scores, dim=-1, descending=True)
        tokens, probs, order = _to_host(tokens, probs, order)
        out = []
        for row_t, row_p, row_o in zip(tokens.astype("int64").tolist(), probs.tolist(),
                                       order.astype("int64").tolist()):
            listed = [(t, p) for t, p in zip(row_t, row_p) if p > 0.0]
            dist = SparseDist(tuple(t for t, _ in listed), tuple(p for _, p in listed), 0.0)
            chosen = [j for j in row_o if row_p[j] > 0.0][:k]
            out.append(Children(
                tuple(row_t[j] for j in chosen), tuple(math.log(row_p[j]) for j in chosen), dist
            ))
        return out


def _to_host(*tensors: torch.Tensor):
    """Same-shaped tensors -> numpy float64 arrays, in one device-to-host transfer. float32
    probabilities and int64 token ids (< 2**53) are exact in float64."""
    both = torch.stack([t.double() for t in tensors]).cpu().numpy()
    return tuple(both)
