"""Test-wide environment: set before any kernel module is imported (Triton reads it at definition)."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import treeserve  # noqa: E402,F401  (gRPC core settings, before any test module loads grpc)

import torch  # noqa: E402  (torch defines no Triton kernels: safe before TRITON_INTERPRET)

# Without a GPU, Triton kernels run in the interpreter on CPU tensors; on a GPU they compile.
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
torch.set_num_threads(1)

if os.environ["TRITON_INTERPRET"] == "1":
    from tests.kernels import interpret_compat

    interpret_compat.install()

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target_dir, drafter_dir): tiny random NemotronH target and Mamba2 drafter with a tokenizer."""
    from tests.checkpoints import make_pair

    return make_pair(tmp_path_factory.mktemp("tiny_pair"))
