"""`treeserve drafter`'s options: numbers the drafter could only fail on later are refused when the
command line is read; the length limit and the idle timeout reach the engine."""
import argparse

import pytest

from drafter_service.cli import add_arguments, build
from drafter_service.limits import IDLE_TIMEOUT_S, MODEL_MAX_LEN, NGRAM_MAX_LEN


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("option, bad", [
    ("--ahead-slots", "-4"), ("--ahead-trees", "-1"), ("--ahead-fanout", "0"), ("--vocab-limit", "-1"),
    ("--max-nodes", "0"), ("--support", "0"), ("--node-budget", "0"), ("--max-depth", "-1"),
    ("--max-sequences", "0"), ("--max-len", "0"), ("--max-nodes", "2.5"), ("--support", "many"),
    ("--idle-timeout-s", "-1"), ("--idle-timeout-s", "nan"), ("--support", "4097"),
])
def test_a_number_that_would_break_the_drafter_is_refused_at_parse_time(option, bad, capsys):
    with pytest.raises(SystemExit):
        parse("--ngram", option, bad)
    err = capsys.readouterr().err
    assert f"argument {option}:" in err and bad in err


def test_the_smallest_useful_values_are_taken():
    args = parse("--ngram", "--ahead-slots", "0", "--ahead-trees", "0", "--vocab-limit", "0", "--max-depth", "0",
                 "--max-nodes", "1", "--node-budget", "1", "--support", "1", "--idle-timeout-s", "0")
    assert (args.ahead_slots, args.max_nodes, args.idle_timeout_s) == (0, 1, 0.0)


def test_an_ngram_drafter_is_bounded_and_sweeps_by_default():
    d = build(parse("--ngram"))
    try:
        assert d.max_len == NGRAM_MAX_LEN and d.idle_timeout_s == IDLE_TIMEOUT_S
    finally:
        d.close()
    d = build(parse("--ngram", "--max-len", "100", "--idle-timeout-s", "0"))
    try:
        assert d.max_len == 100 and d.idle_timeout_s == 0
    finally:
        d.close()


def test_a_model_drafter_keeps_the_models_length(tiny_pair):
    d = build(parse("--model", str(tiny_pair[1]), "--max-sequences", "1", "--no-draft-ahead"))
    try:
        assert d.max_len == d.model.max_len == MODEL_MAX_LEN
    finally:
        d.close()


@pytest.mark.parametrize("shape", ["dynamic", "static", "chain", "fused"])
def test_a_model_shape_without_a_model_is_a_clear_exit(shape):
    with pytest.raises(SystemExit) as info:
        build(parse("--ngram", "--shape", shape))
    assert "needs a draft model" in str(info.value)
