"""The `gpu` mark of the CUDA kernel tests: skipped without a device, failed (not skipped) when the
kernels would run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA)."""
import os

import pytest
import torch

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def compiled_triton():
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail("CUDA tests must run compiled kernels: set TRITON_INTERPRET=0 (tests/conftest.py defaults it to 1)")


def gpu(fn):
    """A CUDA test: skipped without a device, failed (not skipped) if the kernels are interpreted."""
    return cuda(pytest.mark.usefixtures("compiled_triton")(fn))
