"""Sampling: the logits transform shared by target and drafter, and counter-based randomness.

Randomness is a pure function of (seed, absolute position, stream, index), computed with integer
hashing on the tensors' own device. Two consequences the product relies on:
- the target's sample at position t does not depend on how many tree nodes were verified with it,
  so sampled speculative output equals sampled plain decoding with the same seed, token for token;
- CPU and GPU draw identical random numbers (integer arithmetic is exact everywhere).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Streams keep the random numbers of different uses independent.
STREAM_TARGET = 0  # the target's per-node sample
STREAM_ACCEPT = 1  # multi-draft acceptance uniforms
STREAM_RESIDUAL = 2  # sample from the residual distribution after all children are rejected
STREAM_DRAFT = 3  # the drafter's Gumbel-top-k draws

_MASK64 = (1 << 64) - 1


def _signed(v: int) -> int:
    v &= _MASK64
    return v - (1 << 64) if v >= (1 << 63) else v


# splitmix64's constants as signed int64 (kernels/counter_noise.py hashes with the same)
MIX_M1 = _signed(0xBF58476D1CE4E5B9)
MIX_M2 = _signed(0x94D049BB133111EB)
GOLDEN = _signed(0x9E3779B97F4A7C15)


# Temperatures below this are greedy: logits scaled by 1 / temperature would overflow float32 (at
# 1e-36 a logit of 400 already does) and turn the distribution into NaNs; the limit is the argmax.
MIN_TEMPERATURE = 1e-5
# Above this every distribution is uniform to float32 precision anyway; an infinite one (1 / T = 0)
# would drop top-k and turn -inf logits into NaN
MAX_TEMPERATURE = 1e4


@dataclass(frozen=True)
class Sampling:
    """temperature 0 (or below MIN_TEMPERATURE) = greedy. top_k 0 = off. top_p 0 or 1 = off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 0.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def truncations(self) -> "Truncations":
        """Which truncations `transform` applies (what a captured graph of it depends on; the
        values themselves can come from a device tensor, `transform_values`)."""
        return Truncations(top_k=self.top_k > 0, top_p=0.0 < self.top_p < 1.0)

    def validate(self) -> "Sampling":
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        return self

    @classmethod
    def from_proto(cls, msg) -> "Sampling":
        return cls(float(msg.temperature), int(msg.top_k), float(msg.top_p), int(msg.seed)).validate()

    def to_proto(self):
        from treeserve.v1 import treeserve_pb2 as pb

        return pb.SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)


@dataclass(frozen=True)
class Truncations:
    """Which truncations a non-greedy transform applies: top-k (top_k > 0), top-p (0 < top_p < 1)."""

    top_k: bool
    top_p: bool


def transform(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """(..., V) logits -> (..., V) float32 probabilities after temperature, top-k, then top-p.
    Greedy settings give a one-hot at the argmax (ties: lowest index, like torch.argmax)."""
    if s.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    return _truncated(logits, 1.0 / s.temperature, s.top_k, s.top_p, s.truncations)


def transform_values(s: Sampling) -> torch.Tensor:
    """(3,) float32 on the CPU: 1 / temperature, top_k and top_p, as `transform_by` reads them
    (zeros for greedy settings, which have no transform to apply). float32 holds top_k exactly up
    to 2**24, past any vocabulary (and a k past the vocabulary masks nothing either way)."""
    if s.greedy:
        return torch.zeros(3, dtype=torch.float32)
    return torch.tensor([1.0 / s.temperature, s.top_k, s.top_p], dtype=torch.float32)


def transform_by(logits: torch.Tensor, values: torch.Tensor, truncations: Truncations) -> torch.Tensor:
    """`transform` of non-greedy settings with their values in a device tensor (`transform_values`)
    and only their `truncations` fixed: no host synchronisation, so one CUDA graph serves every
    temperature, top-k and top-p with these truncations. The same probabilities as `transform`,
    bit for bit."""
    return _truncated(logits, values[0], values[1], values[2], truncations)


Scalar = float | int | torch.Tensor  # a Python number, or a 0-d float32 tensor on the logits' device


def _scaled(logits: torch.Tensor, scale: Scalar) -> torch.Tensor:
    """float32 logits times float32 `scale`: a Python float meets a float32 tensor as a float32
    value, so a number and a tensor holding its float32 rounding give the same bits. (The softmax
    after it takes out each row's largest itself: no shift is needed here.)"""
    return logits.float() * scale


def _truncated(logits: torch.Tensor, scale: Scalar, top_k: Scalar, top_p: Scalar,
               truncations: Truncations) -> torch.Tensor:
    """Scale, top-k, softmax, top-p."""
    logits = _scaled(logits, scale)
    width = logits.shape[-1]
    if truncations.top_k and isinstance(top_k, torch.Tensor):
        # the k-th largest by sorting (topk needs k on the host); k >= width masks nothing
        at = (top_k.long().clamp(1, width) - 1).expand(*logits.shape[:-1], 1)
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(-1, at)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    elif truncations.top_k and top_k < width:
        kth = torch.topk(logits, int(top_k), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if truncations.top_p:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p: a token stays if the mass before it < top_p
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep_sorted = before < top_p
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = torch.where(keep, probs, torch.zeros_like(probs))
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def scaled_logits(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """float32 (logits - row max) times float32(1 / temperature), what `kernels.gumbel_argmax` forms
    given the row max as its shift: the log-probabilities of the sampled distribution up to a
    constant per row, 0 at the row's top. The shift keeps the top near 0 at any temperature, where
    Gumbel noise added to it keeps its precision (at 1e-5 a logit of 10 would scale to 1e6, where
    float32 resolves no finer than 1/16)."""
    z = logits.float()
    return _scaled(z - z.amax(-1, keepdim=True), 1.0 / s.temperature)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 tensors (wrapping arithmetic, logical shifts)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * MIX_M1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * MIX_M2
    x = x ^ ((x >> 31) & ((1 << 33) - 1))
    return x


def _mix_int(v: int) -> int:
    """`_mix` on one Python int (mod 2**64): a bijection of 64-bit values."""
    v &= _MASK64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _MASK64
    return v ^ (v >> 31)


def stream_key(seed: int, stream: int) -> int:
    """The int64 key of one (seed, stream) pair: what `uniforms_keyed` takes, so that a caller
    can keep it in a device tensor (a CUDA graph then draws with any seed without a new capture).
    The seed is mixed before the stream is added: with `seed * 4 + stream`, seeds 2**62 apart
    shared every stream."""
    return _signed(_mix_int(_mix_int(seed) + stream))


def _hash(key: torch.Tensor | int, positions: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int64 hash of (stream key, position, index); the key (an int or a 0-d/1-element int64
    tensor), positions and index broadcast."""
    key = _mix(torch.zeros_like(positions) + key + GOLDEN)
    x = _mix(key ^ (positions * GOLDEN))
    return _mix(x + index * MIX_M1)


def uniforms_keyed(key: torch.Tensor | int, positions: torch.Tensor, index: torch.Tensor | int = 0) -> torch.Tensor:
    """`uniforms` for the stream key `stream_key(seed, stream)`, given as an int or an int64 tensor."""
    positions = positions.long()
    if not isinstance(index, torch.Tensor):
        index = torch.full_like(positions, int(index))
    h = _hash(key, positions, index.long())
    top24 = (h >> 40) & ((1 << 24) - 1)
    return (top24.double() + 0.5) / float(1 << 24)


def uniforms(seed: int, positions: torch.Tensor, stream: int, index: torch.Tensor | int = 0) -> torch.Tensor:
    """Uniform floats in (0, 1), shape of `positions` broadcast with `index` (both int64)."""
    return uniforms_keyed(stream_key(seed, stream), positions, index)
