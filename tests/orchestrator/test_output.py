"""Incremental detokenisation and stop strings, with the tiny byte-level tokenizer."""
from __future__ import annotations

import pytest

from orchestrator.output import REPLACEMENT, Detokenizer, OutputStream, StopMatcher


@pytest.fixture(scope="module")
def tok(tiny_pair):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_pair[0])


TEXTS = ["def add(a, b):\n    return a + b\n", "héllo wörld → 世界 🙂 done", "🙂🙂🙂", "x = 'ü'\n"]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_never_splits_a_character(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) > 3
    d = Detokenizer(tok)
    pieces = [d.push([t]) for t in ids]
    pieces.append(d.flush())
    assert all(REPLACEMENT not in p for p in pieces), pieces
    assert "".join(pieces) == text
    # multi-byte characters are split over several byte tokens: some pushes must have waited
    if any(ord(c) > 127 for c in text):
        assert "" in pieces[:-1]


def test_prompt_context_is_not_repeated(tok):
    prompt = tok("def f(x):", add_special_tokens=False)["input_ids"]
    gen = tok("\n    return x", add_special_tokens=False)["input_ids"]
    d = Detokenizer(tok, context=prompt)
    assert "".join(d.push([t]) for t in gen) + d.flush() == "\n    return x"


def test_truncated_character_is_flushed_as_replacement(tok):
    ids = tok("a🙂", add_special_tokens=False)["input_ids"]
    d = Detokenizer(tok)
    text = "".join(d.push([t]) for t in ids[:-1])
    assert text == "a"
    assert d.flush() == REPLACEMENT


def test_stop_matcher_across_pieces():
    m = StopMatcher(["STOP", "\n\n"])
    out = []
    for piece in ["abc S", "T", "O", "x", " ST", "OP tail"]:
        text, stopped = m.feed(piece)
        out.append(text)
        if stopped:
            break
    assert "".join(out) == "abc STOx "
    assert stopped


def test_stop_matcher_holds_only_possible_prefixes():
    m = StopMatcher(["abc"])
    assert m.feed("xxa") == ("xx", False)
    assert m.feed("b") == ("", False)
    assert m.feed("d") == ("abd", False)
    assert m.flush() == ""


@pytest.mark.parametrize("stop", ["return", "\n", "a + b", "):\n"])
def test_output_stream_stops_before_the_stop_string(tok, stop):
    text = "def add(a, b):\n    return a + b\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    s = OutputStream(tok, [stop])
    got_text, got_ids, stopped = "", [], False
    for t in ids:
        c = s.push([t])
        got_text += c.text
        got_ids += c.token_ids
        if c.stopped:
            stopped = True
            break
    assert stopped
    assert got_text == text[: text.index(stop)]
    # the ids sent cover the text sent, and no token that starts after the stop
    assert tok.decode(got_ids).startswith(got_text)
    assert len(tok.decode(got_ids)) < len(got_text) + len(stop) + 8


@pytest.mark.parametrize("step", [2, 3, 5])
@pytest.mark.parametrize("stop", ["return", "\n", "a + b", "):\n"])
def test_a_step_of_several_tokens_sends_what_single_tokens_would(tok, stop, step):
    """A speculative step pushes several ids at once; around a stop string the client still gets
    the same ids and text as from one token at a time (no id after the stop)."""
    text = "def add(a, b):\n    return a + b\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]

    def run(groups):
        s = OutputStream(tok, [stop])
        got_ids, got_text = [], ""
        for group in groups:
            c = s.push(group)
            got_ids += c.token_ids
            got_text += c.text
            if c.stopped:
                return got_ids, got_text
        raise AssertionError("no stop")

    assert run([ids[i:i + step] for i in range(0, len(ids), step)]) == run([[t] for t in ids])


def test_output_stream_without_stop_releases_ids_with_their_text(tok):
    text = "héllo 世界 🙂\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    s = OutputStream(tok, ["zzz"])
    got_text, got_ids = "", []
    for i in range(0, len(ids), 2):
        c = s.push(ids[i:i + 2])
        assert REPLACEMENT not in c.text
        got_text += c.text
        got_ids += c.token_ids
        assert tok.decode(got_ids) == got_text  # ids and text always agree
    c = s.finish()
    assert got_text + c.text == text
    assert got_ids + c.token_ids == ids


def test_output_stream_without_tokenizer_passes_ids():
    s = OutputStream(None)
    assert s.push([1, 2]).token_ids == [1, 2]
    with pytest.raises(ValueError):
        OutputStream(None, ["x"])


@pytest.mark.parametrize("char", ["é", "世", "🙂"])
def test_a_prompt_that_ends_inside_a_character_loses_no_text(tok, char):
    """Token ids of "ab" and the first byte(s) of `char` as the prompt (a client continuing from an
    output cut at its length): the generated ids that complete the character send it."""
    ids = tok("ab" + char + "xy", add_special_tokens=False)["input_ids"]
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith(REPLACEMENT))
    d = Detokenizer(tok, context=ids[:cut])
    pieces = [d.push([t]) for t in ids[cut:]] + [d.flush()]
    assert "".join(pieces) == char + "xy"


def test_bytes_that_make_no_character_go_out_instead_of_waiting_for_ever(tok):
    """A run of continuation bytes never decodes: after MAX_PENDING_IDS ids it goes out as U+FFFD
    rather than keeping every later token back (and decoding an ever longer window)."""
    from orchestrator.output import MAX_PENDING_IDS

    lone = tok("🙂", add_special_tokens=False)["input_ids"][-1]  # a continuation byte on its own
    assert tok.decode([lone]) == REPLACEMENT
    d = Detokenizer(tok)
    pieces = [d.push([lone]) for _ in range(3 * MAX_PENDING_IDS)]
    assert "".join(pieces[:MAX_PENDING_IDS]) == ""
    assert any(pieces[MAX_PENDING_IDS:2 * MAX_PENDING_IDS])  # out, not kept for the flush
    a = tok("a", add_special_tokens=False)["input_ids"]
    assert (d.push(a) + d.flush()).strip(REPLACEMENT) == "a"  # what was pending goes out with it


@pytest.mark.parametrize("stray", range(12))
def test_stray_bytes_before_a_character_do_not_take_it_with_them(tok, stray):
    """Past MAX_PENDING_IDS the undecodable bytes go out, but not the last few ids, which may be
    the beginning of a character: what the client gets is the whole decode, the emoji included."""
    lone = tok("🙂", add_special_tokens=False)["input_ids"][-1]
    ids = [lone] * stray + tok("🙂ok", add_special_tokens=False)["input_ids"]
    d = Detokenizer(tok)
    assert "".join(d.push([t]) for t in ids) + d.flush() == tok.decode(ids) == REPLACEMENT * stray + "🙂ok"


def test_a_prompts_own_undecodable_byte_stays_the_prompts(tok):
    """The prompt ends in a stray byte and then the first byte of 中; the generated ids complete 中:
    the client gets 中 and what follows, not the prompt's U+FFFD."""
    lone = tok("🙂", add_special_tokens=False)["input_ids"][-1]
    han = tok("中", add_special_tokens=False)["input_ids"]
    prompt = tok("ab", add_special_tokens=False)["input_ids"] + [lone] + han[:1]
    d = Detokenizer(tok, context=prompt)
    generated = han[1:] + tok("xy", add_special_tokens=False)["input_ids"]
    assert "".join(d.push([t]) for t in generated) + d.flush() == "中xy"
