"""`treeserve serve` turns its flags into a plan for its child services."""
import argparse

import pytest

from orchestrator.cli_serve import SetupError, add_arguments, plan_from


def parse(*argv):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_default_plan_is_the_demo_pair_without_trimming():
    plan = plan_from(parse("--device", "cpu"))
    assert plan.drafter is not None and plan.drafter.name == "drafter" and not plan.ngram
    assert plan.drafter_trim_vocab is None


def test_trimmed_vocabulary_reaches_the_plan(tmp_path):
    trim = tmp_path / "vocab_subset.json"
    trim.write_text("{}")  # the drafter validates the contents when it loads it
    plan = plan_from(parse("--device", "cpu", "--drafter-trim-vocab", str(trim)))
    assert plan.drafter_trim_vocab == trim


def test_trimmed_vocabulary_needs_a_draft_model(tmp_path):
    trim = tmp_path / "vocab_subset.json"
    trim.write_text("{}")
    with pytest.raises(SetupError, match="needs a draft model"):
        plan_from(parse("--device", "cpu", "--ngram", "--drafter-trim-vocab", str(trim)))


def test_missing_trimmed_vocabulary_file_is_a_clear_error(tmp_path):
    with pytest.raises(SetupError, match="not found"):
        plan_from(parse("--device", "cpu", "--drafter-trim-vocab", str(tmp_path / "nope.json")))
