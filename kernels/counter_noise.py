"""Counter-based uniforms inside Triton kernels: `treeserve.sampling.uniforms_keyed`, bit for bit.

A uniform is a pure function of (stream key, absolute position, index): splitmix64 finalisers on
wrapping int64 arithmetic, the top 24 bits of the hash, centred in their cell. The kernels that
sample on the device (`kernels.gumbel_argmax`, `kernels.node_acceptance`) call `uniform` so that a
token drawn by a kernel equals the token the PyTorch twin draws on the CPU.

Signed int64 throughout, as in the PyTorch definition: a logical right shift is an arithmetic
shift masked to the bits it keeps, and multiplications wrap.
"""
from __future__ import annotations

import triton
import triton.language as tl

from treeserve import sampling

_M1 = tl.constexpr(sampling.MIX_M1)
_M2 = tl.constexpr(sampling.MIX_M2)
_GOLDEN = tl.constexpr(sampling.GOLDEN)


@triton.jit
def _mix(x):
    """splitmix64's finaliser on an int64 tensor."""
    x = x ^ ((x >> 30) & 0x3FFFFFFFF)
    x = x * _M1
    x = x ^ ((x >> 27) & 0x1FFFFFFFFF)
    x = x * _M2
    x = x ^ ((x >> 31) & 0x1FFFFFFFF)
    return x


@triton.jit
def stream_mix(key):
    """The part of the hash that depends on the stream key alone (int64 scalar or tensor)."""
    return _mix(key + _GOLDEN)


@triton.jit
def uniform(mixed_key, position, index):
    """float64 uniforms in (0, 1); `mixed_key` from `stream_mix`, position and index int64,
    broadcast together."""
    x = _mix(mixed_key ^ (position * _GOLDEN))
    h = _mix(x + index * _M1)
    top24 = (h >> 40) & 0xFFFFFF
    return (top24.to(tl.float64) + 0.5) / 16777216.0
