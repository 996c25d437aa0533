"""CUDA graphs for decode, verify, commits and prompts: one graph replay per step at bucketed shapes.

A graph is captured (lazily, or all at once with `capture_all`) per batch bucket for decode and
per (batch bucket, node bucket) for verify. Inputs go through one static int64 buffer that a step
fills with a single host-to-device copy; the graph covers embedding, every block and the final
norm, and leaves the hidden states in a static buffer. The LM head runs eagerly on the real rows
only, so no graph holds full-vocabulary buffers.

Padding: every tree is padded to the node bucket with extra children of its root (they come after
the real nodes, so they are nobody's ancestors and change no real output; their K/V land in the
scratch rows after the committed prefix); missing sequences, and padded decode rows, are trees in
the pool's scratch slot.

All verify graphs share one stash (per-node commit inputs). A stash handed out with pending
handles aliases those buffers; before the next replay the rows its uncommitted handles use are
copied out (nothing when every handle is committed or gone).

Commits of handles that still alias that stash are graphs too, per (batch bucket, path-length
bucket): one host-to-device copy of the layout `models.verify.commit_meta` builds and one replay,
where an eager commit costs about ten launches of host time (0.4-0.8 ms at the 2.7B shape, where the
device needs 0.15). Padded items are no-ops on the scratch slot.

Prompts run through graphs too (`prefill`), in pieces:
- prefill graphs of `PREFILL_CHUNKS` tokens, largest first while they fit: the prefill's own
  kernels over one piece, whose slot and committed length the graph reads on the device;
- the rest, shorter than every chunk, as chains: a prompt is a tree with one branch, so a verify of
  it followed by the commit of its whole path is its prefill, in two replays. These chain graphs
  have a stash of their own (one tree of the largest node bucket) and commit graphs over it, so a
  prompt never overwrites the rows that pending verify handles still need.
"""
from __future__ import annotations

import contextlib
import gc
import threading
import warnings
import weakref
from typing import NamedTuple, Sequence

import torch

from models.batch import Packed
from models.buckets import NODE_BUCKETS, batch_buckets, bucket, tree_buckets
from models.verify import Pending, VerifyStash, commit_meta, run_commit

# Held while a graph is captured. Work another thread of this process launches on the device during a
# capture breaks it (PyTorch's default stream synchronises with the capturing one), and a broken
# capture can leave the caching allocator still recording into the graph's pool. Code that runs
# device work on its own threads next to a model that may capture lazily (the drafter's draft-ahead
# threads, when drafter and target share a process) holds this lock around that work.
CAPTURE_LOCK = threading.RLock()


@contextlib.contextmanager
def _no_collection():
    """No Python garbage collection while a graph is captured. An unreachable CUDA graph (a dropped
    runtime's, in a reference cycle) destroyed by a collection mid-capture is an operation the
    capture forbids: it fails, and so does every later capture into the same memory pool. torch
    stopped collecting before a capture in 2.9, so this collects first and pauses collection until
    the capture ends."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# Path-length buckets up to this are captured for commits at start-up (`capture_commits`): an
# accepted path is a tree's depth plus one, rarely past 16. Up to 16 steps the SSM commit kernel
# unrolls its path (kernels/ssm_commit.UNROLLED_STEPS); unrolled, its compile grew to 6 s at 32
# steps and 33 s at 64 on an H100 (BENCHMARKS.md, twenty-ninth round).
PREPARED_PATH = 16
# Prompts prefill through graphs (`GraphRunner.prefill`), not eagerly: the eager prefill launches
# about ten kernels a layer and waits on the host (a 90-token prompt of the 2.7B shape took 42-68 ms
# for 4 ms of device work; BENCHMARKS.md, thirty-first round). Pieces of these sizes replay a graph
# of the prefill's own kernels, whose chunked scan costs less a token than a verify and a commit of
# the same chain; the rest of a prompt (shorter than all of them) runs as chains of at most the
# largest node bucket, a verify replay and a commit replay each.
PREFILL_CHUNKS = (128, 256, 512)
# Prompts longer than this are prefilled eagerly, packed together: there the eager prefill's device
# work hides its host time, and its attention reads the prefix once for the whole prompt where the
# chunks' tree attention reads it once per 16 queries. At 2048 tokens the pieces took 0.76 of the
# eager prefill's time at the 2.7B shape and 1.00 at the 8B (BENCHMARKS.md, thirty-second round).
PREFILL_GRAPH_TOKENS = 2048


class _Piece(NamedTuple):
    """A piece of a prompt as `GraphRunner.prefill` runs it: tokens start .. start+n-1 through the
    graph `kind` ("chunk" or "chain") of size `size` (the chunk's length, the chain's node bucket)."""

    start: int
    n: int
    kind: str
    size: int


class _Graph:
    """One captured program: `meta` (int64 inputs) -> `hidden` (rows, d_model) for a forward, None
    for a commit."""

    def __init__(self, graph: torch.cuda.CUDAGraph, meta: torch.Tensor, hidden: torch.Tensor):
        self.graph = graph
        self.meta = meta
        self.hidden = hidden

    def replay(self) -> None:
        self.graph.replay()


class _StaticEager:
    """The same static-buffer program run eagerly: what a graph replays, without capture. Lets the
    bucketing, padding and stash handling run (and be tested) where CUDA graphs cannot."""

    def __init__(self, run, meta: torch.Tensor):
        self.run = run
        self.meta = meta
        with torch.no_grad():
            out = run()
        self.hidden = out.clone() if out is not None else None

    def replay(self) -> None:
        with torch.no_grad():
            out = self.run()
        if self.hidden is not None:
            self.hidden.copy_(out)


class GraphRunner:
    """Bucketed decode/verify steps for `lm`; `capture=False` runs the same programs eagerly.

    Verify graphs exist for padded sizes of at most `max_rows` nodes in all (the shared stash is
    that big); larger batches of trees run eagerly, where launch overhead matters less anyway.
    If a capture fails the runner records why in `failures` and that step runs eagerly.
    """

    def __init__(self, lm, node_buckets=NODE_BUCKETS, capture: bool = True, max_rows: int = 1024,
                 prefill_chunks: Sequence[int] = PREFILL_CHUNKS, prefill_tokens: int = PREFILL_GRAPH_TOKENS):
        self.lm = lm
        self.capture = capture
        self.max_rows = max_rows
        self.failures: list[str] = []
        pool = lm.pool
        self.batch_buckets = batch_buckets(pool.max_slots)
        self.node_buckets = tree_buckets(pool, node_buckets)
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._decode: dict[int, _Graph] = {}
        self._verify: dict[tuple[int, int], _Graph] = {}
        self._commit: dict[tuple[int, int], _Graph] = {}
        rows = min(max_rows, max(self.batch_buckets) * max(self.node_buckets))
        self.stash = VerifyStash(pool, rows, lm.dtype)
        self._handed_out = None  # weakref to the last stash view given to pending handles
        # prompts (`prefill`): those of at most `prefill_tokens` tokens each (the prompt's own, not
        # what its slot holds already; 0: none), as pieces of the prefill chunks that fit, then
        # chains (graphs per node bucket, commits per path bucket over a stash of their own)
        if any(int(c) < 1 for c in prefill_chunks):
            raise ValueError(f"prefill chunks must be positive token counts, got {list(prefill_chunks)}")
        if not isinstance(prefill_tokens, int) or prefill_tokens < 0:
            raise ValueError(f"prefill_tokens must be a token count >= 0 (0: no prompt), got {prefill_tokens!r}")
        self.prefill_tokens = prefill_tokens
        self.prefill_chunks = tuple(sorted({int(c) for c in prefill_chunks if c <= pool.max_len}, reverse=True))
        self._chunk: dict[int, _Graph] = {}
        self.chain_stash = VerifyStash(pool, max(self.node_buckets), lm.dtype)
        self._chain: dict[int, _Graph] = {}
        self._chain_commit: dict[tuple[int, int], _Graph] = {}

    # ---- which steps fit ------------------------------------------------------------------------
    def can_decode(self, batch: int) -> bool:
        Bb = bucket(batch, self.batch_buckets)
        return Bb is not None and self._decode.get(Bb, True) is not None

    def can_verify(self, sizes: list[int]) -> bool:
        Bb = bucket(len(sizes), self.batch_buckets)
        Nb = bucket(max(sizes), self.node_buckets)
        if Bb is None or Nb is None or Bb * Nb > self.stash.rows:
            return False
        return self._verify.get((Bb, Nb), True) is not None

    def takes_prefill(self, n: int) -> bool:
        """Whether a prompt of n tokens prefills through graphs (`prefill`): at most
        `prefill_tokens` tokens and a graph for every piece it splits into (one not tried yet is
        captured now, so that no prompt is left half done by a failed capture)."""
        if n > self.prefill_tokens:
            return False
        kinds = {(p.kind, p.size) for p in self._pieces(n)}
        return all(self._piece_graph(kind, size) is not None for kind, size in sorted(kinds))

    def _pieces(self, n: int) -> list[_Piece]:
        """The pieces a prompt of n tokens runs as: prefill chunks, largest first, while they fit;
        then chains of the largest node bucket at a time, the rest last."""
        out, start = [], 0
        for c in self.prefill_chunks:
            while n - start >= c:
                out.append(_Piece(start, c, "chunk", c))
                start += c
        top = max(self.node_buckets)
        for first in range(start, n, top):
            k = min(top, n - first)
            out.append(_Piece(first, k, "chain", bucket(k, self.node_buckets)))
        return out

    def _piece_graph(self, kind: str, size: int):
        return self._chunk_graph(size) if kind == "chunk" else self._chain_graph(size)

    # ---- steps --------------------------------------------------------------------------------
    def decode(self, slots: list[int], lens: list[int], tokens: list[int]) -> torch.Tensor | None:
        """(B, V) fp32 logits, or None when this bucket has no graph (the caller runs eagerly)."""
        Bb = bucket(len(slots), self.batch_buckets)
        g = self._decode[Bb] if Bb in self._decode else self._capture_decode(Bb)
        if g is None:
            return None
        pad = Bb - len(slots)
        scratch = self.lm.pool.scratch_slot
        meta = _decode_meta(tokens + [0] * pad, slots + [scratch] * pad, lens + [0] * pad)
        g.meta.copy_(meta, non_blocking=True)
        g.replay()
        return self.lm.logits(g.hidden[: len(slots)])

    def verify(self, slots: list[int], lens: list[int], trees):
        """-> (final-norm hidden states (T, d_model) of the real nodes, packed; stash; first stash
        row of each tree), or None when this bucket has no graph (the caller runs eagerly). The
        hidden states may alias the graph's output buffer: use them before the next replay."""
        B = len(slots)
        Bb = bucket(B, self.batch_buckets)
        Nb = bucket(max(len(t.tokens) for t in trees), self.node_buckets)
        g = self._verify[(Bb, Nb)] if (Bb, Nb) in self._verify else self._capture_verify(Bb, Nb)
        if g is None:
            return None
        self._release_stash()
        scratch = self.lm.pool.scratch_slot
        tokens = [list(t.tokens) for t in trees] + [[0]] * (Bb - B)
        parents = [list(t.parents) for t in trees] + [[-1]] * (Bb - B)
        meta = _tree_meta(tokens, parents, slots + [scratch] * (Bb - B), lens + [0] * (Bb - B), Nb)
        g.meta.copy_(meta, non_blocking=True)
        g.replay()
        if B == 1:
            real = g.hidden[: len(trees[0].tokens)]
        else:
            rows = [b * Nb + i for b, t in enumerate(trees) for i in range(len(t.tokens))]
            real = g.hidden[torch.tensor(rows, dtype=torch.int64).to(self.lm.device)]
        view = _StashView(self.stash)
        self._handed_out = weakref.ref(view)
        return real, view, [b * Nb for b in range(B)]

    @torch.no_grad()
    def prefill(self, slot: int, tokens: list[int]) -> torch.Tensor:
        """Consume `tokens` after the slot's committed ones, piece by piece (`_pieces`) -> (1, V)
        fp32 logits at the last token. For `HybridLM.prefill`, which checks the tokens and the
        slot's room and asks `takes_prefill` first, so that every piece has its graph."""
        logits = None
        for piece in self._pieces(len(tokens)):
            graphs, run = (self._chunk, self._run_chunk) if piece.kind == "chunk" else (self._chain, self._run_chain)
            g = graphs.get(piece.size)
            if g is None:
                raise RuntimeError(f"no {piece.kind} graph of {piece.size}: ask takes_prefill first")
            hidden = run(g, slot, tokens[piece.start : piece.start + piece.n])
            if piece.start + piece.n == len(tokens):
                logits = self.lm.logits(hidden)
        return logits

    def _run_chunk(self, g: "_Graph", slot: int, piece: list[int]) -> torch.Tensor:
        """One prefill graph replay over `piece` (exactly the graph's length) -> the last token's
        hidden state (1, d_model)."""
        pool, n = self.lm.pool, len(piece)
        g.meta.copy_(_chain_meta(piece, slot, pool.length(slot), n), non_blocking=True)
        g.replay()
        pool.advance(slot, n)
        return g.hidden[n - 1 : n]

    def _run_chain(self, g: "_Graph", slot: int, chain: list[int]) -> torch.Tensor:
        """A chain graph replay over the chain stash, then the commit of its whole path -> the last
        token's hidden state (1, d_model)."""
        pool, n = self.lm.pool, len(chain)
        L = pool.length(slot)
        Nb = g.hidden.shape[0]  # the graph's node bucket
        g.meta.copy_(_chain_meta(chain, slot, L, Nb), non_blocking=True)
        g.replay()
        pending = Pending(slot, pool.version(slot), L, tuple(_chain_parents(n)), self.chain_stash, 0)
        self.lm.commit([(pending, list(range(n)))])  # its graph writes the pool, never this output
        return g.hidden[n - 1 : n]

    def commit(self, items, paths: list[list[int]]) -> bool:
        """Apply a checked commit (`models.verify.check_commit`: items and their paths) as one graph
        replay; the caller then marks the handles consumed. False, with nothing done, when it does
        not fit a graph: a handle whose stash no longer aliases the shared one (or the chain
        stash), sizes past the buckets, a failed capture. The caller then commits eagerly."""
        if _all_alias(items, self.stash):
            stash, graphs, batches, what = self.stash, self._commit, self.batch_buckets, "commit"
        elif _all_alias(items, self.chain_stash):
            stash, graphs, batches, what = self.chain_stash, self._chain_commit, (1,), "chain commit"
        else:
            return False
        Bb = bucket(len(items), batches)
        Kb = bucket(max(len(p) for p in paths), self.node_buckets)
        if Bb is None or Kb is None:
            return False
        g = graphs[(Bb, Kb)] if (Bb, Kb) in graphs else self._capture_commit(stash, graphs, Bb, Kb, what)
        if g is None:
            return False
        g.meta.copy_(commit_meta(items, paths, Bb, Kb, Bb * Kb, self.lm.pool.scratch_slot), non_blocking=True)
        g.replay()
        return True

    def capture_all(self) -> None:
        """Capture now (start-up) instead of on first use: every decode and verify bucket, the
        commits of every batch bucket up to `PREPARED_PATH` steps, and the prompt pieces."""
        for Bb in self.batch_buckets:
            if Bb not in self._decode:
                self._capture_decode(Bb)
            for Nb in self.node_buckets:
                if (Bb, Nb) not in self._verify and Bb * Nb <= self.stash.rows:
                    self._capture_verify(Bb, Nb)
        self.capture_commits(self.batch_buckets)
        self.capture_prefill()

    def capture_prefill(self) -> None:
        """Capture the prefill chunks up to the cap (`prefill_tokens`), and the chain graphs of every
        node bucket with their commits (`prefill`): a first prompt of each length would otherwise
        pay a capture and, past 16 tokens, compiles."""
        if self.prefill_tokens == 0:
            return
        for c in self.prefill_chunks:
            if c <= self.prefill_tokens:
                self._chunk_graph(c)
        for Nb in self.node_buckets:
            if self._chain_graph(Nb) is not None and (1, Nb) not in self._chain_commit:
                self._capture_commit(self.chain_stash, self._chain_commit, 1, Nb, "chain commit")

    def capture_commits(self, batches: Sequence[int]) -> None:
        """Capture the commits of these batch buckets now, at each path-length bucket up to
        `PREPARED_PATH`: a first commit of each would otherwise pay its capture and its kernel
        compile mid-request. Longer paths keep capturing on first use."""
        for Bb in batches:
            for Kb in self.node_buckets:
                if Kb <= PREPARED_PATH and (Bb, Kb) not in self._commit and Bb * Kb <= self.stash.rows:
                    self._capture_commit(self.stash, self._commit, Bb, Kb, "commit")

    # ---- the shared stash, for forwards captured outside this runner ----------------------------
    def release_stash(self) -> None:
        """Before a replay that writes the shared stash: the handles given out last keep their rows."""
        self._release_stash()

    def hand_out_stash(self) -> VerifyStash:
        """The shared stash as the handles of the forward just replayed will hold it."""
        view = _StashView(self.stash)
        self._handed_out = weakref.ref(view)
        return view

    def capture_program(self, program, what: str):
        """A graph of `program()` (no inputs but the static tensors it reads) in this runner's
        pool, or its eager stand-in when the runner does not capture; None if the capture failed.
        Its first run (a warm-up) happens here."""
        self._release_stash()
        return self._try_capture(torch.zeros(1, dtype=torch.int64), lambda meta: program(), what)

    # ---- capture ------------------------------------------------------------------------------
    def _release_stash(self) -> None:
        """Give the last handed-out stash its own copy if a handle of it may still commit."""
        view = self._handed_out() if self._handed_out is not None else None
        if view is not None and view.aliased and view.has_live_pending():
            view.detach_copy()
        self._handed_out = None

    def _capture(self, meta_host: torch.Tensor, program):
        """A graph (or its eager stand-in) of `program(meta)` over a static copy of `meta_host`."""
        meta = meta_host.to(self.lm.device)

        def run():
            return program(meta)

        if not self.capture:
            return _StaticEager(run, meta)
        with CAPTURE_LOCK:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), torch.no_grad():
                run()  # warm-up: compiles kernels, settles allocations (writes go to the scratch slot)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with _no_collection(), torch.cuda.graph(graph, pool=self._pool), torch.no_grad():
                out = run()
        return _Graph(graph, meta, out)

    def _capture_decode(self, Bb: int):
        scratch = self.lm.pool.scratch_slot
        meta = _decode_meta([0] * Bb, [scratch] * Bb, [0] * Bb)
        self._release_stash()  # as before every capture of a forward
        g = self._try_capture(meta, lambda m: self.lm.hidden("decode", _unpack(m, Bb, 1), None), f"decode batch {Bb}")
        self._decode[Bb] = g
        return g

    def _capture_verify(self, Bb: int, Nb: int):
        scratch = self.lm.pool.scratch_slot
        meta = _tree_meta([[0]] * Bb, [[-1]] * Bb, [scratch] * Bb, [0] * Bb, Nb)
        self._release_stash()  # the warm-up run writes the shared stash
        g = self._try_capture(meta, lambda m: self.lm.hidden("verify", _unpack(m, Bb, Nb), self.stash),
                              f"verify {Bb} x {Nb}")
        self._verify[(Bb, Nb)] = g
        return g

    def _chain_graph(self, Nb: int):
        """The chain graph of node bucket Nb (captured now if not tried yet; None if it failed).
        Its forward writes the chain stash only, which no live handle holds: no release here."""
        if Nb not in self._chain:
            meta = _tree_meta([[0]], [[-1]], [self.lm.pool.scratch_slot], [0], Nb)
            self._chain[Nb] = self._try_capture(
                meta, lambda m: self.lm.hidden("verify", _unpack(m, 1, Nb), self.chain_stash), f"chain {Nb}")
        return self._chain[Nb]

    def _chunk_graph(self, n: int):
        """The prefill graph of n-token pieces (captured now if not tried yet; None if it failed). Its
        forward writes the slot's states and K/V, and no stash."""
        if n not in self._chunk:
            meta = _chain_meta([0] * n, self.lm.pool.scratch_slot, 0, n)
            self._chunk[n] = self._try_capture(
                meta, lambda m: self.lm.hidden("prefill_chunk", _unpack(m, 1, n)), f"prefill {n}")
        return self._chunk[n]

    def _capture_commit(self, stash: VerifyStash, graphs: dict, Bb: int, Kb: int, what: str):
        """A commit graph over `stash`'s rows, kept in `graphs` (the verify stash's or the chain
        stash's table); `what` names it in a failure."""
        # the warm-up run commits nothing (every item a no-op on the scratch slot) and only reads
        # the stash, whose live handles are the ones about to commit: no release here
        lm, rows = self.lm, Bb * Kb
        meta = commit_meta([], [], Bb, Kb, rows, lm.pool.scratch_slot)
        g = self._try_capture(
            meta, lambda m: run_commit(lm.pool, stash, m, Bb, Kb, rows, lm.A_all, lm.dt_bias_all, lm.dt_limit),
            f"{what} {Bb} x {Kb}")
        graphs[(Bb, Kb)] = g
        return g

    def _try_capture(self, meta, program, what: str):
        try:
            return self._capture(meta, program)
        except Exception as e:  # leave this bucket eager rather than fail the step
            self.failures.append(f"{what}: {type(e).__name__}: {e}")
            warnings.warn(f"CUDA graph capture failed for {what}, running it eagerly: {e}", RuntimeWarning)
            return None


def _all_alias(items, stash: VerifyStash) -> bool:
    """Whether every item's handle reads its rows from `stash`'s very buffers."""
    own = stash.tensors()
    return all(getattr(p.stash, name, None) is t for p, _ in items for name, t in own.items())


class _StashView(VerifyStash):
    """The shared graph stash as seen by one verify call's pending handles."""

    def __init__(self, shared: VerifyStash):
        vars(self).update(vars(shared))  # the same buffers
        self.aliased = True
        self._pendings: list[weakref.ref] = []

    def attach(self, pendings) -> None:
        self._pendings = [weakref.ref(p) for p in pendings]

    def _live(self) -> list:
        return [p for r in self._pendings if (p := r()) is not None and not p.consumed]

    def has_live_pending(self) -> bool:
        return bool(self._live())

    def detach_copy(self) -> None:
        # only the rows a live handle can still commit from: a tree of a few nodes should not pay
        # for copying a stash sized for the largest batch
        self.own_copies(max((p.row0 + len(p.parents) for p in self._live()), default=0))
        self.aliased = False


# ---- static input layout -------------------------------------------------------------------------
# meta = tokens (T) | positions (T) | parents (T) | cu_seqlens (B+1) | slot_idx (B) | cache_lens (B)


def _unpack(meta: torch.Tensor, B: int, N: int) -> Packed:
    T = B * N
    tok, pos, par, cu, slot, lens = torch.split(meta, [T, T, T, B + 1, B, B])
    return Packed(
        tokens=tok, positions=pos, parents=par.to(torch.int32), cu_seqlens=cu.to(torch.int32),
        slot_idx=slot.to(torch.int32), cache_lens=lens.to(torch.int32), max_nodes=N,
        sizes=[N] * B, slots=[], lens=[],
    )


def _decode_meta(tokens: list[int], slots: list[int], lens: list[int]) -> torch.Tensor:
    B = len(tokens)
    return torch.tensor(tokens + lens + [-1] * B + list(range(B + 1)) + slots + lens, dtype=torch.int64)


def _chain_parents(n: int) -> list[int]:
    """Local parents of a chain of n nodes (a prompt piece): node i's parent is i - 1."""
    return [-1, *range(n - 1)]


def _chain_meta(tokens: list[int], slot: int, L: int, N: int) -> torch.Tensor:
    """`_tree_meta` of one prompt piece, a chain, after the slot's L committed tokens."""
    return _tree_meta([tokens], [_chain_parents(len(tokens))], [slot], [L], N)


def _tree_meta(tokens, parents, slots, lens, N: int) -> torch.Tensor:
    """Trees padded to N nodes each: padding nodes are extra children of the root."""
    tok, pos, par = [], [], []
    for t, p, L in zip(tokens, parents, lens):
        n = len(t)
        depth = [0] * n
        for i in range(1, n):
            depth[i] = depth[p[i]] + 1
        tok += list(t) + [0] * (N - n)
        par += list(p) + [0] * (N - n)
        pos += [L + d for d in depth] + [L + 1] * (N - n)
    B = len(tokens)
    cu = [b * N for b in range(B + 1)]
    return torch.tensor(tok + pos + par + cu + list(slots) + list(lens), dtype=torch.int64)
