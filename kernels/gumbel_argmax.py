"""Seeded sampling of one token per row by Gumbel-max, in one launch.

The token of row t is

    argmax_v  z[t, v] + g(key, positions[t], v),   z = scale · (logits[t] - shift[t])  where z >= floor[t], else -inf

with g = -log(-log(u)) of the counter-based uniform u (`kernels.counter_noise`, float64, rounded to
float32 before the sum). z is a row's log-probabilities up to a constant, so the token follows the
row's softmax exactly; `floor` is how top-k enters (the k-th largest z). `shift` (the row's largest
logit) keeps z near 0 at the top of the row whatever the temperature: at temperature 1e-5 a logit
of 10 scales to 1e6, where float32's spacing (1/16) rounds the noise away and near ties went to
the lower index. Ties go to the lowest index, as torch.argmax's do.

`gumbel_argmax_ref` is the PyTorch twin: it builds the (T, V) noise and scores. The kernel reads the
logits once: a row's vocabulary is split over programs (the hash and two logarithms per token make
one program per row compute-bound at large vocabularies), each keeps a running best per lane and
writes its split's best; the first maximum over the splits is the token. `gumbel_max` also serves
`kernels.node_acceptance`'s residual draw, on float64 probabilities.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.counter_noise import stream_mix, uniform


def _check(logits: torch.Tensor, floor: torch.Tensor | None, positions: torch.Tensor,
           shift: torch.Tensor | None = None) -> None:
    if logits.dim() != 2:
        raise ValueError(f"gumbel_argmax: logits must be (T, V), got {tuple(logits.shape)}")
    rows = logits.shape[0]
    if positions.shape != (rows,) or positions.device != logits.device:
        raise ValueError(f"gumbel_argmax: positions must be ({rows},) on {logits.device}, "
                         f"got {tuple(positions.shape)} on {positions.device}")
    for name, per_row in (("floor", floor), ("shift", shift)):
        if per_row is not None and per_row.shape != (rows,):
            raise ValueError(f"gumbel_argmax: {name} must be ({rows},), got {tuple(per_row.shape)}")


def gumbel_noise_ref(key: int, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """(T, V) float64 Gumbel noise -log(-log(u)) of the counter-based uniforms at (key, position,
    token): what both sampling kernels add, in PyTorch."""
    from treeserve.sampling import uniforms_keyed

    index = torch.arange(vocab, device=positions.device)[None, :]
    return -torch.log(-torch.log(uniforms_keyed(key, positions.long()[:, None], index)))


def gumbel_argmax_ref(logits: torch.Tensor, scale: float, floor: torch.Tensor | None, key: int,
                      positions: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
    """logits (T, V) any float dtype; scale: the factor z = scale · (logits - shift) (1 / temperature);
    floor (T,) float32 or None: z below it is excluded; key: `treeserve.sampling.stream_key`;
    positions (T,) int64; shift (T,) float32 or None (0) -> (T,) int64 tokens."""
    _check(logits, floor, positions, shift)
    z = logits.float()
    if shift is not None:
        z = z - shift.float()[:, None]
    z = z * torch.tensor(scale, dtype=torch.float32)
    if floor is not None:
        z = z.masked_fill(z < floor.float()[:, None], float("-inf"))
    return (z + gumbel_noise_ref(key, positions, logits.shape[1]).float()).argmax(-1)


# Not specialised on: the key, which varies per call (a key of 1 would become a constant), and the
# per-row positions, floors and shifts, read once a row: positions are often views at any offset
# into a packed buffer, whose alignment would pick one program or another per call (a missing
# floor or shift passes the positions in its place). The logits are specialised: the hot read.
@triton.jit(do_not_specialize=["key", "floor_ptr", "shift_ptr", "pos_ptr"])
def _gumbel_max_kernel(x_ptr, stride_row, floor_ptr, shift_ptr, pos_ptr, best_ptr, at_ptr, scale, key, V, CHUNK,
                       HAS_FLOOR: tl.constexpr, HAS_SHIFT: tl.constexpr, LOG_F64: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Program (row, split): the best (score, index) of the row's columns [split·CHUNK, +CHUNK).
    LOG_F64: x holds float64 probabilities and the score is log x + g in float64; otherwise
    x holds logits and the score is scale·(x - shift) + g in float32, excluded below the row's
    floor."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    position = tl.load(pos_ptr + row).to(tl.int64)
    mixed = stream_mix(key.to(tl.int64))
    if HAS_FLOOR:
        floor = tl.load(floor_ptr + row).to(tl.float32)
    else:
        floor = float("-inf")
    if HAS_SHIFT:
        shift = tl.load(shift_ptr + row).to(tl.float32)
    lanes = tl.arange(0, BLOCK)
    if LOG_F64:
        best = tl.full([BLOCK], float("-inf"), tl.float64)
    else:
        best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.full([BLOCK], 2147483647, tl.int32)
    base = x_ptr + row.to(tl.int64) * stride_row
    stop = tl.minimum(split * CHUNK + CHUNK, V)
    for start in range(split * CHUNK, stop, BLOCK):
        v = start + lanes
        live = v < stop
        x = tl.load(base + v, mask=live, other=1.0)
        g = -tl.log(-tl.log(uniform(mixed, position, v.to(tl.int64))))
        if LOG_F64:
            s = tl.where(live, tl.log(x) + g, float("-inf"))
        else:
            if HAS_SHIFT:
                z = (x.to(tl.float32) - shift) * scale
            else:
                z = x.to(tl.float32) * scale
            s = tl.where(live & (z >= floor), z + g.to(tl.float32), float("-inf"))
        # strictly greater: a lane sees its indices in increasing order, so it keeps the first
        better = s > best
        best = tl.where(better, s, best)
        best_at = tl.where(better, v, best_at)
    top = tl.max(best, axis=0)
    tl.store(best_ptr + row * splits + split, top.to(tl.float64))
    tl.store(at_ptr + row * splits + split, tl.min(tl.where(best == top, best_at, 2147483647), axis=0).to(tl.int64))


def _splits(rows: int, vocab: int, device: torch.device) -> int:
    """Programs a row's vocabulary is split over: enough for two programs a core in all, about 4096
    columns or more each (chunks are rounded up to 1024 columns, so the last may be shorter); a
    vocabulary under 8192 is one program a row, and one launch."""
    cores = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(triton.cdiv(2 * cores, max(rows, 1)), vocab // 4096))


def gumbel_max(x: torch.Tensor, scale: float, floor: torch.Tensor | None, key: int, positions: torch.Tensor,
               log_f64: bool, splits: int | None = None, shift: torch.Tensor | None = None) -> torch.Tensor:
    """(T,) int64: each row's Gumbel-max index, the vocabulary split over programs (`splits`, or
    `_splits`' choice); the best of the splits is the first maximum (lowest index on ties, as
    within a split)."""
    rows, vocab = x.shape
    if rows == 0:
        return torch.empty(0, dtype=torch.int64, device=x.device)
    if x.stride(1) != 1:
        x = x.contiguous()
    splits = splits or _splits(rows, vocab, x.device)
    chunk = triton.cdiv(triton.cdiv(vocab, splits), 1024) * 1024
    splits = triton.cdiv(vocab, chunk)
    best = torch.empty((rows, splits), dtype=torch.float64, device=x.device)
    at = torch.empty((rows, splits), dtype=torch.int64, device=x.device)
    positions = positions.long().contiguous()
    floor_arg = floor.float().contiguous() if floor is not None else positions
    shift_arg = shift.float().contiguous() if shift is not None else positions
    _gumbel_max_kernel[(rows, splits)](x, x.stride(0), floor_arg, shift_arg, positions, best, at, float(scale),
                                       int(key), vocab, chunk, HAS_FLOOR=floor is not None,
                                       HAS_SHIFT=shift is not None, LOG_F64=log_f64,
                                       BLOCK=min(1024, triton.next_power_of_2(vocab)), num_warps=4,
                                       # scale·x + g rounded as the twin rounds it: no fused multiply-add
                                       enable_fp_fusion=False)
    if splits == 1:
        return at[:, 0]
    return at.gather(1, best.argmax(1, keepdim=True))[:, 0]


def gumbel_argmax(logits: torch.Tensor, scale: float, floor: torch.Tensor | None, key: int,
                  positions: torch.Tensor, shift: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of `gumbel_argmax_ref` (same arguments)."""
    _check(logits, floor, positions, shift)
    return gumbel_max(logits, scale, floor, key, positions, log_f64=False, shift=shift)
