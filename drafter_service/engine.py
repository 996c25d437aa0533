"""The drafter without the wire: sequences, their draft state, proposers and draft-ahead.

`Drafter` is what the gRPC servicer, the benchmarks and the tests drive:

    drafter.start(seq_id, tokens, sampling, options) -> committed length
    drafter.draft(DraftCall(...)) -> DraftReply        # raises ServeError subclasses
    drafter.end(seq_id) -> bool

Rules a draft request must follow (each broken rule is an error with its gRPC code, and changes
nothing): the sequence exists (NOT_FOUND); tokens are in the vocabulary and the budget is not
negative (INVALID_ARGUMENT); `committed_length == drafter's length + len(appended)`
(FAILED_PRECONDITION: the orchestrator resynchronises with StartSequence); the new length is at
most `max_len` (RESOURCE_EXHAUSTED; StartSequence with more tokens is INVALID_ARGUMENT); an outcome,
when given after a tree, is a root path of that tree whose tokens are exactly `appended` and whose
bonus is the new root (INVALID_ARGUMENT); a tree shape other than the sequence's is one its draft
state serves (INVALID_ARGUMENT, `Drafter._proposer_for`). Repeating the previous request verbatim
returns the previous answer.

A sequence that no request touched (StartSequence, a draft) for `idle_timeout_s` seconds is ended
by a background sweep, as the verifier releases its idle sequences: a client that went away
without EndSequence must not hold a slot for good.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace

from drafter_service.ahead import AheadConfig, Prepared, Round, Worker, key_of
from drafter_service.chain import ChainProposer
from drafter_service.children import DEFAULT_SUPPORT, ChildPicker, rule_for
from drafter_service.draftlm import DraftModel
from drafter_service.dynamic import DynamicProposer
from drafter_service.fused import FusedProposer
from drafter_service.limits import IDLE_TIMEOUT_S, NGRAM_MAX_LEN
from drafter_service.metrics import DrafterMetrics
from drafter_service.ngram import NgramProposer
from drafter_service.proposer import Proposer, draft_tree, fits
from drafter_service.state import DraftState
from drafter_service.static import STREE_13, ShapeTable, StaticProposer
from treeserve.acceptance import Outcome
from treeserve.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from treeserve.sampling import Sampling
from treeserve.tree import TokenTree

log = logging.getLogger("treeserve.drafter")

SHAPES = ("dynamic", "static", "chain", "ngram", "fused")
# Node budgets whose growths a drafter with captured graphs prepares at start-up (besides its default
# budget): the powers of two the orchestrator's adaptive policy chooses from (up to its cap of 32).
PREPARED_BUDGETS = (2, 4, 8, 16, 32)
MAX_SEQUENCE_ID_BYTES = 128
_TOKEN_LIMIT = 2**31  # token ids travel as int32


@dataclass(frozen=True)
class Options:
    """Per-sequence drafting options (a sequence's defaults come from the drafter's)."""

    shape: str = "dynamic"
    node_budget: int = 16
    max_depth: int = 6
    draft_ahead: bool = True


@dataclass(frozen=True)
class DraftCall:
    sequence_id: str
    committed_length: int
    appended: tuple[int, ...]
    root: int
    outcome: Outcome | None = None
    node_budget: int = 0  # 0: the sequence's budget
    shape: str | None = None  # None: the sequence's shape (see `Drafter.draft`)


@dataclass(frozen=True)
class DraftReply:
    sequence_id: str
    committed_length: int
    tree: TokenTree
    from_draft_ahead: bool
    draft_ms: float


@dataclass
class _Sequence:
    id: str
    options: Options
    proposer: Proposer
    state: DraftState
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_tree: TokenTree | None = None
    last_call: DraftCall | None = None
    last_reply: DraftReply | None = None
    round: Round | None = None
    last_used: float = 0.0  # the drafter's clock at the last request that touched it (idle sweep)

    broken: str | None = None  # why the draft state can no longer be trusted (needs StartSequence)

    def stop_round(self, key=None, finalise: bool = True) -> Prepared | None:
        """Stop draft-ahead and return the prepared state for `key`, if any. Without one, the own
        state is finalised (when `finalise`), so fresh drafting starts where a job would have."""
        if self.round is None:
            return None
        rnd, self.round = self.round, None
        hit, _, needs_finalise = rnd.claim(key)
        if hit is None and needs_finalise and finalise:
            self.state.prepare(rnd.tree)
        return hit

    def close(self) -> None:
        hit = self.stop_round(finalise=False)
        if hit is not None:
            hit.state.release()
        self.state.release()


class Drafter:
    def __init__(self, model: DraftModel | None, defaults: Options | None = None, *, max_sequences: int = 64,
                 max_nodes: int = 256, ahead: AheadConfig | None = AheadConfig(),
                 static_table: ShapeTable = STREE_13, support: int = DEFAULT_SUPPORT,
                 max_len: int = NGRAM_MAX_LEN, idle_timeout_s: float = IDLE_TIMEOUT_S, clock=time.monotonic,
                 background_sweep: bool = True):
        """model None: n-gram drafting only. ahead None: draft-ahead off for every sequence.
        max_len: most tokens a sequence may hold without a model (with one, the model's max_len).
        idle_timeout_s: end sequences untouched this long (0: never); clock: what their idle time
        is read from; background_sweep: False leaves the sweeps to whoever calls `sweep` (tests
        that drive their own clock), True runs them on a thread of their own."""
        _check_positive(max_sequences=max_sequences, max_nodes=max_nodes, support=support, max_len=max_len)
        if not idle_timeout_s >= 0:  # refuses NaN too
            raise ValueError(f"idle_timeout_s must be >= 0, got {idle_timeout_s}")
        if defaults is None:
            defaults = Options(shape="dynamic" if model is not None else "ngram")
        self.model = model
        self.max_sequences = max_sequences
        self.max_nodes = max_nodes
        self.support = support
        self.max_len = model.max_len if model is not None and model.max_len is not None else max_len
        self.idle_timeout_s = idle_timeout_s
        self._clock = clock
        ngram, dynamic = NgramProposer(), DynamicProposer()
        self.proposers: dict[str, Proposer] = {"ngram": ngram}
        if model is not None:
            self.proposers.update(chain=ChainProposer(), static=StaticProposer(static_table), dynamic=dynamic,
                                  fused=FusedProposer(ngram, dynamic))
        self.defaults = self._check(defaults)
        if model is not None and model.captures_growths:
            self._prepare_growths()
        self.ahead = ahead if model is not None else None
        self.worker = Worker(model.gate) if self.ahead is not None else None
        self.metrics = DrafterMetrics(self.strategy)
        self._seqs: dict[str, _Sequence] = {}
        self._starting: set[str] = set()
        self._ended_while_starting: set[str] = set()  # of `_starting`: an EndSequence came meanwhile
        self._lock = threading.Lock()
        self._sweeper = None
        if idle_timeout_s > 0 and background_sweep:
            self._sweeper = Sweeper(self.sweep, sweep_interval(idle_timeout_s))

    def _prepare_growths(self) -> None:
        """Capture now the growths that the first requests of the default tree shape will ask for:
        at its depth limit, its node budget and `PREPARED_BUDGETS`, greedy and sampled with a
        temperature alone (one capture serves every temperature; top-k and top-p take one more
        capture each on first use)."""
        d = self.defaults
        if d.shape not in ("dynamic", "fused"):
            return
        pickers = [self._picker(Sampling(), d.shape), self._picker(Sampling(temperature=1.0), d.shape)]
        budgets = sorted({b for b in PREPARED_BUDGETS if b <= self.max_nodes} | {d.node_budget})
        t0 = time.perf_counter()
        built = self.model.prepare_growths([(b, d.max_depth) for b in budgets], pickers)
        log.info("captured %d draft-tree growths (budgets %s, depth %d) in %.1f s", built, budgets, d.max_depth,
                 time.perf_counter() - t0)

    def _picker(self, sampling: Sampling, shape: str) -> ChildPicker:
        """How a sequence of this shape picks children (fused trees carry no draft distributions)."""
        return ChildPicker(sampling, rule_for(sampling, with_dists=shape != "fused"), self.support)

    @property
    def strategy(self) -> str:
        base = f"{self.defaults.shape}"
        return f"{base} ({self.model.name})" if self.model is not None else base

    @property
    def vocab_size(self) -> int | None:
        return self.model.vocab_size if self.model is not None else None

    def options(self, shape: str | None = None, node_budget: int = 0, max_depth: int = 0,
                draft_ahead: bool | None = None) -> Options:
        """Sequence options from request fields (None / 0: the drafter's default)."""
        d = self.defaults
        return self._check(Options(shape or d.shape, node_budget or d.node_budget, max_depth or d.max_depth,
                                   d.draft_ahead if draft_ahead is None else draft_ahead))

    def _check(self, o: Options) -> Options:
        if o.shape not in SHAPES:
            raise InvalidArgument(f"unknown tree shape {o.shape!r}; known: {', '.join(SHAPES)}")
        if o.shape not in self.proposers:
            raise InvalidArgument(f"tree shape {o.shape!r} needs a draft model; this drafter has none (n-gram only)")
        if o.node_budget < 1 or o.max_depth < 0:
            raise InvalidArgument(f"node budget must be >= 1 and max depth >= 0, got {o.node_budget} and {o.max_depth}")
        return replace(o, node_budget=min(o.node_budget, self.max_nodes))

    # ---- sequences --------------------------------------------------------------------------
    def start(self, sequence_id: str, tokens, sampling: Sampling = Sampling(), options: Options | None = None) -> int:
        """Begin (or reset) drafting for a sequence that has committed `tokens`."""
        _check_id(sequence_id)
        if len(tokens) > self.max_len:  # before anything walks the tokens: they may be millions
            raise InvalidArgument(f"{len(tokens)} tokens: this drafter keeps sequences of at most {self.max_len}")
        tokens = [int(t) for t in tokens]
        self._check_tokens(tokens, "tokens")
        try:
            sampling = sampling.validate()
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from exc
        options = self._check(options or self.defaults)
        proposer = self.proposers[options.shape]
        picker = None
        if proposer.uses_model:
            picker = self._picker(sampling, options.shape)
        with self._foreground():
            old = self._reserve(sequence_id)
            try:
                if old is not None:
                    with old.lock:
                        old.close()
                state = DraftState.open(sequence_id, tokens, sampling, picker,
                                        self.model if proposer.uses_model else None)
            except BaseException:
                with self._lock:
                    self._starting.discard(sequence_id)
                    self._ended_while_starting.discard(sequence_id)
                raise
            self._install(_Sequence(sequence_id, options, proposer, state))
        return len(tokens)

    def _reserve(self, sequence_id: str) -> _Sequence | None:
        """Mark `sequence_id` as starting and take its current sequence (if any) out of the table,
        in one step: a second StartSequence for the id is refused from here on, so no two calls
        both replace the old one and open a state each (one of which would never be freed).
        Returns the old sequence, for the caller to close."""
        with self._lock:
            if sequence_id in self._starting:
                raise FailedPrecondition(f"sequence {sequence_id!r} is being started by another call")
            others = len(self._seqs) - (sequence_id in self._seqs) + len(self._starting)
            if others >= self.max_sequences:
                raise ResourceExhausted(f"drafter is at its limit of {self.max_sequences} sequences")
            self._starting.add(sequence_id)  # the prefill runs outside the table lock
            return self._seqs.pop(sequence_id, None)

    def _install(self, seq: _Sequence) -> None:
        """Put a started sequence in the table and end its reservation. An entry still there for
        its id (none should be, while the id was reserved) is closed, never dropped with its slot."""
        seq.last_used = self._clock()
        with self._lock:
            self._starting.discard(seq.id)
            if seq.id in self._ended_while_starting:  # an EndSequence came during the start: it ends now
                self._ended_while_starting.discard(seq.id)
                displaced = seq
            else:
                displaced = self._seqs.pop(seq.id, None)
                self._seqs[seq.id] = seq
            self.metrics.active(len(self._seqs))
        if displaced is not None:
            with displaced.lock:
                displaced.close()

    def end(self, sequence_id: str) -> bool:
        """End a sequence; one still being started (its StartSequence is running) ends as soon as
        that start is done, instead of staying until the idle sweep."""
        with self._lock:
            seq = self._seqs.pop(sequence_id, None)
            if seq is None and sequence_id in self._starting:
                self._ended_while_starting.add(sequence_id)
                return True
            self.metrics.active(len(self._seqs))
        if seq is None:
            return False
        self._close(seq)
        return True

    def sweep(self) -> list[str]:
        """End the sequences that no request touched for `idle_timeout_s` seconds (none when it is
        0); returns their ids. A sequence whose request is being answered is busy, not idle."""
        if self.idle_timeout_s <= 0:
            return []
        now = self._clock()
        with self._lock:
            idle = [s for s in self._seqs.values()
                    if now - s.last_used > self.idle_timeout_s and not s.lock.locked()]
            for seq in idle:
                del self._seqs[seq.id]
            self.metrics.active(len(self._seqs))
        for seq in idle:
            self._close(seq)  # its slot and any draft-ahead forks
            self.metrics.expired()
            log.info("ended idle sequence %r (untouched for %.0f s)", seq.id, now - seq.last_used)
        return [seq.id for seq in idle]

    def _close(self, seq: _Sequence) -> None:
        """Free a sequence already out of the table, once its request in flight (if any) is done."""
        with self._foreground(), seq.lock:
            seq.close()

    def active(self) -> int:
        with self._lock:
            return len(self._seqs)

    # ---- drafting ---------------------------------------------------------------------------
    def draft(self, call: DraftCall) -> DraftReply:
        t0 = time.perf_counter()
        with self._lock:
            seq = self._seqs.get(call.sequence_id)
            if seq is not None:
                seq.last_used = self._clock()
        if seq is None:
            raise NotFound(f"unknown sequence {call.sequence_id!r}: call StartSequence first")
        self._check_tokens(call.appended, "appended_tokens")
        self._check_tokens([call.root], "root_token")
        if call.node_budget < 0:
            raise InvalidArgument(f"node_budget must be >= 0, got {call.node_budget}")
        proposer = self._proposer_for(seq, call.shape)
        with self._foreground(), seq.lock:
            if self._seqs.get(call.sequence_id) is not seq:
                raise NotFound(f"sequence {call.sequence_id!r} ended while the request waited")
            if call == seq.last_call and seq.last_reply is not None:
                return seq.last_reply
            if seq.broken is not None:
                raise FailedPrecondition(f"sequence {call.sequence_id!r} lost its draft state ({seq.broken}); "
                                         "resynchronise with StartSequence")
            expected = seq.state.length + len(call.appended)
            if call.committed_length != expected:
                raise FailedPrecondition(
                    f"sequence {call.sequence_id!r}: drafter has {seq.state.length} committed tokens, so with "
                    f"{len(call.appended)} appended the length is {expected}, not {call.committed_length}; "
                    "resynchronise with StartSequence")
            if expected > self.max_len:  # refused before the state moves: the sequence stays usable
                raise ResourceExhausted(f"sequence {call.sequence_id!r}: {expected} tokens would pass this drafter's "
                                        f"limit of {self.max_len} per sequence")
            self._check_outcome(seq, call)
            budget = min(call.node_budget or seq.options.node_budget, self.max_nodes)
            try:
                return self._draft(seq, call, proposer, budget, t0)
            except Exception as exc:
                # the state may be half-advanced: refuse further requests until StartSequence
                seq.broken = f"{type(exc).__name__}: {exc}"
                raise

    def _proposer_for(self, seq: _Sequence, shape: str | None) -> Proposer:
        """The proposer of a tree of `shape` (None: the sequence's own). Another shape is allowed
        where the sequence's draft state serves it: n-gram always; a model shape only for a
        sequence started with one, and picking children the same way (a fused tree carries no
        draft distributions, the others do)."""
        if shape is None or shape == seq.options.shape:
            return seq.proposer
        if shape not in SHAPES:
            raise InvalidArgument(f"unknown tree shape {shape!r}; known: {', '.join(SHAPES)}")
        proposer = self.proposers.get(shape)
        if proposer is None:
            raise InvalidArgument(f"tree shape {shape!r} needs a draft model; this drafter has none (n-gram only)")
        if proposer.uses_model and not seq.proposer.uses_model:
            raise InvalidArgument(f"sequence {seq.id!r} was started with the {seq.options.shape!r} shape, which keeps "
                                  f"no draft-model state: a {shape!r} tree needs StartSequence with a model shape")
        if proposer.uses_model and (shape == "fused") != (seq.options.shape == "fused"):
            raise InvalidArgument(f"sequence {seq.id!r} picks children for {seq.options.shape!r} trees; a {shape!r} "
                                  "tree picks them another way (draft distributions): start it with that shape")
        return proposer

    def _draft(self, seq: _Sequence, call: DraftCall, proposer: Proposer, budget: int, t0: float) -> DraftReply:
        depth = seq.options.max_depth
        had_round = seq.round is not None
        own = proposer is seq.proposer
        # a prepared tree is of the sequence's own shape: another shape takes none, and leaves the
        # round's finalising forward undone (the model catches up from its last verification when
        # it next drafts), so an n-gram tree costs the model nothing
        hit = seq.stop_round(key_of(call.appended, call.root, budget) if own else None, finalise=own)
        if hit is not None:
            old, seq.state = seq.state, hit.state
            self.model.adopt(seq.state.slot)
            old.release()
            draft = hit.draft
        else:
            seq.state.advance(call.appended)
            if proposer.uses_model:
                seq.state.catch_up()
            draft = draft_tree(proposer, seq.state, call.root, budget, depth)
        draft_ms = (time.perf_counter() - t0) * 1e3
        reply = DraftReply(call.sequence_id, call.committed_length, draft.tree, hit is not None, draft_ms)
        seq.last_tree, seq.last_call, seq.last_reply = draft.tree, call, reply
        if had_round and own:  # a tree of another shape could not have been prepared: no miss
            self.metrics.ahead(hit is not None, (hit.build_ms - draft_ms) if hit is not None else 0.0)
        self.metrics.tree(proposer.name, draft.tree.size, draft_ms)
        # draft-ahead runs a forward over the tree: none for a tree past the model's length
        if self.worker is not None and seq.options.draft_ahead and own and proposer.uses_model \
                and fits(seq.state, draft.tree):
            seq.round = Round(seq.state, draft.tree, proposer, budget, depth, self.ahead,
                              predictions=hit.predictions if hit is not None else None)
            self.worker.submit(seq.round)
        return reply

    def wait_idle(self, timeout: float = 60.0) -> bool:
        """Wait until draft-ahead has nothing left to do (tests, benchmarks)."""
        return self.worker.wait_idle(timeout) if self.worker is not None else True

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.close()
        if self.worker is not None:
            self.worker.close()
        with self._lock:
            seqs = list(self._seqs.values())
            self._seqs.clear()
        for seq in seqs:
            with seq.lock:
                seq.close()

    # ---- checks -------------------------------------------------------------------------------
    def _foreground(self):
        if self.model is not None:
            return self.model.gate.foreground()
        return _nothing()

    def _check_tokens(self, tokens, what: str) -> None:
        limit = self.vocab_size or _TOKEN_LIMIT
        for t in tokens:
            if not 0 <= t < limit:
                raise InvalidArgument(f"{what}: token {t} outside the vocabulary [0, {limit})")

    @staticmethod
    def _check_outcome(seq: _Sequence, call: DraftCall) -> None:
        out, tree = call.outcome, seq.last_tree
        if out is None or tree is None:
            return
        path = list(out.accepted_nodes)
        if not tree.is_path(path):
            raise InvalidArgument(f"outcome accepted_nodes {path} is not a root path of the previous tree "
                                  f"({tree.size} nodes)")
        if tuple(tree.tokens_along(path)) != tuple(call.appended):
            raise InvalidArgument(f"outcome path tokens {tree.tokens_along(path)} differ from appended_tokens "
                                  f"{list(call.appended)}")
        if out.bonus != call.root:
            raise InvalidArgument(f"outcome bonus_token {out.bonus} differs from root_token {call.root}")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def sweep_interval(idle_timeout_s: float) -> float:
    """How often the idle sweep runs: a quarter of the timeout, at most every second (as the
    verifier's model thread sweeps), so a sequence outlives its timeout by a quarter at most."""
    return min(1.0, idle_timeout_s / 4)


class Sweeper:
    """Runs `sweep` every `every` seconds on a daemon thread of its own, off the request path,
    until closed. A failed sweep is logged and the next one runs as planned."""

    def __init__(self, sweep, every: float):
        self._sweep = sweep
        self._every = every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="drafter-idle-sweep", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self._every):
            try:
                self._sweep()
            except Exception:  # noqa: BLE001 - the sweep must outlive any one failure
                log.exception("idle sweep failed")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)


def _check_id(sequence_id: str) -> None:
    if not sequence_id:
        raise InvalidArgument("sequence_id must be non-empty")
    if len(sequence_id.encode()) > MAX_SEQUENCE_ID_BYTES:
        raise InvalidArgument(f"sequence_id longer than {MAX_SEQUENCE_ID_BYTES} bytes")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
