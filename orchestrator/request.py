"""A generation request as the engine sees it: the immutable submission, the mutable state that
travels with it between engines, and the events it produces.

The committed-token log (`RequestState.tokens`: prompt, then every decided token) is the source
of truth. Once the first prefill has happened its last entry is the *root*: decided (and already
sent to the client) but not yet consumed by the verifier's state; everything before it has been
consumed (or will be, by the commit that rides on the next Verify). So any verifier can be
rebuilt from `tokens[:-1]` and any drafter from the same list.
"""
from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass, field
from typing import Optional

from orchestrator.adaptive import Regime, temperature_band
from treeserve.sampling import Sampling
from treeserve.v1 import treeserve_pb2 as pb


@dataclass(frozen=True)
class Speculation:
    """mode: 'off', 'chain' or 'tree'. node_budget 0: the drafter's default (or the adaptive
    policy's choice). adaptive: let the engine pick the budget per step and turn speculation off."""

    mode: str = "tree"
    shape: int = pb.TREE_SHAPE_UNSPECIFIED
    node_budget: int = 0
    max_depth: int = 0
    draft_ahead: bool = False
    adaptive: bool = True

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def tree_shape(self) -> int:
        """The TreeShape asked of the drafter (UNSPECIFIED: its default)."""
        return pb.TREE_SHAPE_CHAIN if self.mode == "chain" else self.shape

    def draft_options(self):
        return pb.DraftOptions(shape=self.tree_shape, node_budget=self.node_budget, max_depth=self.max_depth,
                               draft_ahead=self.draft_ahead)


@dataclass(frozen=True)
class RequestSpec:
    """What a client asked for, after validation. `front`: the Generation server that streams the
    request's events to its client."""

    request_id: str
    prompt: tuple[int, ...]
    sampling: Sampling
    max_new_tokens: int
    speculation: Speculation
    front: str
    # this submission's own mark: a request id reused at once never names the verifier sequence
    # of the request that had it before (whose Release may not have been served yet), and the
    # front files no late event of that request under the new one
    admission: str = field(default_factory=lambda: secrets.token_hex(4))

    @functools.cached_property  # read a few times a step (a frozen dataclass keeps it all the same)
    def regime(self) -> Regime:
        """What its acceptance and drafting cost depend on besides the text (`adaptive.Regime`):
        the tree shape it drafts, its temperature band, draft-ahead."""
        return Regime(self.speculation.tree_shape, self._band, self.speculation.draft_ahead)

    @functools.cached_property
    def other_regimes(self) -> tuple[Regime, ...]:
        """The regimes an adaptive request may draft in besides its own. One that leaves the tree
        shape to the server (tree mode, shape UNSPECIFIED) also tries n-gram trees: prompt lookup
        costs the drafter no model pass, and on text that repeats itself it accepts as much as a
        draft model. One that named a shape, or asked for chains, drafts only that."""
        sp = self.speculation
        if not sp.adaptive or sp.mode != "tree" or sp.shape != pb.TREE_SHAPE_UNSPECIFIED:
            return ()
        return (Regime(pb.TREE_SHAPE_NGRAM, self._band, False),)

    @property
    def _band(self) -> int:
        return temperature_band(0.0 if self.sampling.greedy else self.sampling.temperature)


# Finish reasons on the engine side (the front maps them to pb.FinishReason).
LENGTH, EOS, CANCELLED = "length", "eos", "cancelled"


@dataclass(frozen=True)
class Event:
    """Something a request's client must hear, in `seq` order. Exactly one event of a request has
    `finish` or `error` set, and it is its last. `moved_to` events are out of band (seq -1): the
    request continues on another engine, whose outbox the front must read."""

    request_id: str
    seq: int
    tokens: tuple[int, ...] = ()
    tree_nodes: int = 0
    step_ms: float = 0.0
    forwards: int = 0  # target forward passes so far (prefill included)
    finish: Optional[str] = None
    error: Optional[tuple[int, str]] = None  # (grpc status code number, message)
    moved_to: Optional[str] = None
    admission: str = ""  # the submission's (`RequestSpec.admission`)

    @property
    def last(self) -> bool:
        return self.finish is not None or self.error is not None


@dataclass
class RequestState:
    """Everything needed to continue a request anywhere. Owned by one engine's loop at a time."""

    spec: RequestSpec
    tokens: list[int]
    policy: object  # adaptive.AdaptivePolicy or adaptive.FixedPolicy
    started: bool = False  # the first prefill has produced the first token
    epoch: int = 0  # bumps on every re-prefill: the verifier sequence id changes with it
    needs_prefill: bool = True
    pending_commit: Optional[tuple[int, tuple[int, ...]]] = None  # (length, accepted nodes)
    generated: int = 0
    forwards: int = 0
    seq: int = 0
    failures: int = 0
    # drafting bookkeeping (engine-local; `Engine.adopt` resets what a move leaves stale)
    awaiting_draft: bool = False
    budget: int = 1
    regime: Optional[Regime] = None  # the regime of its latest draft (None: its own, `spec.regime`)
    last_nodes: int = 1  # nodes verified / tokens emitted in the last step
    last_tokens: int = 1
    from_drafter: bool = False  # this step's tree came from the drafter
    tree_map: Optional[tuple[int, ...]] = None  # drafter's node index of each verified node, if cut
    reopen_drafter: bool = False  # moved here: this engine's drafter link must start it afresh

    def __post_init__(self):
        if self.regime is None:
            self.regime = self.spec.regime

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def vid(self) -> str:
        """The verifier's sequence id: a fresh one per submission and per prefill, so neither a
        reused request id nor a re-prefill collides with a stale copy a replica might still hold."""
        return f"{self.spec.request_id}#{self.spec.admission}.{self.epoch}"

    @property
    def committed(self) -> int:
        """Tokens the verifier state has consumed (counting the pending commit)."""
        return len(self.tokens) - 1

    @property
    def root(self) -> int:
        return self.tokens[-1]

    @property
    def remaining(self) -> int:
        return self.spec.max_new_tokens - self.generated

    def next_event(self, **kw) -> Event:
        ev = Event(self.request_id, self.seq, forwards=self.forwards, admission=self.spec.admission, **kw)
        self.seq += 1
        return ev
