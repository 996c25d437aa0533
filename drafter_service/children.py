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
    # what the tree ranks each child by (`nodes.rank_logq`); None: logq itself
    rank: tuple[float, ...] | None = None


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

    @property
    def truncations(self) -> sampling.Truncations | None:
        """The truncations the picker's transform applies (None: greedy ranks by the plain softmax).
        With the rule, the support and the columns, all that a captured growth depends on: the
        transform's values can come in a device tensor (`pick_tensors`)."""
        return None if self.rule is PickRule.GREEDY else self.sampling.truncations

    def ranking_probs(self, logits: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
        """(n, K) logits -> (n, K) float32 probabilities over the same columns, used to rank
        candidates (and to predict outcomes for draft-ahead). values: `sampling.transform_values`
        of settings with the picker's `truncations`, on the logits' device (None: the picker's own)."""
        if self.rule is PickRule.GREEDY:
            return torch.softmax(logits.float(), dim=-1)
        if values is None:
            return sampling.transform(logits, self.sampling)
        return sampling.transform_by(logits, values, self.truncations)

    def pick(self, logits: torch.Tensor, k: int, position: int, salts: Sequence[int]) -> list[Children]:
        """logits (n, K); k: most children per node; position: the tree's committed length (keys the
        noise); salts: n distinct per-node integers (stable node ids of the tree being built)."""
        if logits.shape[0] == 0:
            return []
        if self.rule is PickRule.DRAWN:  # only draws read the salts and the position
            dev = logits.device
            salt = torch.tensor(list(salts), dtype=torch.long).to(dev, non_blocking=True)
            at = torch.full((1,), int(position), dtype=torch.long, device=dev)
        else:
            salt = at = None
        picked = self.pick_tensors(logits, k, at, salt, sampling.stream_key(self.sampling.seed, sampling.STREAM_DRAFT))
        # the log-probabilities are taken here, on the host copy: on the device they would be more
        # launches on a path that pays for each one
        if picked.draw_order is None:
            tokens, probs = _to_host(picked.tokens, picked.probs)
            out = []
            for rt, rp in zip(tokens.astype("int64").tolist(), probs.tolist()):
                keep = [(t, math.log(p)) for t, p in zip(rt, rp) if p > 0.0]
                out.append(Children(tuple(t for t, _ in keep), tuple(lq for _, lq in keep)))
            return out
        order, dist_t, dist_p = _to_host(picked.draw_order, picked.tokens, picked.probs)
        out = []
        for ro, dt, dp in zip(order.astype("int64").tolist(), dist_t.astype("int64").tolist(), dist_p.tolist()):
            listed = [(t, p) for t, p in zip(dt, dp) if p > 0.0]
            dist = SparseDist(tuple(t for t, _ in listed), tuple(p for _, p in listed), 0.0)
            # the drawn children in draw order, the k-th ranked by q's k-th largest probability
            drawn = [j for j in ro if dp[j] > 0.0]
            out.append(Children(tuple(dt[j] for j in drawn), tuple(math.log(dp[j]) for j in drawn), dist,
                                tuple(math.log(p) for p in dp[: len(drawn)])))
        return out

    def pick_tensors(self, logits: torch.Tensor, k: int, position: torch.Tensor | None, salts: torch.Tensor | None,
                     stream_key: torch.Tensor | int, values: torch.Tensor | None = None) -> "Picked":
        """The children of n nodes as device tensors, with no host synchronisation (a CUDA graph can
        hold it). logits (n, K) over the head's columns; position (1,) int64 the tree's committed
        length; salts (n,) int64 distinct per-node ids; stream_key: `sampling.stream_key(seed,
        STREAM_DRAFT)`, an int or an int64 tensor; values: as `ranking_probs`. Only draws read
        position, salts and stream_key."""
        width = logits.shape[-1]
        if self.rule is PickRule.DRAWN:
            return self._draw(logits, k, position, salts, stream_key, values)
        probs = self.ranking_probs(logits, values)
        top_p, top_c = torch.topk(probs, min(k, width), dim=-1)
        return Picked(self._tokens(top_c), top_p)

    def draft_distribution(self, logits: torch.Tensor,
                           values: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The q that DRAWN samples from, per row: (n, m) token ids and (n, m) float32 probs
        (zero-padded where a row's support is smaller than m), largest first. Rows sum to 1.
        values: as `ranking_probs`."""
        q = self.ranking_probs(logits, values)
        m = min(self.support, q.shape[-1])
        probs, cols = torch.topk(q, m, dim=-1)
        probs = probs.double()
        probs = probs / probs.sum(-1, keepdim=True)
        return self._tokens(cols), probs.float()

    def _tokens(self, cols: torch.Tensor) -> torch.Tensor:
        return cols.long() if self.columns is None else self.columns.to_tokens(cols)

    def _draw(self, logits: torch.Tensor, k: int, position: torch.Tensor, salts: torch.Tensor,
              stream_key: torch.Tensor | int, values: torch.Tensor | None) -> "Picked":
        tokens, probs = self.draft_distribution(logits, values)
        # noise index: (node, token id); the id space, not the column count, so that the noise of a
        # token does not depend on which other tokens the head keeps
        vocab = logits.shape[-1] if self.columns is None else self.columns.vocab_size
        u_index = salts.long()[:, None] * vocab + tokens
        u = sampling.uniforms_keyed(stream_key, position.long().reshape(1, 1).expand_as(u_index), u_index)
        gumbel = -torch.log(-torch.log(u))
        # Gumbel-top-k over the float32 probabilities that are reported: the draw follows exactly the
        # listed q (Gumbel-max is invariant to the normalising constant). Tokens of zero mass sort last.
        logp = torch.log(probs.double())
        scores = torch.where(probs > 0, logp + gumbel, torch.full_like(gumbel, -math.inf))
        order = torch.argsort(scores, dim=-1, descending=True)[:, :k]
        return Picked(tokens, probs, order)


@dataclass(frozen=True)
class Picked:
    """Children of n nodes on the device, k' = min(k, candidates) each, in the order they join the
    tree: the arguments of `kernels.ops.grow_level`. The top-k rules give the children themselves,
    tokens (n, k') int64 and probs (n, k') float32 (0: no child), and no draw_order. DRAWN gives the
    distribution drawn from, tokens (n, m) int64 and probs (n, m) float32 (largest first,
    zero-padded), and draw_order (n, k') int64, the columns drawn, in draw order (the k-th draw is
    ranked by q's k-th largest probability, `nodes.rank_logq`)."""

    tokens: torch.Tensor
    probs: torch.Tensor
    draw_order: torch.Tensor | None = None


def _to_host(*tensors: torch.Tensor):
    """Tensors with the same first dimension -> numpy float64 arrays, in one device-to-host
    transfer. float32 probabilities and int64 token ids (< 2**53) are exact in float64."""
    if all(t.shape == tensors[0].shape for t in tensors):
        return tuple(torch.stack([t.double() for t in tensors]).cpu().numpy())
    flat = torch.cat([t.double().flatten(1) for t in tensors], dim=1).cpu().numpy()
    out, at = [], 0
    for t in tensors:
        width = t[0].numel()
        out.append(flat[:, at:at + width].reshape(t.shape))
        at += width
    return tuple(out)
