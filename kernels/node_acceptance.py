"""The multi-draft acceptance rule at every node of a verified tree at once, with no host synchronisation.

`treeserve.acceptance.accept_among_children` defines what happens at one node: its children, drawn
from the draft distribution q without replacement, are tried in draw order; child k is accepted
with probability min(1, p(tok) / q(tok)), and each rejection replaces p by the normalised residual
max(p - q, 0) and removes the child's token from q. When no child is accepted, the node's token is
drawn from the last p. A node's outcome depends only on its own p, q, children and random numbers,
never on the path that reached it, so every node can be decided at once and the walk down the tree
becomes pointer chasing on the host (`treeserve.acceptance.walk`).

Inputs for N nodes of one tree over a vocabulary of V:
- p (N, V) float32: the target's transformed distribution at each node;
- q (N, V) float64: the dense draft distribution each node's children were drawn from (any row of
  a node with no children);
- children (N, M) int64: child tokens in draw order, padded with -1 (a node with none decides by the
  residual draw alone);
- accept_key, residual_key: `treeserve.sampling.stream_key` of the two streams; positions (N,) int64:
  the absolute position each node's children are candidates for. Child k's uniform is indexed k,
  the residual draw's uniforms by token.

Output (N, 2) int64: the accepted child's index in draw order (-1 when none) and the node's emitted
token (the accepted child's token, or the residual draw).

`accept_nodes_ref` is the PyTorch twin: the same float64 arithmetic, batched over nodes. The Triton
version is two launches: one program per node tries the children, keeping p and q in float64
scratch rows it rewrites after each rejection (a node's steps are sequential, so its row stays in
one program), then the residual draw from every node's last p is `kernels.gumbel_argmax.gumbel_max`
with the vocabulary split over programs (taken where no child was accepted).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.counter_noise import stream_mix, uniform
from kernels.gumbel_argmax import gumbel_max, gumbel_noise_ref

# a residual with less mass than this is rounding (p == q): p is kept as it is
_TINY = tl.constexpr(1e-12)


def _check(p: torch.Tensor, q: torch.Tensor, children: torch.Tensor, positions: torch.Tensor) -> None:
    if p.dim() != 2 or q.shape != p.shape:
        raise ValueError(f"accept_nodes: p and q must be (N, V), got {tuple(p.shape)} and {tuple(q.shape)}")
    n = p.shape[0]
    if children.dim() != 2 or children.shape[0] != n:
        raise ValueError(f"accept_nodes: children must be ({n}, M), got {tuple(children.shape)}")
    if positions.shape != (n,) or positions.device != p.device:
        raise ValueError(f"accept_nodes: positions must be ({n},) on {p.device}, got {tuple(positions.shape)} on {positions.device}")


def accept_nodes_ref(p: torch.Tensor, q: torch.Tensor, children: torch.Tensor, accept_key: int, residual_key: int,
                     positions: torch.Tensor) -> torch.Tensor:
    """See the module docstring; returns (N, 2) int64 [accepted child or -1, emitted token]."""
    from treeserve.sampling import uniforms_keyed

    _check(p, q, children, positions)
    n, vocab = p.shape
    dev = p.device
    p, q = p.double().clone(), q.double().clone()
    children = children.long()
    positions = positions.long()
    chosen = torch.full((n,), -1, dtype=torch.long, device=dev)
    token = torch.full((n,), -1, dtype=torch.long, device=dev)
    done = torch.zeros(n, dtype=torch.bool, device=dev)
    width = children.shape[1]
    if width:
        u = uniforms_keyed(accept_key, positions[:, None], torch.arange(width, device=dev)[None, :])
    for k in range(width):
        tok = children[:, k]
        live = (tok >= 0) & ~done
        at = tok.clamp(min=0)[:, None]
        pc, qc = p.gather(1, at)[:, 0], q.gather(1, at)[:, 0]
        accept = live & (qc > 0.0) & (u[:, k] * qc < pc)
        chosen = torch.where(accept, k, chosen)
        token = torch.where(accept, tok, token)
        done = done | accept
        rejected = (live & ~accept)[:, None]
        r = torch.clamp(p - q, min=0.0)
        total = r.sum(-1, keepdim=True)
        p = torch.where(rejected & (total > _TINY.value), r / total, p)
        q_left = q.scatter(1, at, 0.0)
        left = q_left.sum(-1, keepdim=True)
        q = torch.where(rejected, torch.where(left > 0.0, q_left / left, q_left), q)
    drawn = (torch.log(p) + gumbel_noise_ref(residual_key, positions, vocab)).argmax(-1)
    token = torch.where(done, token, drawn)
    return torch.stack([chosen, token], dim=1)


@triton.jit
def _row_sums(p_row, q_row, tok, V, BLOCK: tl.constexpr):
    """(sum of max(p - q, 0), sum of q with `tok` zeroed) over one row."""
    lanes = tl.arange(0, BLOCK)
    total = tl.zeros([BLOCK], tl.float64)
    left = tl.zeros([BLOCK], tl.float64)
    for start in range(0, V, BLOCK):
        v = start + lanes
        live = v < V
        pv = tl.load(p_row + v, mask=live, other=0.0)
        qv = tl.load(q_row + v, mask=live, other=0.0)
        total += tl.maximum(pv - qv, 0.0)
        left += tl.where(v == tok, 0.0, qv)
    return tl.sum(total, axis=0), tl.sum(left, axis=0)


@triton.jit
def _reject(p_row, q_row, tok, total, left, V, BLOCK: tl.constexpr):
    """Rewrite the row after child `tok` is rejected: p by its normalised residual, q without tok."""
    lanes = tl.arange(0, BLOCK)
    keep_p = total <= _TINY
    renorm_q = left > 0.0
    for start in range(0, V, BLOCK):
        v = start + lanes
        live = v < V
        pv = tl.load(p_row + v, mask=live, other=0.0)
        qv = tl.load(q_row + v, mask=live, other=0.0)
        new_p = tl.where(keep_p, pv, tl.maximum(pv - qv, 0.0) / total)
        qv = tl.where(v == tok, 0.0, qv)
        new_q = tl.where(renorm_q, qv / left, qv)
        tl.store(p_row + v, new_p, mask=live)
        tl.store(q_row + v, new_q, mask=live)


# Not specialised on: the key and M (the widest node of this tree) vary per call; the children and
# positions are views at any offset into one packed copy (read a few times a node).
@triton.jit(do_not_specialize=["accept_key", "M", "child_ptr", "pos_ptr"])
def _accept_nodes_kernel(p_ptr, q_ptr, child_ptr, pos_ptr, out_ptr, accept_key, V, M,
                         BLOCK: tl.constexpr):
    node = tl.program_id(0)
    p_row = p_ptr + node.to(tl.int64) * V
    q_row = q_ptr + node.to(tl.int64) * V
    position = tl.load(pos_ptr + node).to(tl.int64)
    mixed_accept = stream_mix(accept_key.to(tl.int64))
    chosen = -1
    token = -1
    for k in range(0, M):
        tok = tl.load(child_ptr + node * M + k)
        if (chosen < 0) & (tok >= 0):
            pc = tl.load(p_row + tok)
            qc = tl.load(q_row + tok)
            u = uniform(mixed_accept, position, k + tl.zeros([], tl.int64))
            if (qc > 0.0) & (u * qc < pc):
                chosen = k
                token = tok.to(tl.int32)
            else:
                total, left = _row_sums(p_row, q_row, tok, V, BLOCK)
                tl.debug_barrier()  # every lane has read the row before any rewrites it
                _reject(p_row, q_row, tok, total, left, V, BLOCK)
                tl.debug_barrier()  # and the rewrite is whole before the next read
    tl.store(out_ptr + node * 2, chosen.to(tl.int64))
    tl.store(out_ptr + node * 2 + 1, token.to(tl.int64))


def accept_nodes(p: torch.Tensor, q: torch.Tensor, children: torch.Tensor, accept_key: int, residual_key: int,
                 positions: torch.Tensor) -> torch.Tensor:
    """Triton twin of `accept_nodes_ref` (same arguments): two launches, see the module docstring."""
    _check(p, q, children, positions)
    n, vocab = p.shape
    out = torch.empty((n, 2), dtype=torch.int64, device=p.device)
    if n == 0:
        return out
    # float64 scratch rows the kernel rewrites after each rejection
    p64 = p.to(torch.float64, copy=True).contiguous()
    q64 = q.to(torch.float64, copy=True).contiguous()
    children = children.long().contiguous()
    positions = positions.long().contiguous()
    _accept_nodes_kernel[(n,)](p64, q64, children, positions, out, int(accept_key), vocab, children.shape[1],
                               BLOCK=min(1024, triton.next_power_of_2(vocab)), num_warps=8)
    # the residual draw from each node's last p, the vocabulary split over programs
    drawn = gumbel_max(p64, 1.0, None, residual_key, positions, log_f64=True)
    out[:, 1] = torch.where(out[:, 0] >= 0, out[:, 1], drawn)
    return out
