"""What the client sees of a request's tokens: incremental text and stop strings.

`Detokenizer` turns a growing list of token ids into text deltas. It decodes a small window (from
`prefix` to the end) twice, with and without the newest tokens, and emits the difference only when
it does not end in U+FFFD: a byte-level tokenizer can split one UTF-8 character over several
tokens, and the half-decoded character must wait for the rest of its bytes. Decoding the window
rather than one token at a time keeps tokenizers that treat a word's first piece specially (a
leading space in SentencePiece) correct.

`StopMatcher` finds stop strings across token boundaries: text that could still be the beginning
of a stop string is held back until it is known not to be.

`OutputStream` combines the two and decides which token ids go out with which text: a token is
released once all of its text has been released, so the ids a message carries match its text
(except around a stop string, where the token that contains the stop's first character is still
sent while the text ends before the stop).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

REPLACEMENT = "\ufffd"
# A UTF-8 character is at most 4 bytes, so at most 4 byte tokens: text that still ends in U+FFFD
# after this many new ids holds bytes that make no character, and goes out as it is (waiting on
# would decode an ever longer window, and send nothing until the end)
MAX_PENDING_IDS = 8
MAX_CHAR_IDS = 3  # the ids kept back then: a character's first bytes, whose rest may still come


class Detokenizer:
    """Incremental decoding of one sequence of generated ids. `tokenizer` is a transformers
    tokenizer (anything with `decode(ids, skip_special_tokens=...)`)."""

    def __init__(self, tokenizer, context: Sequence[int] = ()):
        self._tok = tokenizer
        # Starting the window inside the prompt gives the first generated token its real context
        # (e.g. no spurious leading-space handling at the start of a decode).
        self._ids: list[int] = list(context[-4:])
        self._prefix = 0
        self._read = len(self._ids)
        self._in_context = True  # the window still starts in the prompt (nothing emitted yet)
        self.text = ""  # everything emitted so far

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, ids: Sequence[int]) -> str:
        """Add ids; returns the new complete text (possibly empty)."""
        self._ids.extend(int(t) for t in ids)
        start, after = self._window(len(self._ids))
        if len(after) <= start:
            return ""
        if not after.endswith(REPLACEMENT):
            return self._emit(after[start:], len(self._ids))
        if len(self._ids) - self._read <= MAX_PENDING_IDS:
            return ""  # the rest of a character may come
        # bytes that make no character: out they go, but for the last few, which may yet begin one
        upto = len(self._ids) - MAX_CHAR_IDS
        start, text = self._window(upto)
        return self._emit(text[start:], upto) if len(text) > start else ""

    def flush(self) -> str:
        """At the end: whatever is still pending, undecodable bytes as U+FFFD."""
        start, after = self._window(len(self._ids))
        return self._emit(after[start:], len(self._ids))

    def _window(self, end: int) -> tuple[int, str]:
        """The window's text up to id `end`, and where the ids not emitted yet start in it. A
        prompt (token ids) may end inside a character: when the first generated ids complete it
        (its U+FFFD in the window's text turned into the character), the character is theirs; the
        prompt's own undecodable bytes before it stay the prompt's."""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:end])
        start = len(before)
        if self._in_context and before.endswith(REPLACEMENT):
            same = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
            start = max(len(before.rstrip(REPLACEMENT)), same)
        return start, after

    def _emit(self, delta: str, upto: int) -> str:
        """`delta` is the text of the ids before `upto`: they are done."""
        self._prefix, self._read = self._read, upto
        self._in_context = False
        self.text += delta
        return delta


class StopMatcher:
    """Holds back text that may be the start of a stop string. `feed` returns the text that is
    safe to emit and whether a stop string was found (the text then ends just before it)."""

    def __init__(self, stops: Sequence[str]):
        self._stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        buf = self._pending + text
        first = min((i for i in (buf.find(s) for s in self._stops) if i >= 0), default=-1)
        if first >= 0:
            self._pending = ""
            return buf[:first], True
        keep = self._partial_suffix(buf)
        self._pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of buf that is a proper prefix of some stop string."""
        for n in range(min(self._hold, len(buf)), 0, -1):
            tail = buf[-n:]
            if any(s.startswith(tail) for s in self._stops):
                return n
        return 0

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


@dataclass
class Chunk:
    """One piece of client output."""

    token_ids: list[int]
    text: str
    stopped: bool = False


class OutputStream:
    """Token ids in, client chunks out. Without a tokenizer, ids pass straight through (no text,
    no stop strings)."""

    def __init__(self, tokenizer=None, stops: Sequence[str] = (), context: Sequence[int] = ()):
        if stops and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self._detok = Detokenizer(tokenizer, context) if tokenizer is not None else None
        self._stops = StopMatcher(stops)
        self._unresolved: list[int] = []  # ids whose text has not been decoded yet
        self._held: list[tuple[int, int, int]] = []  # (id, text start, text end), decoded, not sent
        self._decoded = 0  # characters decoded so far
        self._released = 0  # characters sent so far
        self.done = False

    def push(self, ids: Sequence[int]) -> Chunk:
        if self.done:
            return Chunk([], "", True)
        ids = [int(t) for t in ids]
        if self._detok is None:
            return Chunk(ids, "")
        # One id at a time, so that each has its own span of text: a step of several tokens whose
        # text holds a stop string must not release the ids after the stop.
        out = Chunk([], "")
        for t in ids:
            chunk = self._advance([t], self._detok.push([t]))
            out.token_ids += chunk.token_ids
            out.text += chunk.text
            if chunk.stopped:
                out.stopped = True
                break
        return out

    def finish(self) -> Chunk:
        """Flush at the end of generation (when no stop string ended it)."""
        if self.done or self._detok is None:
            self.done = True
            return Chunk([], "")
        chunk = self._advance([], self._detok.flush(), final=True)
        if not chunk.stopped:
            tail = self._stops.flush()
            self._released += len(tail)
            chunk.text += tail
            chunk.token_ids += [t for t, _, _ in self._held] + self._unresolved
            self._held.clear()
            self._unresolved.clear()
        self.done = True
        return chunk

    def _advance(self, ids: list[int], delta: str, final: bool = False) -> Chunk:
        self._unresolved.extend(ids)
        if delta or final:
            # Every id pushed since the last text shares this delta's span: a group of byte
            # tokens forms one character, so finer attribution is not possible.
            start, self._decoded = self._decoded, self._decoded + len(delta)
            self._held.extend((t, start, self._decoded) for t in self._unresolved)
            self._unresolved.clear()
        text, stopped = self._stops.feed(delta)
        self._released += len(text)
        if stopped:
            self.done = True
            cut = self._released  # the stop string starts here
            out = [t for t, start, end in self._held if start < cut]
            self._held.clear()
            self._unresolved.clear()
            return Chunk(out, text, True)
        out = []
        while self._held and self._held[0][2] <= self._released:
            out.append(self._held.pop(0)[0])
        return Chunk(out, text)
