"""Fixtures shared by the drafter tests: the tiny drafter checkpoint loaded once."""
import pytest


@pytest.fixture(scope="session")
def draft_model(tiny_pair):
    from drafter_service.draftlm import DraftModel

    return DraftModel.load(str(tiny_pair[1]), device="cpu", max_slots=48, max_len=1024)


@pytest.fixture(scope="session")
def prompt(tiny_pair):
    """A code prompt in the tiny tokenizer (repetitive: n-gram lookup has something to find)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_pair[1])
    return tok("def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(i * i)\n\ndef add(a, b):\n")["input_ids"]
