"""What every proposer is: an object per request that owns that request's proposal state, offers
drafts each iteration, and learns from what the verification kept.

A proposer never runs a model itself: one that needs a model step for its drafts (the draft model)
names the shared `Runner` that runs its rows batched, and the scheduler executes every runner of the
iteration's plan. What differs between kinds is data on the class (`runs_model`, `step_cost`, `tree`,
`reserves_room`), so the scheduler never asks which kind a row has.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from speccompile.core.cost_model import DRAFT, LoopCosts, tokens_per_ms
from speccompile.core.gamma_policy import GammaPolicy


@dataclass
class Offer:
    """One row's proposal for one iteration, as its proposer made it.

    count: drafts offered (0: none; the row's verification is then a plain step for it).
    tokens: the drafts themselves when known at once (lookups); None while a runner has yet to draft them.
    source: the proposer that made it (under `auto`, the chosen one), which learns from its outcome.
    acceptance_by_position: what the source expects P_1..P_count to be (for `auto` and the tree).
    """

    count: int
    source: "Proposer"
    tokens: list[int] | None = None
    acceptance_by_position: list[float] | Callable[[], list[float]] = field(default_factory=list)
    _rated: tuple | None = field(default=None, repr=False, compare=False)  # (costs, rate at them): asked twice

    def rate(self, costs: LoopCosts | None) -> float:
        """Expected tokens per ms of an iteration carrying this offer (per iteration without costs).
        An offer may hold its expectation as a function, computed only when a choice asks for it."""
        if self._rated is not None and self._rated[0] is costs:
            return self._rated[1]
        expected = self.acceptance_by_position
        rate = tokens_per_ms(costs, expected() if callable(expected) else expected, self.count, self.step_cost)
        self._rated = (costs, rate)
        return rate

    @property
    def step_cost(self) -> str | None:
        """Whose model steps its drafts cost (cost_model.DRAFT, EAGLE), None if its source runs no model."""
        return self.source.step_cost if self.source.runs_model else None

    def iteration_ms(self, costs: LoopCosts) -> float:
        """The ms of an iteration carrying this offer (count > 0): its drafts' model steps, if its
        source runs a model, and the verification of the smallest γ verified at that holds it."""
        return costs.iteration_ms(costs.graph_for(self.count), self.count, self.step_cost)


class Proposer:
    """One request's proposer. Subclasses set the class data and implement `offer`; `observe` and
    the rest have the common meaning. name: the key its statistics are counted under."""

    name = "proposer"
    runs_model = False  # its drafts cost model steps (they count in the iteration's draft time)
    step_cost = DRAFT  # whose steps those are, as the cost model prices them (cost_model.DRAFT, EAGLE)
    tree = False  # it proposes a token tree, verified by a tree pass (core/tree.py), not a chain
    reserves_room = True  # its drafts need cache room reserved up front (a tree shrinks to fit instead)
    learns_policy = False  # its outcomes teach the load's γ policy (whose acceptance is the draft model's)
    compares_costs = False  # it needs the load's costs (the γ policy's) whatever the request's γ
    runner: "Runner | None" = None  # the shared runner that drafts its offers (None: its offers hold their tokens)

    def offer(self, request, wanted: int, cap: int, policy: GammaPolicy | None) -> Offer:
        """The row's proposal this iteration: `wanted` drafts are what the γ policy (or the request's
        own γ) asks of a model drafter, `cap` the most its length leaves room for."""
        raise NotImplementedError

    def observed(self, request, policy: GammaPolicy | None) -> int:
        """Iterations whose outcome the expectation of this proposer's offers has learned from (a
        model's: auto explores each for a few before it trusts what they measured)."""
        return 0

    def drafts_tree(self, request, batch: int, room: int) -> bool:
        """Whether this iteration, of `batch` requests, verifies a dynamic tree of its own instead of an
        offer (an EAGLE-3 head's: core/proposers/eagle_tree.py); `room`: cache positions left."""
        return False

    def observe(self, stats, offer: Offer, drafts: int, accepted: int) -> None:
        """The verification kept the first `accepted` of the `drafts` proposed (drafts may be fewer than
        offered: a runner can stop early, the graph can hold fewer): count the iteration in the
        request's statistics, under this proposer's name, and learn from it."""
        stats.record_iteration(accepted, drafts, self.name)

    def finish(self, request) -> None:
        """The request ended (its output may teach proposers of later requests)."""


class Runner(Protocol):
    """Shared work behind the proposers that run a model (one per runtime): it keeps that model's
    cache in step with the target's slots, and drafts for its rows of a plan, batched."""

    reads_target_features: bool  # the scheduler calls after_target(rows, first, before, after, features)
    steps: int  # model steps the last `draft` ran
    catch_up_ms: float  # of its time, what feeding the model the tokens it had missed took (after plain steps)

    def start(self, slots: int) -> None: ...
    def admit(self, slot: int) -> None: ...
    def prefill(self, rows: list, tokens: np.ndarray, counts: np.ndarray, first: int, complete: bool,
                feed: list[bool]) -> None: ...
    def move(self, source: int, destination: int) -> None: ...
    def share(self, source: int, destination: int, length: int) -> None: ...
    def draft(self, rows: list, offers: list[Offer], counts: np.ndarray, proposed: np.ndarray,
              sampling: bool) -> np.ndarray | None: ...
    def after_verify(self, rows: list) -> None: ...
