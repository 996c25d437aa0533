"""Adaptive speculation: how many tree nodes to ask the drafter for, and in which regime, step by
step.

A step with a budget of b nodes emits tau(b) tokens on average (accepted drafts plus the bonus
token; tau(1) = 1 exactly: plain decoding) and costs step_ms(b). The engine wants the most tokens
per millisecond from the whole batch, and every request shares the step's cost, so each request
picks

    b* = argmax_b  (tau(b) + tokens of the rest of the batch) / step_ms(nodes of the rest + b)

over the budgets it allows (powers of two up to its cap). b* = 1 turns speculation off. Alone on
a GPU a node is nearly free and big trees win; in a large batch each node costs about as much as
a token of another sequence, and the same formula turns speculation off. A request that may draft
in several regimes (`AdaptivePolicy.also`: one that left the tree shape to the server also tries
n-gram trees) takes the argmax over (regime, budget) pairs, each priced by its regime's acceptance
and drafting overhead.

- tau(b) is an exponential moving average of the tokens emitted per step at budget b, per request
  (acceptance depends on the text; a step of an n-gram tree updates every smaller budget too, from
  what its first nodes accepted: `observations`), falling back to the average of the engine's requests of the
  same `Regime` (tree shape, temperature band, draft-ahead: an n-gram tree at temperature 1 says
  little about a draft model's tree at temperature 0) for budgets the request has not tried, then
  to the best another regime of the same band measured there (`RegimeTables`: a guess, which a
  probe of that budget corrects), and otherwise to the best of the smaller budgets it tried (never
  optimistic).
  Until some acceptance has been measured (by the request or engine-wide) the request drafts at
  `start`; a warm cost model alone (e.g. from plain traffic) is no reason to begin at 1.
- step_ms(n) = forward_ms(n) + overhead: the verifier's forward time is fitted as a + c * n over
  the nodes of the whole batch (least squares with forgetting), so large batches, where every
  extra node costs real compute, naturally push the choice towards 1; the overhead (drafting,
  RPCs) is the median of the last `OVERHEAD_WINDOW` steps' overheads of its kind: the set of
  regimes that asked for drafts in it (none: a plain step; a sampled draft-model tree costs its
  drafter several times an n-gram tree, and a step of both costs more than either). A median,
  because a one-off stall (a drafter compiling or capturing a new shape takes up to a second) must
  not make speculation look hopeless for the hundreds of steps it would take to be probed away. A
  kind never seen is priced like the dearest of its regimes seen alone, else like the cheapest
  kind seen.
- Every `probe_every` steps of the engine the request may try a neighbour of its best budget
  (in turn one larger, one smaller and, with several regimes, the best tree of another regime) so
  the estimates stay current; while speculation is off it tries the best-scoring budget above 1
  instead, because drafting has a fixed cost per step (a drafter RPC, a draft-model forward per
  tree level): budget 2 may not pay where 8 does, so probing only 2 could keep speculation off for
  good. During the first `warmup` steps the cadence is every
  other step: until the batch has verified different node counts the cost slope is unknown
  (assumed flat). After that, every request of the batch probes at the same steps (the engine's
  step count, `CostModel.steps`): drafting costs a step its overhead whether one request drafts or
  many, so probes spread over the steps (a request's own step count) made a batch of 16 or more
  pay a drafter that never pays on nearly every step (0.44x plain in the tests' world, now 0.91x);
  the credit still bounds how many of them a step takes.
- In a batch each request weighs its tree against the rest of the batch as the last step had it
  (`choose_for_batch`): the drafts likely to come again, pinned budgets and settled choices, not
  probes (one probe would make the next look paid for, and in a large batch a chain of them kept a
  drafter that never pays on). Where the others draft anyway, the drafter's cost looks already
  paid to each, so a batch whose requests all draft would never turn a dear drafter off; and
  where none does, each pays the whole overhead for its one tree, so a batch for which drafting
  pays together could turn it off. The batch's own check compares the settled requests' choices
  with all of them drafting (each at its best with the overhead shared), with, per regime, those
  that may draft in it drafting there (where a request may draft in several), and with none of
  them drafting (probes and pinned budgets as they are), and takes whichever the estimates call
  fastest (`batch_rate`). A step in which only the pinned requests draft (plain, where none is
  pinned), never seen, is tried once (again after `RETRY_STEPS` if it did not come about): until
  one is seen it is priced with more drafting overhead, and on an engine whose requests all
  speculated from the start, plain decoding could never win against an expensive drafter.
- A probe is taken only when the engine can afford it (`CostModel.afford`). Every step the engine
  verifies earns credit, `explore` times its measured time; a probe spends its estimated loss
  against the best budget: its step time less the time the best budget needs for the tokens the
  probe is expected to emit. So probing costs the engine at most about `explore` of its time, by
  the estimates, however many requests share a step, and short requests that could not afford a
  probe alone pay for one between them. A probe the estimates call as good as the best is free; one
  dearer than the credit can ever hold is taken when the credit is nearly full (a few times in ten
  thousand steps), or a stale estimate could keep speculation off for good. A refused neighbour
  does not block the others: the turn moves on whether the probe is taken or not.
  Without this rule, a drafter that costs several plain steps per tree made every probe expensive:
  the medium pair's default requests ran at 0.55x plain decoding on a GPU while leaving
  speculation off on 9 steps in 10 (BENCHMARKS.md, twenty-eighth round). Until the engine has
  verified `LEARNING_STEPS` speculative steps every probe is free: its estimates of them are
  worth little before, and a few stalled first steps must not keep speculation off for good.
"""
from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field
from typing import Collection, Hashable, NamedTuple, Sequence

BUDGETS = (1, 2, 4, 8, 16, 32, 64)
# upper ends of the temperature bands (greedy, then sampled at up to 0.5, up to 1, above 1)
TEMPERATURE_BANDS = (0.0, 0.5, 1.0)
PLAIN = frozenset()  # the kind of a step that asked the drafter for nothing (see CostModel)
MAX_KINDS = 64  # step kinds whose overheads a cost model keeps (the least recently seen go first)
OVERHEAD_WINDOW = 16  # steps whose overheads (outside the forward) give the median
LEARNING_STEPS = OVERHEAD_WINDOW  # speculative steps an engine verifies before probes spend its credit
RETRY_STEPS = 4 * OVERHEAD_WINDOW  # steps before a step kind tried and not seen is tried again
SATURATED = 0.9  # share of its level at which the credit pays for any one probe


class Regime(NamedTuple):
    """What a request's acceptance and drafting cost depend on besides its text. shape: the tree
    shape it asks the drafter for (a TreeShape value; 0, the drafter's default, is its own);
    band: its temperature's band (`temperature_band`); ahead: whether the drafter prepares its
    trees ahead (draft-ahead: most of the drafting off the step's path)."""

    shape: int
    band: int
    ahead: bool = False


def temperature_band(temperature: float) -> int:
    """0 for greedy (pass 0.0), then 1, 2, ... by the upper ends in TEMPERATURE_BANDS."""
    return next((i for i, top in enumerate(TEMPERATURE_BANDS) if temperature <= top), len(TEMPERATURE_BANDS))


class Choice(NamedTuple):
    """A request's next step: a tree of at most `budget` nodes drafted in `regime` (budget 1: no
    draft, regime None; budget 0: the drafter's default budget)."""

    budget: int
    regime: Hashable | None


NO_DRAFT = Choice(1, None)


@dataclass(frozen=True)
class Part:
    """One request's part in the next step: the `nodes` it verifies (1: no draft), the `tokens` it
    is expected to emit, the `regime` it drafts in (None: it asks for no draft) and whether its
    budget is `pinned` by its client."""

    nodes: int
    tokens: float
    regime: Hashable | None
    pinned: bool = False


def batch_ms(cost: "CostModel", plans: list[Part]) -> float:
    drafted = {p.regime for p in plans if p.regime is not None}
    return max(1e-6, cost.step_ms(sum(p.nodes for p in plans), drafted))


@dataclass(frozen=True)
class Seat:
    """A request's place in a step, for `choose_for_batch`: its `policy` (None: speculation off),
    the `regime` of its last draft, the engine's `shared` acceptance tables, what it verified and
    emitted at the last step, and whether it asked for a draft then."""

    policy: object  # AdaptivePolicy, FixedPolicy or None
    regime: Hashable
    shared: "RegimeTables | None"
    last_nodes: int = 1
    last_tokens: int = 1
    asked: bool = False


def choose_for_batch(cost: "CostModel", seats: list[Seat]) -> list[Choice]:
    """The batch's next trees: a budget and a regime each (`Choice`). Each policy
    chooses against the rest of the batch as the last step had it (the drafts likely to come again:
    pinned, or a policy's settled choice; a probe or a start budget is not); then the batch's own
    checks: a step with only the pinned requests drafting, never seen, is tried once to measure it;
    otherwise the settled requests' choices are compared with all of them drafting (each at its
    best with the drafting shared), with, per regime, those that may draft in it drafting there
    (where a request may draft in several regimes), and with none of them drafting, and the batch
    takes whichever is expected to emit the most a millisecond (`batch_rate`)."""
    drafted = collections.Counter(s.regime for s in seats if _drafts_again(s))  # regime -> requests
    nodes, tokens = sum(s.last_nodes for s in seats), sum(s.last_tokens for s in seats)
    choices, chosen, off, settled = [], [], [], []  # settled: (seat, its choose arguments) or None
    for s in seats:
        if s.policy is None:
            choices.append(NO_DRAFT)
            chosen.append(Part(1, 1.0, None))
            off.append(chosen[-1])
            settled.append(None)
            continue
        others = drafted.copy()
        if _drafts_again(s):
            others[s.regime] -= 1
        args = (cost, nodes - s.last_nodes, s.shared, tokens - s.last_tokens, frozenset(+others))
        budget = s.policy.choose(*args)
        choices.append(Choice(budget, s.policy.current) if budget != 1 else NO_DRAFT)
        chosen.append(_part(s, choices[-1]))
        settled.append((s, args) if s.policy.settled else None)
        off.append(_part(s, NO_DRAFT) if s.policy.settled else chosen[-1])
    pinned = {p.regime for p in chosen if p.pinned and p.regime is not None}
    if any(p.regime is not None and not p.pinned for p in chosen) and cost.try_measuring(pinned):
        # such a step (plain, or only the pinned requests drafting) is priced like one with more
        # drafts (`overhead_ms`) until one is seen, and could never win against a dear drafter:
        # one step measures it (a probe chosen now is dropped until its next turn)
        return [c if p.pinned else NO_DRAFT for c, p in zip(choices, chosen)]
    # every settled request drafting, each at its best with the drafting of its current regime
    # shared; and where one may draft in several regimes, per regime the plan in which the settled
    # requests that may draft in it draft there (the others as chosen): a request whose last probe
    # was a cheap regime's must not weigh the others' trees as if they all came from that one
    on = [[_part(e[0], e[0].policy.best_if_shared(*e[1])) if e is not None else p for e, p in zip(settled, chosen)]]
    if any(e is not None and len(e[0].policy.regimes) > 1 for e in settled):
        regimes = dict.fromkeys(g for e in settled if e is not None for g in e[0].policy.regimes)
        on += [[_part(e[0], e[0].policy.best_if_shared(*e[1], g)) if e is not None and g in e[0].policy.regimes
                else p for e, p in zip(settled, chosen)] for g in regimes]
    best = max((chosen, *on, off), key=lambda plans: batch_rate(cost, plans))  # a tie: the first
    return [c if p is q else Choice(q.nodes, q.regime) for c, p, q in zip(choices, chosen, best)]


def _part(s: Seat, choice: Choice) -> Part:
    if choice.budget == 1:
        return Part(1, 1.0, None, s.policy.pinned)
    # the drafter's default budget (0): as many nodes as its last tree, which may have been a
    # one-node stand-in (after a prefill, or a late draft)
    size = choice.budget or max(2, s.last_nodes)
    return Part(size, s.policy.estimate(size, s.shared, choice.regime), choice.regime, s.policy.pinned)


def _drafts_again(s: Seat) -> bool:
    """Whether the seat's last draft is likely to come again (a pinned budget or a settled choice;
    a probe's would make the next probe look paid for)."""
    return s.asked and s.policy is not None and (s.policy.pinned or s.policy.settled)


def batch_rate(cost: "CostModel", plans: list[Part]) -> float:
    """Tokens a millisecond the step is expected to emit."""
    return sum(p.tokens for p in plans) / batch_ms(cost, plans)


def observations(budget: int, path: Sequence[int], nested: bool) -> list[tuple[int, int]]:
    """What a step drafted at `budget` that accepted `path` (root first, node indices) says: it
    emitted len(path) tokens at `budget`. A `nested` tree is one whose tree at any smaller budget b
    is its first b nodes (n-gram trees), accepted by the target alone (no draft distributions): on
    it, the tree of budget b would have accepted the path's nodes below b, so the same step also
    says what every smaller budget of `BUDGETS` would have emitted, measured on the same text."""
    out = [(budget, len(path))]
    if nested:  # node indices grow along a path (a child is made after its parent)
        out += [(b, next((i for i, node in enumerate(path) if node >= b), len(path)))
                for b in BUDGETS if 1 < b < budget]
    return out


def allowed_budgets(cap: int) -> tuple[int, ...]:
    """1 plus the powers of two up to `cap`, and `cap` itself."""
    out = [b for b in BUDGETS if b <= cap]
    if cap > 1 and cap not in out:
        out.append(cap)
    return tuple(out) or (1,)


@dataclass
class CostModel:
    """Step cost in ms as a function of the nodes verified in the batch (per engine), and the
    credit for probes that the engine's time earns. `explore`: the share of the engine's time
    that probes may lose; the credit decays by `credit_decay` a step, so time spent without
    probing (plain traffic, a long spell of speculation off) cannot pay for a burst of them. It
    levels off at `explore / (1 - credit_decay)` steps' time (about 50); a probe dearer than that
    is still taken once the credit is nearly full (`SATURATED`), so that a stale estimate of a
    dear probe can be checked again: at most once every few thousand steps."""

    decay: float = 0.97
    explore: float = 0.05
    credit_decay: float = 0.999
    credit: float = 0.0  # estimated ms of loss that probes may still spend
    # what the credit would be had nothing been spent: the level it tends to
    earned: float = 0.0
    # decayed sums for the least-squares fit of forward_ms = a + c * nodes
    _w: float = 0.0
    _n: float = 0.0
    _nn: float = 0.0
    _y: float = 0.0
    _ny: float = 0.0
    # step kind (the frozenset of the regimes that drafted in it; PLAIN: none) -> (the overheads of
    # its last OVERHEAD_WINDOW steps, their median: read a few times per request per step), the
    # least recently seen kind first
    _overheads: dict = field(default_factory=dict)
    speculative_steps: int = 0
    steps: int = 0
    # step kind -> the step count when `try_measuring` last had it tried
    _tried: dict = field(default_factory=dict)

    def observe(self, nodes: int, forward_ms: float, step_ms: float, drafted: Collection[Hashable] = ()) -> None:
        """One verified step: `nodes` in the batch, the verifier's `forward_ms`, the engine's
        whole `step_ms`; `drafted`: the regimes of the requests that asked for a draft in it (none:
        a plain step)."""
        d = self.decay
        self._w = d * self._w + 1.0
        self._n = d * self._n + nodes
        self._nn = d * self._nn + nodes * nodes
        self._y = d * self._y + forward_ms
        self._ny = d * self._ny + nodes * forward_ms
        self.credit = self.credit_decay * self.credit + self.explore * step_ms
        self.earned = self.credit_decay * self.earned + self.explore * step_ms
        kind = frozenset(drafted)
        recent, _ = self._overheads.get(kind) or (collections.deque(maxlen=OVERHEAD_WINDOW), None)
        recent.append(max(0.0, step_ms - forward_ms))
        _keep_last(self._overheads, kind, (recent, statistics.median(recent)))
        self.speculative_steps += int(bool(kind))
        self.steps += 1

    def fit(self) -> tuple[float, float]:
        """(a, c): intercept and ms per node, both >= 0. Flat (c = 0) until nodes vary."""
        if self._w == 0.0:
            return 0.0, 0.0
        mean_n, mean_y = self._n / self._w, self._y / self._w
        var = self._nn / self._w - mean_n * mean_n
        if var <= 1e-9 * max(1.0, mean_n * mean_n):
            return mean_y, 0.0
        c = max(0.0, (self._ny / self._w - mean_n * mean_y) / var)
        return max(0.0, mean_y - c * mean_n), c

    def forward_ms(self, nodes: int) -> float:
        a, c = self.fit()
        return a + c * nodes

    def afford(self, loss_ms: float) -> bool:
        """Spend the credit on a probe expected to lose `loss_ms` against the best choice, if it
        covers it or is nearly full (a probe expected to lose nothing is free, and so is any while
        the engine is still learning what speculative steps cost)."""
        if self.speculative_steps < LEARNING_STEPS:
            return True
        if loss_ms > self.credit and self.credit < SATURATED * self.earned:
            return False
        self.credit = max(0.0, self.credit - max(0.0, loss_ms))
        return True

    def measured(self, drafted: Collection[Hashable]) -> bool:
        """Whether a step in which exactly the `drafted` regimes drafted (none: plain) was seen."""
        return frozenset(drafted) in self._overheads

    def try_measuring(self, drafted: Collection[Hashable]) -> bool:
        """Whether to try a step in which exactly the `drafted` regimes draft, to measure it: never
        seen, and not tried in the last RETRY_STEPS steps (a try may come out another kind: a
        request that joins, a drafter that is down). True records the try."""
        kind = frozenset(drafted)
        if self.measured(kind) or self.steps < self._tried.get(kind, -RETRY_STEPS) + RETRY_STEPS:
            return False
        _keep_last(self._tried, kind, self.steps)
        return True

    def overhead_ms(self, drafted: Collection[Hashable] = ()) -> float:
        """Median time outside the forward of the last `OVERHEAD_WINDOW` steps in which exactly the
        `drafted` regimes drafted (none: plain steps). Never seen: the dearest of those regimes
        alone, where any was seen; else the cheapest kind seen (a probe corrects it); none: 0."""
        seen = self._overheads
        kind = frozenset(drafted)
        if kind in seen:
            return seen[kind][1]
        alone = [seen[frozenset((k,))][1] for k in kind if frozenset((k,)) in seen]
        if alone:
            return max(alone)
        return min((median for _, median in seen.values()), default=0.0)

    def overheads(self) -> dict:
        """Step kind (the frozenset of regimes that drafted; PLAIN: none) -> its median overhead in
        ms, for every kind measured."""
        return {kind: median for kind, (_, median) in self._overheads.items()}

    def step_ms(self, nodes: int, drafted: Collection[Hashable] = ()) -> float:
        """A step of `nodes` in which requests of the `drafted` regimes ask for drafts (none: a plain
        step)."""
        return self.forward_ms(nodes) + self.overhead_ms(drafted)


def _keep_last(recent: dict, key, value) -> None:
    """Set `key` as the most recent entry of `recent` (insertion order), keeping the MAX_KINDS last."""
    recent.pop(key, None)
    recent[key] = value
    if len(recent) > MAX_KINDS:
        del recent[next(iter(recent))]


@dataclass
class AcceptanceTable:
    """EMA of tokens emitted per step, per budget."""

    alpha: float = 0.2
    tau: dict = field(default_factory=dict)

    def observe(self, budget: int, emitted: int) -> None:
        prev = self.tau.get(budget)
        self.tau[budget] = float(emitted) if prev is None else (1 - self.alpha) * prev + self.alpha * emitted

    def get(self, budget: int) -> float | None:
        return 1.0 if budget == 1 else self.tau.get(budget)

    def kin(self, budget: int) -> float | None:
        """What related tables measured at `budget` (none here: see `RegimeTables`)."""
        return None


class RegimeTables(dict):
    """Regime -> the engine-wide AcceptanceTable of its requests, made on first use. A table stands
    in for a budget its regime has not measured with the best that another regime of the same
    temperature band measured there (`kin`): a new regime (the drafter's default shape beside
    requests that named it) would otherwise go by its first few trees alone, and one that
    accepted nothing keeps larger trees from ever being probed."""

    def __missing__(self, regime) -> "AcceptanceTable":
        table = self[regime] = _KinTable(self, regime)
        return table


class _KinTable(AcceptanceTable):
    def __init__(self, tables: RegimeTables, regime: Regime) -> None:
        super().__init__()
        self._tables, self._regime = tables, regime

    def kin(self, budget: int) -> float | None:
        seen = [t.tau[budget] for k, t in self._tables.items()
                if k != self._regime and k.band == self._regime.band and budget in t.tau]
        return max(seen, default=None)


@dataclass
class AdaptivePolicy:
    """Per-request choice of the next tree: its budget and the regime it is drafted in. `cap`: the
    largest budget allowed (the request's node budget or the verifier's tree limit); `start`: the
    budget used until some acceptance has been measured; `regime`: the request's own (its start,
    and the first on a tie); `also`: other regimes it may draft in (a request that left the tree
    shape to the server also tries n-gram trees: `RegimeTables` and the cost model price each
    regime apart, so the cheaper shape wins where it emits as much). `current`: the regime of the
    latest choice that drafts. `shared` arguments are the engine's `RegimeTables`."""

    cap: int
    start: int = 8
    regime: Hashable = Regime(0, 0)
    also: tuple = ()
    probe_every: int = 16
    warmup: int = 12
    tables: dict = field(default_factory=dict)  # regime -> this request's own AcceptanceTable
    steps: int = 0
    settled: bool = False
    pinned = False  # the engine chooses its budgets
    _turn: int = 0  # the next neighbour to probe (`_neighbour`)

    def __post_init__(self):
        self.budgets = allowed_budgets(self.cap)
        self.start = max(b for b in self.budgets if b <= max(1, self.start))
        self.regimes = (self.regime, *(g for g in dict.fromkeys(self.also) if g != self.regime))
        self.options = [NO_DRAFT] + [Choice(b, g) for g in self.regimes for b in self.budgets if b > 1]
        self._order = {o: i for i, o in enumerate(self.options)}
        self.current = self.regime
        self.best = NO_DRAFT

    def estimate(self, budget: int, shared: "RegimeTables | None", regime: Hashable | None = None) -> float:
        """Tokens a step of `budget` drafted in `regime` (None: the request's own) is expected to emit."""
        if budget == 1:
            return 1.0
        regime = self.regime if regime is None else regime
        own = self.tables.get(regime)
        if own is not None and own.get(budget) is not None:
            return own.get(budget)
        if shared is not None:
            table = shared[regime]
            measured = table.get(budget)
            if measured is not None:
                return measured
            kin = table.kin(budget)
            if kin is not None:
                return kin  # a guess, which a probe of this budget corrects
        smaller = [own.get(b) for b in self.budgets if b < budget and own.get(b) is not None] if own else []
        return max(smaller) if smaller else 1.0

    def choose(self, cost: CostModel, other_nodes: int = 0, shared: "RegimeTables | None" = None,
               other_tokens: float = 0.0, other_drafted: frozenset = frozenset()) -> int:
        """Budget for this request's next tree, drafted in `current`. `other_nodes` /
        `other_tokens` / `other_drafted`: what the rest of the batch verifies / emits per step, and
        the regimes of those of its requests that ask for drafts. Sets `settled`: the choice is
        the best by the estimates (not the start budget, not a probe)."""
        self.steps += 1
        self.settled = False
        if not self._measured(shared):
            self.best = Choice(self.start, self.regime) if self.start > 1 else NO_DRAFT
            self.current = self.regime
            return self.start
        times, tokens, scores = self._scores(cost, other_nodes, shared, other_tokens, other_drafted)
        rank = self._rank(scores)
        self.best = max(self.options, key=rank)
        every = 2 if self.steps <= self.warmup else self.probe_every
        clock = self.steps if self.steps <= self.warmup else cost.steps  # after the warm-up, the batch's
        if every and clock % every == 0 and len(self.options) > 1:
            # off: re-check the most promising tree, not just the smallest
            probe = max(self.options[1:], key=rank) if self.best == NO_DRAFT else self._neighbour(self.best, rank)
            if cost.afford(times[probe] - tokens[probe] / scores[self.best]):
                return self._take(probe)
        self.settled = True
        return self._take(self.best)

    def best_if_shared(self, cost: CostModel, other_nodes: int, shared: "RegimeTables | None",
                       other_tokens: float, other_drafted: frozenset, regime: Hashable | None = None) -> Choice:
        """The best choice were the rest of the batch drafting in `regime` too (its drafting
        overhead paid by the step either way), among no draft and the trees of `regime` (one of
        `regimes`); None: among every option, the rest drafting in the current regime. Changes
        nothing in the policy."""
        options = self.options if regime is None else [o for o in self.options if o.regime in (None, regime)]
        paid = self.current if regime is None else regime
        _, _, scores = self._scores(cost, other_nodes, shared, other_tokens, other_drafted | {paid}, options)
        return max(options, key=self._rank(scores))

    def keep_own_regime(self) -> None:
        """Draft in its own regime only from now on (the drafter cannot draft the others)."""
        if len(self.regimes) == 1:
            return
        self.also, self.regimes = (), (self.regime,)
        self.options = [o for o in self.options if o.regime in (None, self.regime)]
        self.current = self.regime
        if self.best not in self.options:
            self.best = NO_DRAFT

    def _measured(self, shared: "RegimeTables | None") -> bool:
        """Whether any acceptance of its regimes is known (its own, or the engine's)."""
        return any(t.tau for t in self.tables.values()) or (
            shared is not None and any(g in shared and shared[g].tau for g in self.regimes))

    def _take(self, choice: Choice) -> int:
        if choice.regime is not None:
            self.current = choice.regime
        return choice.budget

    def _rank(self, scores: dict):
        """The best score; on a tie, the smaller budget, then the request's own regime."""
        return lambda o: (scores[o], -o.budget, -self._order[o])

    def _scores(self, cost: CostModel, other_nodes: int, shared: "RegimeTables | None", other_tokens: float,
                other_drafted: frozenset, options: list | None = None) -> tuple[dict, dict, dict]:
        """Per option (of `options`, default all): the step's time, the batch's tokens and their
        ratio."""
        times, tokens, scores = {}, {}, {}
        for o in self.options if options is None else options:
            drafted = other_drafted | {o.regime} if o.budget > 1 else other_drafted
            times[o] = max(1e-6, cost.step_ms(other_nodes + o.budget, drafted))
            tokens[o] = self.estimate(o.budget, shared, o.regime) + other_tokens
            scores[o] = tokens[o] / times[o]
        return times, tokens, scores

    def _neighbour(self, best: Choice, rank) -> Choice:
        """The next neighbour of `best` to probe, in turn: one budget larger, one smaller (budget 1:
        no draft), and with other regimes the best tree of another regime. One that does not exist
        gives its turn to the next; the turn moves on whether the probe is then taken or not (a dear
        one must not block the others)."""
        i = self.budgets.index(best.budget)
        up = Choice(self.budgets[i + 1], best.regime) if i + 1 < len(self.budgets) else None
        down = (Choice(self.budgets[i - 1], best.regime) if i > 1 else NO_DRAFT) if i > 0 else None
        across = max((o for o in self.options if o.regime not in (None, best.regime)), key=rank, default=None)
        turns = (up, down, across) if len(self.regimes) > 1 else (up, down)
        turn, self._turn = self._turn % len(turns), self._turn + 1
        return next(o for o in turns[turn:] + turns[:turn] if o is not None)

    def observe(self, budget: int, emitted: int, shared: "RegimeTables | None" = None,
                regime: Hashable | None = None) -> None:
        """A step of `budget` drafted in `regime` (None: the request's own) emitted `emitted` tokens."""
        regime = self.regime if regime is None else regime
        self.tables.setdefault(regime, AcceptanceTable()).observe(budget, emitted)
        if shared is not None:
            shared[regime].observe(budget, emitted)


@dataclass
class FixedPolicy:
    """Always the same budget (0: the drafter's default; 1: no speculation), in `regime`."""

    budget: int
    regime: Hashable = Regime(0, 0)
    settled = False  # never turned off for the batch's sake: the client chose
    pinned = True

    @property
    def current(self) -> Hashable:
        return self.regime

    def keep_own_regime(self) -> None:
        """It has one regime already."""

    def choose(self, cost: CostModel, other_nodes: int = 0, shared: "RegimeTables | None" = None,
               other_tokens: float = 0.0, other_drafted: frozenset = frozenset()) -> int:
        return self.budget

    def estimate(self, budget: int, shared: "RegimeTables | None", regime: Hashable | None = None) -> float:
        return (shared[self.regime if regime is None else regime].get(budget) if shared is not None else None) or 1.0

    def observe(self, budget: int, emitted: int, shared: "RegimeTables | None" = None,
                regime: Hashable | None = None) -> None:
        if shared is not None and budget > 1:
            shared[self.regime if regime is None else regime].observe(budget, emitted)
