"""Choosing γ, and whether speculating pays at all: from a measured profile or a quick
calibration, then online, from what the loop measures.

Acceptance. The policy keeps, per draft position k, counts of "reached k" and "accepted k" of the
draft model's rows. Their ratio is the conditional acceptance c_k = P(d_k accepted | d_1..d_{k-1}
accepted), and P_k = c_1 ... c_k is what the cost model needs. The profile's calibration enters as
pseudo-counts (a prior worth `prior_weight` iterations), so the first iterations follow the profile
and later ones the text at hand; observations older than `ACCEPTANCE_HORIZON` iterations fade, so a
load whose text changes is followed. Positions beyond the γ in use are not observed and keep their
prior. Other proposers' acceptance is each request's own (core/proposers).

Costs. The prior's (a profile's loop runs, or a quick calibration's calls timed outside the loop)
are corrected by every iteration the loop runs, whoever proposed: each target call (a
verification, or a plain step) updates one correction factor for every target call, each draft
step one for every draft step, each EAGLE-3 head's calls (its catch-up and steps) one for both (the
mean ratio of measured to prior, with a prior of `COST_PRIOR_WEIGHT` iterations at 1), and the
loop's own work per iteration, speculative and plain, is its measured mean. The
γ in use teaches the policy about the others, and plain decoding's cost stays comparable with
speculation's.

Against plain decoding (`worth_running`). Under γ = auto, an offer runs only if it promises more
tokens per ms than a plain step; otherwise the row decodes plainly. A proposer whose offers were
declined is still run now and then (a probe), so a text that turns predictable is noticed. Probes
are paid from a credit: each plain iteration in which a proposer's offer is declined adds
`PROBE_BUDGET` of a plain step to its credit (shared by the proposers being declined), a probe is
due once the credit covers what the probe would lose if it kept nothing, and each probe is charged
what it lost: its time less what plain decoding would have taken for the tokens it gave. So probes
that keep nothing cost at most `PROBE_BUDGET` of plain decoding's time (one per `probe_interval`
for a proposer declined alone), while a probe that paid its way makes the next one due at once, and
the acceptance probes show is learned within a few iterations, not a few hundred.

Under a guessed prior (`guessed_prior`: no γ profile measured this pair's acceptance) the first
probe is free of the credit, due at the first decline. At the costs of a low-bit target on a CPU (a
verification of 5 tokens 2.5 decode steps) a neutral prior declines a draft that agrees 9 times in
10, and the credit would first allow a probe after about a hundred plain steps.

Once a γ is in use, another must promise `SWITCH_MARGIN` more speedup to replace it; so must
speculation to replace plain decoding, and the reverse. Where each compiled γ is its own
verification graph (a small model, a session per graph), each ONNX Runtime session holds its own
packed copy of the target's weights on a CPU: a verification right after another γ's finds its
weights evicted from cache (demo pair, 2 cores: a γ=4 verification after γ=2 and γ=6 ones took 4.6
ms instead of 2.3). Without the margin, estimates hovering near a tie flip γ every few iterations
and pay that each time.
"""

import math
from dataclasses import dataclass, field

from speccompile.core.cost_model import DRAFT, EAGLE, LoopCosts

SWITCH_MARGIN = 0.05
COST_PRIOR_WEIGHT = 4.0
ACCEPTANCE_HORIZON = 64  # iterations: older observations of the load's acceptance fade with this time constant
PROBE_BUDGET = 0.02  # a declined proposer's probes cost at most this share of plain decoding's time
PROBE_CREDIT_CAP = 2.0  # probes' worth of credit a proposer may hold (what paying probes earned)
COSTS_EVERY = 4  # observations between recomputations of the measured costs


@dataclass
class Timing:
    """One decoding iteration as the loop measured it, in ms: its target call (a verification at γ,
    or a plain step at γ 0), its draft model's steps and everything (both without catching up: a
    draft model fed the tokens it missed while rows decoded plainly, a cost of switching, not of
    an iteration). step_cost: whose calls draft_ms and draft_steps are (cost_model.DRAFT, EAGLE: its catch-up the first;
    None: of more than one model at once, which teach neither's cost)."""

    gamma: int
    target_ms: float
    total_ms: float
    draft_ms: float = 0.0
    draft_steps: int = 0
    catch_up_ms: float = 0.0
    step_cost: str | None = DRAFT
    tokens: float = 1.0  # the tokens each row gained, on average (a plain step's: 1)


@dataclass
class Acceptance:
    """Per draft position k, how often position k was reached and its draft kept: observed
    iterations on top of a prior worth `weight` iterations at the conditional rates `prior` (its
    last rate for positions beyond it). What the γ policy learns, and each request per proposer."""

    prior: list[float]
    weight: float
    horizon: float | None = None  # iterations after which an observation's weight has fallen to 1/e (None: never)
    reached: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)
    observed: list[int] = field(default_factory=list)  # iterations (not the prior's) that reached k
    _memo: dict[int, list[float]] = field(default_factory=dict, repr=False, compare=False)  # by_position's

    def __post_init__(self):
        self._cover(len(self.prior) - 1)

    def prior_at(self, k: int) -> float:
        return self.prior[min(k, len(self.prior) - 1)]

    def observe(self, drafts: int, accepted: int) -> None:
        """One iteration: `drafts` proposed, the first `accepted` kept (positions 1..accepted+1 reached)."""
        self._memo.clear()
        if self.horizon is not None:
            fade = math.exp(-1.0 / self.horizon)
            for k in range(len(self.reached)):  # the observed part fades toward the prior
                self.reached[k] = self.weight + fade * (self.reached[k] - self.weight)
                self.kept[k] = self.weight * self.prior_at(k) + fade * (self.kept[k] - self.weight * self.prior_at(k))
        for k in range(min(accepted + 1, drafts)):
            self._cover(k)
            self.reached[k] += 1
            self.kept[k] += k < accepted
            self.observed[k] += 1

    def conditional(self, k: int) -> float:
        """P(draft k+1 kept | drafts 1..k kept), index k from 0."""
        return self.kept[k] / self.reached[k] if k < len(self.reached) else self.prior_at(k)

    def by_position(self, drafts: int) -> list[float]:
        """P_1..P_drafts (unconditional): the products of the conditional rates. A position not
        reached so far keeps the prior's conditional rate, scaled by how the deepest reached
        position compares with its own prior: the text at hand sets the level, the prior the
        decline. Without that, a policy running at a short γ under a pessimistic prior would never
        see that a longer one pays, and a lookup whose first drafts are never kept would still
        expect the prior's rates of the drafts behind them. (Asked every iteration: kept until the
        next observation.)"""
        if drafts in self._memo:
            return self._memo[drafts]
        out, running, level = [], 1.0, 1.0
        for k in range(drafts):
            self._cover(k)
            prior = self.prior_at(k)
            if self.observed[k]:
                conditional = self.conditional(k)
                level = conditional / prior if prior > 0 else 1.0
            else:
                conditional = min(1.0, prior * level)
            running *= conditional
            out.append(running)
        self._memo[drafts] = out
        return out

    def _cover(self, k: int) -> None:
        while len(self.reached) <= k:
            self.reached.append(self.weight)
            self.kept.append(self.weight * self.prior_at(len(self.kept)))
            self.observed.append(0)


# what a measured acceptance prior (a profile's) is worth, in iterations
MEASURED_PRIOR_WEIGHT = 8.0


class GammaPolicy:
    def __init__(self, costs: LoopCosts, prior_by_position: list[float], prior_weight: float = MEASURED_PRIOR_WEIGHT,
                 guessed_prior: bool = False, counts: Acceptance | None = None):
        """costs: the loop's at this batch size and context (a profile's, or a quick calibration's).
        guessed_prior: the acceptance prior was not measured, so a declined proposer's first probe
        is due at once (see the module's docstring). counts: the draft model's acceptance as another
        policy of the load learns it (how often drafts are kept does not depend on the batch size,
        what they cost does); None: this policy's own, from the prior."""
        self.costs = costs  # the prior's
        self.gammas = self.costs.gammas
        self.prior = _conditional(prior_by_position, max(self.gammas))
        if counts is None:
            counts = self.acceptance_prior(prior_by_position, max(self.gammas), prior_weight)
        self.counts = counts
        self.iterations = 0  # observed so far
        self.current: int | None = None  # the γ chosen last
        self.declined: dict[str, int] = {}  # proposer -> plain iterations in a row since its offers last ran
        # proposer -> what running it again cost (a draft model catching up, a head reading what it held)
        self.switch_ms: dict[str, float] = {}
        self._resumed: set[str] = set()  # the proposers that ran in the last decision after being declined
        self._declined_at: dict[str, tuple] = {}  # proposer -> (costs, iterations, probe's worst loss) at its decline
        self.probe_credit: dict[str, float] = {}  # proposer -> ms of plain decoding its probes may still lose
        self.guessed_prior = guessed_prior
        self._probing: dict[str, float] = {}  # proposer -> the worst loss its probe was charged, in the last decision
        self._since_costs = 0  # observations since costs_now() was last computed
        self._ratios = {kind: [COST_PRIOR_WEIGHT, COST_PRIOR_WEIGHT] for kind in (DRAFT, EAGLE, "target")}  # [sum, n]
        # the loop's own work per speculative and per plain iteration: [sum, count], from the prior's
        self._work = {0: [COST_PRIOR_WEIGHT * costs.plain_overhead, COST_PRIOR_WEIGHT],
                      1: [COST_PRIOR_WEIGHT * costs.overhead, COST_PRIOR_WEIGHT]}

    @staticmethod
    def acceptance_prior(prior_by_position: list[float], gamma: int,
                         prior_weight: float = MEASURED_PRIOR_WEIGHT) -> Acceptance:
        """The draft model's acceptance before any observation: the prior's, worth `prior_weight` iterations."""
        return Acceptance(_conditional(prior_by_position, gamma), prior_weight, ACCEPTANCE_HORIZON)

    @property
    def costs(self) -> LoopCosts:
        return self._costs

    @costs.setter
    def costs(self, costs: LoopCosts) -> None:
        self._costs, self._now, self._chosen = costs, None, {}

    @property
    def reached(self) -> list[float]:
        return self.counts.reached

    @property
    def accepted(self) -> list[float]:
        return self.counts.kept

    def cost_scale(self, kind: str) -> float:
        """Measured over prior cost, for "draft" (a draft step), "eagle" (an EAGLE-3 head step) or
        "target" (a target call; 1 before any observation)."""
        total, count = self._ratios[kind]
        return total / count

    def costs_now(self) -> LoopCosts:
        """The prior's costs as the loop has measured them so far (see the module's docstring);
        asked several times an iteration, so kept until the next observation."""
        if self._now is None:
            work = {kind: total / count for kind, (total, count) in self._work.items()}
            self._now = self.costs.scaled(self.cost_scale("target"), self.cost_scale(DRAFT), work[1], work[0],
                                          self.cost_scale(EAGLE))
            self._chosen = {}
        return self._now

    def acceptance_by_position(self, gamma: int) -> list[float]:
        """P_k for k = 1..γ, as learned so far (Acceptance.by_position)."""
        return self.counts.by_position(gamma)

    def speedup(self, gamma: int) -> float:
        """Predicted speedup of γ over plain decoding, with acceptance and costs as learned so far."""
        if gamma == 0:
            return 1.0
        return self.costs_now().speedup(self.acceptance_by_position(gamma), gamma)

    def choose(self, allow_zero: bool = True) -> int:
        """The γ with the best predicted speedup (0: plain decoding, when speculation does not pay),
        unless the γ in use is within SWITCH_MARGIN of it. (Asked every iteration: the same until
        acceptance or costs move.)"""
        self.costs_now()  # recomputed costs forget the choices made with the old ones
        if allow_zero not in self._chosen:
            speedups = {g: self.speedup(g) for g in ([0] if allow_zero else []) + self.gammas}
            best = best_gamma(speedups)
            if self.current not in speedups or speedups[best] > speedups[self.current] * (1 + SWITCH_MARGIN):
                self.current = best
            self._chosen = {allow_zero: self.current}
        return self._chosen[allow_zero]

    def worth_running(self, offers: list[tuple[str, float, float]], batch: int | None = None,
                      committed: bool = False) -> list[bool]:
        """offers: one per row that may decode plainly, (its proposer's name, the offer's expected
        tokens per ms, the ms of an iteration that carries it), all at costs_now(). Whether each
        runs this iteration (False: the row decodes plainly): where it beats a plain step (by
        SWITCH_MARGIN to change from what its proposer did last) and the iteration as a whole beats
        one (`_batch_pays`), or where its proposer's probe is due. Rows of the same proposer are
        decided together: one probe serves them all. batch: the rows of the iteration (default: the
        offers'); committed: some other row speculates anyway (its γ is fixed), so the iteration
        pays for a verification whatever these rows do."""
        costs = self.costs_now()
        plain = 1.0 / costs.plain_ms
        verdicts, margins = [], []
        for kind, rate, _ in offers:
            margin = 1 - SWITCH_MARGIN if self.declined.get(kind, 0) == 0 else 1 + SWITCH_MARGIN
            verdicts.append(rate >= plain * margin)
            margins.append(margin)
        if not committed and not _batch_pays(offers, verdicts, margins, batch or len(offers), plain):
            verdicts = [False] * len(offers)
        worst = {kind: max(0.0, ms + self.switch_ms.get(kind, 0.0) - costs.plain_ms)
                 for (kind, _, ms), runs in zip(offers, verdicts) if not runs}
        for kind, loss in worst.items():
            self.probe_credit.setdefault(kind, loss if self.guessed_prior else 0.0)
        probing = {kind: loss for kind, loss in worst.items() if self.probe_credit[kind] >= loss}
        verdicts = [runs or kind in probing for (kind, _, _), runs in zip(offers, verdicts)]
        self._resumed, self._probing = set(), probing
        for kind, loss in probing.items():
            self.probe_credit[kind] -= loss  # charged as if it keeps nothing; observe_timing refunds what it gave
        for kind in {kind for kind, _, _ in offers}:
            ran = any(runs for (other, _, _), runs in zip(offers, verdicts) if other == kind)
            if ran and self.declined.get(kind, 0):
                self._resumed.add(kind)
            self.declined[kind] = 0 if ran else self.declined.get(kind, 0) + 1
            self._declined_at.pop(kind, None)
            if not ran:
                self._earn_probe_credit(kind, costs)
                self._declined_at[kind] = (costs, self.iterations, worst[kind])
        return verdicts

    def _earn_probe_credit(self, kind: str, costs: LoopCosts) -> None:
        """A declined iteration's PROBE_BUDGET of a plain step, shared by the proposers being declined
        (those whose offers have not run since their last decline), so that the probes of all of
        them together (auto's lookups and draft model) stay within the budget."""
        sharing = max(1, sum(1 for count in self.declined.values() if count > 0))
        self.probe_credit[kind] = self.probe_credit.get(kind, 0.0) + PROBE_BUDGET * costs.plain_ms / sharing

    def still_declined(self, kind: str) -> bool:
        """For a proposer whose offers follow this policy's acceptance (the draft model's, the same for
        every row): whether its offer would be declined again without being made, since it was
        declined last at the same costs and acceptance and its probe is not due yet. Such an
        iteration counts as declined. It spares a plain iteration the offer's work (on the tiny
        test models, whose steps take 0.2 ms, making and weighing it cost a tenth of a step)."""
        at = self._declined_at.get(kind)
        if at is None or at[0] is not self.costs_now() or at[1] != self.iterations or self.probe_credit[kind] >= at[2]:
            return False
        self.declined[kind] += 1
        self._earn_probe_credit(kind, at[0])
        return True

    def observe_timing(self, timing: Timing) -> None:
        """One iteration's measured times: they correct the costs of every γ and of plain decoding,
        and what a proposer that ran again after being declined paid to catch up counts in the cost
        of its next probe (the last such cost). Costs are running means that move slowly: costs_now()
        recomputes them every COSTS_EVERY observations (each iteration's plan asks for them)."""
        for kind in self._resumed:
            self.switch_ms[kind] = timing.catch_up_ms
        self._resumed = set()
        self._settle_probes(timing)
        prior = self.costs.verify[timing.gamma] if timing.gamma else self.costs.target_step
        self._add("target", timing.target_ms / prior)
        kind = timing.step_cost
        expected = self.costs.calls_ms(timing.gamma, timing.draft_steps, kind) if kind is not None else 0.0
        if timing.draft_steps and expected > 0:
            self._add(kind, timing.draft_ms / expected)
        work = self._work[min(timing.gamma, 1)]
        work[0] += max(0.0, timing.total_ms - timing.target_ms - timing.draft_ms)
        work[1] += 1
        self._since_costs += 1
        if self._since_costs >= COSTS_EVERY:
            self._now, self._since_costs = None, 0

    def _settle_probes(self, timing: Timing) -> None:
        """A probe was charged its worst loss: refund what it did not lose. Its loss is its iteration's time
        (catching up included) less what plain decoding takes for the tokens it gave each row, so a
        probe whose drafts were kept earns credit, and the next probe is due sooner (at once, for one
        that paid its way), up to PROBE_CREDIT_CAP probes' worth."""
        plain_ms = self.costs_now().plain_ms
        lost = timing.total_ms + timing.catch_up_ms - timing.tokens * plain_ms
        for kind, charged in self._probing.items():
            # never more than its worst loss as priced: a slow moment of the machine must not put off
            # the next probe, which would find a text that turned predictable later
            refunded = self.probe_credit[kind] + charged - min(lost, charged)
            self.probe_credit[kind] = min(refunded, PROBE_CREDIT_CAP * max(charged, PROBE_BUDGET * plain_ms))
        self._probing = {}

    def observe(self, gamma: int, accepted: int) -> None:
        """One iteration at `gamma` accepted `accepted` drafts: positions 1..min(accepted+1, γ) were reached."""
        self.iterations += 1
        self.counts.observe(gamma, accepted)
        self._chosen = {}

    def _add(self, kind: str, ratio: float) -> None:
        self._ratios[kind][0] += ratio
        self._ratios[kind][1] += 1


def _batch_pays(offers: list[tuple[str, float, float]], runs: list[bool], margins: list[float], batch: int,
                plain: float) -> bool:
    """Whether an iteration in which the `runs` offers draft beats a plain step of all `batch` rows.
    Each offer's rate prices the whole iteration (a verification of every row at its γ) against
    that one row's tokens, which is the iteration's rate only when every row drafts alike: where a
    few rows of a batch would draft, the batch pays for a verification and their drafts while the
    other rows gain nothing (demo pair with its EAGLE-3 head, batch 8: 2.6 of 8 rows drafting per
    verification ran at 0.70x plain decoding). The iteration's expected tokens are each running
    row's (rate x ms) and one for each other row, over the longest running offer's ms."""
    running = [(rate, ms, margin) for (_, rate, ms), run, margin in zip(offers, runs, margins) if run]
    if not running:
        return False
    tokens = sum(rate * ms for rate, ms, _ in running) + batch - len(running)
    return tokens / max(ms for _, ms, _ in running) >= batch * plain * min(margin for _, _, margin in running)


def probe_interval(iteration_ms: float, plain_ms: float) -> int:
    """Plain iterations between probes of a declined proposer, so that a probe keeping nothing
    (an iteration of `iteration_ms` that yields one token, as a plain step of `plain_ms` would)
    costs at most PROBE_BUDGET of the plain decoding around it."""
    return max(1, math.ceil(max(0.0, iteration_ms - plain_ms) / (PROBE_BUDGET * plain_ms)))


def best_gamma(speedups: dict[int, float]) -> int:
    """The γ of the best speedup; on a tie the shorter (less work wasted when drafts are rejected)."""
    return max(speedups, key=lambda g: (speedups[g], -g))


def _conditional(by_position: list[float], gamma: int) -> list[float]:
    """c_k = P_k / P_{k-1}, padded to γ positions by repeating the last ratio."""
    conditional, previous = [], 1.0
    for p in by_position[:gamma]:
        conditional.append(min(1.0, p / previous) if previous > 0 else 0.0)
        previous = p
    fill = conditional[-1] if conditional else 0.5
    return conditional + [fill] * (gamma - len(conditional))
