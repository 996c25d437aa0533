"""Two row copies in one launch (Triton, interpreted) vs two `copy_` calls: exact, strided rows,
widths that differ and are not block multiples, dtype conversion, nothing written outside."""
from __future__ import annotations

import pytest
import torch

from kernels.copy_rows import BLOCK_W, copy_rows_pair, copy_rows_pair_ref

POISON = -7.0


def wide_views(T, W, dtype, gen, extra=9):
    """A (T, W) view with strided rows inside a poisoned (T, W + extra) buffer, and the buffer."""
    buf = torch.full((T, W + extra), POISON, dtype=dtype)
    return buf[:, 3:3 + W], buf


@pytest.mark.parametrize("T", [1, 5, 16])
@pytest.mark.parametrize("Wa,Wb", [(7, 7), (BLOCK_W + 3, 40), (33, 2 * BLOCK_W + 1)])
@pytest.mark.parametrize("src_dtype,dst_dtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                                 (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16)])
def test_matches_two_copies(T, Wa, Wb, src_dtype, dst_dtype):
    gen = torch.Generator().manual_seed(T * 100 + Wa + Wb)
    src_a = torch.randn(T, Wa + 5, generator=gen).to(src_dtype)[:, 2:2 + Wa]
    src_b = torch.randn(T, Wb + 4, generator=gen).to(src_dtype)[:, 1:1 + Wb]
    got_a, buf_a = wide_views(T, Wa, dst_dtype, gen)
    got_b, buf_b = wide_views(T, Wb, dst_dtype, gen)
    want_a, want_buf_a = wide_views(T, Wa, dst_dtype, gen)
    want_b, want_buf_b = wide_views(T, Wb, dst_dtype, gen)
    copy_rows_pair(got_a, src_a, got_b, src_b)
    copy_rows_pair_ref(want_a, src_a, want_b, src_b)
    assert torch.equal(buf_a, want_buf_a) and torch.equal(buf_b, want_buf_b)  # poison kept outside
    assert torch.equal(got_a, src_a.to(dst_dtype)) and torch.equal(got_b, src_b.to(dst_dtype))


def test_no_rows_and_refused_shapes():
    z = torch.zeros(0, 4)
    copy_rows_pair(z, z, z, z)
    a, b = torch.zeros(3, 4), torch.zeros(3, 5)
    with pytest.raises(ValueError, match="shapes"):
        copy_rows_pair(a, torch.zeros(3, 5), b, b)
    with pytest.raises(ValueError, match="contiguous"):
        copy_rows_pair(torch.zeros(4, 3).t(), a, b, b)
    t = torch.randn(4, 3)
    copy_rows_pair(a, t.t(), b, b)  # a source with a strided last axis is made contiguous first
    assert torch.equal(a, t.t())
    with pytest.raises(ValueError, match="dtypes"):
        copy_rows_pair(a, a, b.half(), b)


def test_compiles_for_sm90():
    """At the 2.7B shape's stash widths (xBC | dt and x | B), bf16, 16 rows of a wider in_proj output."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    from kernels import copy_rows
    from tests.kernels.ssm_oracle import assert_compiles_for_sm90

    def run_all():
        zx = torch.randn(16, 10576).to(torch.bfloat16)
        conv = torch.randn(16, 5376).to(torch.bfloat16)
        stash_a, stash_b = torch.empty(16, 2, 5456, dtype=torch.bfloat16), torch.empty(16, 2, 5248, dtype=torch.bfloat16)
        copy_rows.copy_rows_pair(stash_a[:, 1], zx[:, 5120:], stash_b[:, 1], conv[:, :5248])

    assert_compiles_for_sm90([copy_rows._copy_pair_kernel], run_all)
