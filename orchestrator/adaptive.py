"""Adaptive speculation: how many tree nodes to ask the drafter for, step by step.

A step with a budget of b nodes emits tau(b) tokens on average (accepted drafts plus the bonus
token; tau(1) = 1 exactly: plain decoding) and costs step_ms(b). The engine wants the most tokens
per millisecond from the whole batch, and every request shares the step's cost, so each request
picks

    b* = argmax_b  (tau(b) + tokens of the rest of the batch) / step_ms(nodes of the rest + b)

over the budgets it allows (powers of two up to its cap). b* = 1 turns speculation off. Alone on
a GPU a node is nearly free and big trees win; in a large batch each node costs about as much as
a token of another sequence, and the same formula turns speculation off.

- tau(b) is an exponential moving average of the tokens emitted per step at budget b, per request
  (acceptance depends on the text), falling back to the engine-wide average of the requests of
  the same `Regime` (tree shape and temperature band: an n-gram tree at temperature 1 says little
  about a draft model's tree at temperature 0) for budgets the request has not tried, and
  otherwise to the nearest smaller tried budget (never optimistic).
  Until some acceptance has been measured (by the request or engine-wide) the request drafts at
  `start`; a warm cost model alone (e.g. from plain traffic) is no reason to begin at 1.
- step_ms(n) = forward_ms(n) + overhead: the verifier's forward time is fitted as a + c * n over
  the nodes of the whole batch (least squares with forgetting), so large batches, where every
  extra node costs real compute, naturally push the choice towards 1; the overhead (drafting,
  RPCs) is the median of the last `OVERHEAD_WINDOW` steps' overheads of its kind: plain steps (no
  draft asked for) apart from the speculative steps of each regime (a sampled draft-model tree
  costs its drafter several times an n-gram tree), a step being of every regime that asked for a
  draft in it. A median, because a one-off stall (a drafter compiling or capturing a new shape
  takes up to a second) must not make speculation look hopeless for the hundreds of steps it would
  take to be probed away. A kind never measured is priced like the cheapest measured one.
- Every `probe_every` steps the request may try a neighbour of its best budget (alternately one
  larger and one smaller) so the estimates stay current; while speculation is off it tries the
  best-scoring budget above 1 instead, because drafting has a fixed cost per step (a drafter
  RPC, a draft-model forward per tree level): budget 2 may not pay where 8 does, so probing only
  2 could keep speculation off for good. While the engine has not verified a plain step (every
  request so far speculated), a probe is a plain step instead: until then plain decoding is priced
  with a speculative step's overhead, drafting included, and could never win against an expensive
  drafter. During the first `warmup` steps the cadence is every
  other step: until the batch has verified different node counts the cost slope is unknown
  (assumed flat). Each request probes at its own `phase`, so a large batch does not probe all at
  once.
- A probe is taken only when the engine can afford it (`CostModel.afford`). Every step the engine
  verifies earns credit, `explore` times its measured time; a probe spends its estimated loss
  against the best budget: its step time less the time the best budget needs for the tokens the
  probe is expected to emit. So probing costs the engine at most about `explore` of its time, by
  the estimates, however many requests share a step, and short requests that could not afford a
  probe alone pay for one between them. A probe the estimates call as good as the best is free; one
  dearer than the credit can ever hold is taken when the credit is nearly full (a few times in ten
  thousand steps), or a stale estimate could keep speculation off for good. A refused neighbour
  does not block the other one: the direction alternates whether the probe is taken or not.
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
from typing import Collection, Hashable, NamedTuple

BUDGETS = (1, 2, 4, 8, 16, 32, 64)
# upper ends of the temperature bands (greedy, then sampled at up to 0.5, up to 1, above 1)
TEMPERATURE_BANDS = (0.0, 0.5, 1.0)
PLAIN = "plain"  # the kind of a step that asked the drafter for nothing
OVERHEAD_WINDOW = 16  # steps whose overheads (outside the forward) give the median
LEARNING_STEPS = OVERHEAD_WINDOW  # speculative steps an engine verifies before probes spend its credit
SATURATED = 0.9  # share of its level at which the credit pays for any one probe


class Regime(NamedTuple):
    """What a request's acceptance and drafting cost depend on besides its text. shape: the tree
    shape it asks the drafter for (a TreeShape value; 0, the drafter's default, is its own);
    band: its temperature's band (`temperature_band`)."""

    shape: int
    band: int


def temperature_band(temperature: float) -> int:
    """0 for greedy (pass 0.0), then 1, 2, ... by the upper ends in TEMPERATURE_BANDS."""
    return next((i for i, top in enumerate(TEMPERATURE_BANDS) if temperature <= top), len(TEMPERATURE_BANDS))


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
    # step kind (PLAIN or a Regime) -> the overheads of its last OVERHEAD_WINDOW steps
    _overheads: dict = field(default_factory=lambda: collections.defaultdict(
        lambda: collections.deque(maxlen=OVERHEAD_WINDOW)))
    # the medians of `_overheads`, kept up to date by `observe` (read a few times per request per step)
    _overhead_ms: dict = field(default_factory=dict)
    speculative_steps: int = 0

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
        for kind in drafted or (PLAIN,):
            recent = self._overheads[kind]
            recent.append(max(0.0, step_ms - forward_ms))
            self._overhead_ms[kind] = statistics.median(recent)
        self.speculative_steps += int(bool(drafted))

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

    def measured(self, kind: Hashable) -> bool:
        """Whether a step of this kind (PLAIN or a Regime) has been observed."""
        return kind in self._overhead_ms

    def overhead_ms(self, kind: Hashable) -> float:
        """Median time outside the forward of the last `OVERHEAD_WINDOW` steps of this kind (PLAIN
        or a Regime); never measured: the cheapest measured kind's (a probe corrects it); none: 0."""
        if kind in self._overhead_ms:
            return self._overhead_ms[kind]
        return min(self._overhead_ms.values(), default=0.0)

    def overheads(self) -> dict:
        """Step kind (PLAIN or a Regime) -> its median overhead in ms, for every kind measured."""
        return dict(self._overhead_ms)

    def step_ms(self, nodes: int, kind: Hashable) -> float:
        return self.forward_ms(nodes) + self.overhead_ms(kind)


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


@dataclass
class AdaptivePolicy:
    """Per-request budget choice. `cap`: the largest budget allowed (the request's node budget or
    the verifier's tree limit); `start`: the budget used until some acceptance has been measured;
    `regime`: the request's (what its speculative steps are priced by; `shared` tables passed to
    `choose` and `observe` are its regime's)."""

    cap: int
    start: int = 8
    regime: Hashable = Regime(0, 0)
    probe_every: int = 16
    warmup: int = 12
    phase: int = 0
    table: AcceptanceTable = field(default_factory=AcceptanceTable)
    steps: int = 0
    best: int = 0
    _probe_up: bool = True

    def __post_init__(self):
        self.budgets = allowed_budgets(self.cap)
        self.start = max(b for b in self.budgets if b <= max(1, self.start))

    def estimate(self, budget: int, shared: AcceptanceTable | None) -> float:
        own = self.table.get(budget)
        if own is not None:
            return own
        if shared is not None and shared.get(budget) is not None:
            return shared.get(budget)
        smaller = [self.table.get(b) for b in self.budgets if b < budget and self.table.get(b) is not None]
        return max(smaller) if smaller else 1.0

    def choose(self, cost: CostModel, other_nodes: int = 0, shared: AcceptanceTable | None = None,
               other_tokens: float = 0.0) -> int:
        """Budget for this request's next tree. `other_nodes` / `other_tokens`: what the rest of
        the batch verifies / emits per step."""
        self.steps += 1
        if not self.table.tau and (shared is None or not shared.tau):
            self.best = self.start
            return self.start
        speculative = other_nodes > other_tokens  # does the rest of the batch speculate?

        times = {b: max(1e-6, cost.step_ms(other_nodes + b, self.regime if speculative or b > 1 else PLAIN))
                 for b in self.budgets}
        tokens = {b: self.estimate(b, shared) + other_tokens for b in self.budgets}
        scores = {b: tokens[b] / times[b] for b in self.budgets}
        rank = lambda b: (scores[b], -b)  # the best score; on a tie, the smaller budget
        self.best = max(self.budgets, key=rank)
        every = 2 if self.steps <= self.warmup else self.probe_every
        if every and (self.steps + self.phase) % every == 0 and len(self.budgets) > 1:
            if self.best != 1 and not speculative and not cost.measured(PLAIN):
                # plain steps are priced with the speculative steps' overhead (drafting included)
                # until one is measured, so plain could never win: one plain step measures it
                return 1
            # off: re-check the most promising tree, not just the smallest
            probe = max(self.budgets[1:], key=rank) if self.best == 1 else self._neighbour(self.best)
            if cost.afford(times[probe] - tokens[probe] / scores[self.best]):
                return probe
        return self.best

    def _neighbour(self, b: int) -> int:
        """The next neighbour of `b` to probe: alternately one larger and one smaller (at the ends,
        the only one there is), whether the probe is then taken or not (a dear one must not block
        the other)."""
        i = self.budgets.index(b)
        up = i + 1 < len(self.budgets)
        down = i > 0
        go_up = (self._probe_up and up) or not down
        self._probe_up = not self._probe_up
        return self.budgets[i + 1] if go_up else self.budgets[i - 1]

    def observe(self, budget: int, emitted: int, shared: AcceptanceTable | None = None) -> None:
        self.table.observe(budget, emitted)
        if shared is not None:
            shared.observe(budget, emitted)


@dataclass
class FixedPolicy:
    """Always the same budget (0: the drafter's default; 1: no speculation)."""

    budget: int

    def choose(self, cost: CostModel, other_nodes: int = 0, shared: AcceptanceTable | None = None,
               other_tokens: float = 0.0) -> int:
        return self.budget

    def observe(self, budget: int, emitted: int, shared: AcceptanceTable | None = None) -> None:
        if shared is not None and budget > 1:
            shared.observe(budget, emitted)
