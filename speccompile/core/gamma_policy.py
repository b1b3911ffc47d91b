"""Choosing γ: from a measured profile, then online as the acceptance estimate moves.

The policy keeps, per draft position k, counts of "reached k" and "accepted k". Their ratio is the
conditional acceptance c_k = P(d_k accepted | d_1..d_{k-1} accepted), and P_k = c_1 ... c_k is what
the cost model needs. The profile's calibration enters as pseudo-counts (a prior worth
`prior_weight` iterations), so the first iterations follow the profile and later ones the text at
hand. Positions beyond the γ in use are not observed and keep their prior.

Costs come from the profile: draft, verification and the loop's own work per iteration, measured
in loop runs at this batch size (runtime/profile.py), so the profile's table prints this policy's
own predictions and its γ* is this policy's first choice. They are learned too: the machine may be
busier than when it was profiled, and a quick calibration without a profile times steps outside the
loop. So every iteration's measured draft and verification times update one correction factor
each (the mean ratio of measured to profiled, with a prior of `COST_PRIOR_WEIGHT` iterations at 1),
applied to every γ's costs alike: the γ in use teaches the policy about the others.

Once a γ is in use, another must promise `SWITCH_MARGIN` more speedup to replace it. Each compiled γ
is its own verification graph, and on a CPU each ONNX Runtime session holds its own packed copy of
the target's weights: a verification right after another γ's finds its weights evicted from cache
(demo pair, 2 cores: a γ=4 verification after γ=2 and γ=6 ones took 4.6 ms instead of 2.3). Without
the margin, estimates hovering near a tie flip γ every few iterations and pay that each time.
"""

from dataclasses import dataclass, field

from speccompile.core.cost_model import LoopCosts

SWITCH_MARGIN = 0.05
COST_PRIOR_WEIGHT = 4.0


@dataclass
class Acceptance:
    """Per draft position k, how often position k was reached and its draft kept: observed
    iterations on top of a prior worth `weight` iterations at the conditional rates `prior` (its
    last rate for positions beyond it). What the γ policy learns, and each request per proposer."""

    prior: list[float]
    weight: float
    reached: list[float] = field(default_factory=list)
    kept: list[float] = field(default_factory=list)
    observed: list[int] = field(default_factory=list)  # iterations (not the prior's) that reached k

    def __post_init__(self):
        self._cover(len(self.prior) - 1)

    def prior_at(self, k: int) -> float:
        return self.prior[min(k, len(self.prior) - 1)]

    def observe(self, drafts: int, accepted: int) -> None:
        """One iteration: `drafts` proposed, the first `accepted` kept (positions 1..accepted+1 reached)."""
        for k in range(min(accepted + 1, drafts)):
            self._cover(k)
            self.reached[k] += 1
            self.kept[k] += k < accepted
            self.observed[k] += 1

    def conditional(self, k: int) -> float:
        """P(draft k+1 kept | drafts 1..k kept), index k from 0."""
        return self.kept[k] / self.reached[k] if k < len(self.reached) else self.prior_at(k)

    def by_position(self, drafts: int) -> list[float]:
        """P_1..P_drafts (unconditional): the products of the conditional rates."""
        out, running = [], 1.0
        for k in range(drafts):
            running *= self.conditional(k)
            out.append(running)
        return out

    def _cover(self, k: int) -> None:
        while len(self.reached) <= k:
            self.reached.append(self.weight)
            self.kept.append(self.weight * self.prior_at(len(self.kept)))
            self.observed.append(0)


class GammaPolicy:
    def __init__(self, costs: LoopCosts, prior_by_position: list[float], prior_weight: float = 8.0):
        """costs: the loop's at this batch size and context (a profile's, or a quick calibration's)."""
        self.costs = costs
        self.gammas = self.costs.gammas
        self.prior = _conditional(prior_by_position, max(self.gammas))
        self.counts = Acceptance(self.prior, prior_weight)
        self.iterations = 0  # observed so far
        self.current: int | None = None  # the γ chosen last
        self._ratios = {kind: [COST_PRIOR_WEIGHT, COST_PRIOR_WEIGHT] for kind in ("draft", "verify")}  # [sum, count]

    @property
    def reached(self) -> list[float]:
        return self.counts.reached

    @property
    def accepted(self) -> list[float]:
        return self.counts.kept

    def cost_scale(self, kind: str) -> float:
        """Measured over profiled cost, for "draft" or "verify" (1 before any observation)."""
        total, count = self._ratios[kind]
        return total / count

    def acceptance_by_position(self, gamma: int) -> list[float]:
        """P_k for k = 1..γ. A position not reached so far keeps the prior's conditional rate,
        scaled by how the deepest reached position compares with its own prior: the text at hand
        sets the level, the prior the decline. Without that, a policy running at a short γ under
        a pessimistic prior would never see that a longer one pays."""
        by_position, running, level = [], 1.0, 1.0
        for k in range(gamma):
            if self.counts.observed[k]:
                conditional = self.counts.conditional(k)
                level = conditional / self.prior[k] if self.prior[k] > 0 else 1.0
            else:
                conditional = min(1.0, self.prior[k] * level)
            running *= conditional
            by_position.append(running)
        return by_position

    def speedup(self, gamma: int) -> float:
        """Predicted speedup of γ over plain decoding, with acceptance and costs as learned so far."""
        if gamma == 0:
            return 1.0
        return self.costs.speedup(self.acceptance_by_position(gamma), gamma, self.cost_scale("draft"),
                                  self.cost_scale("verify"))

    def choose(self, allow_zero: bool = True) -> int:
        """The γ with the best predicted speedup (0: plain decoding, when speculation does not pay),
        unless the γ in use is within SWITCH_MARGIN of it."""
        speedups = {g: self.speedup(g) for g in ([0] if allow_zero else []) + self.gammas}
        best = best_gamma(speedups)
        if self.current in speedups and speedups[best] <= speedups[self.current] * (1 + SWITCH_MARGIN):
            return self.current
        self.current = best
        return best

    def observe_costs(self, gamma: int, draft_ms: float, verify_ms: float) -> None:
        """One iteration's measured time in its γ draft steps and in its verification."""
        profiled = {"draft": self.costs.draft[gamma], "verify": self.costs.verify[gamma]}
        for kind, measured in (("draft", draft_ms), ("verify", verify_ms)):
            if profiled[kind] > 0:
                self._ratios[kind][0] += measured / profiled[kind]
                self._ratios[kind][1] += 1

    def observe(self, gamma: int, accepted: int) -> None:
        """One iteration at `gamma` accepted `accepted` drafts: positions 1..min(accepted+1, γ) were reached."""
        self.iterations += 1
        self.counts.observe(gamma, accepted)


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
