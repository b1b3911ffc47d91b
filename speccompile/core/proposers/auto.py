"""`auto`: per iteration and per request, the member whose offer has the better predicted rate,
tokens per millisecond (cost_model.tokens_per_ms): each member's expected tokens per iteration
(1 + Σ P_k, from that request's own acceptance at each draft position, learned as it runs, from a
prior) over its iteration time (draft steps, if it runs a model, + verification + the loop's own
work). Code and edits repeat their own text, and where they do a lookup is accepted as often as a
draft model, for nothing; elsewhere lookups find no match and the draft model drafts.

The model drafter is the baseline: a proposal that costs no model time replaces it when it promises
at least its rate, or, where the γ policy judged that the model should not draft (0 wanted), when
it promises more than a plain step.
"""

from speccompile.core.gamma_policy import GammaPolicy
from speccompile.core.proposers.base import Offer, Proposer


class Auto(Proposer):
    name = "auto"
    compares_costs = True  # it needs the load's costs (the γ policy's) whatever the request's γ

    def __init__(self, members: list[Proposer]):
        assert members, "auto needs at least one proposer to choose from"
        self.members = members
        self.runs_model = any(m.runs_model for m in members)

    def offer(self, request, wanted: int, cap: int, policy: GammaPolicy | None) -> Offer:
        model, free = None, []
        for member in self.members:
            offer = member.offer(request, wanted, cap, policy)
            if member.runs_model:
                model = offer
            elif offer.count > 0:
                free.append(offer)
        if not free:
            return model or Offer(0, self.members[0])
        costs = policy.costs if policy is not None else None
        best = free[0] if len(free) == 1 else max(free, key=lambda o: o.rate(costs))  # equals: members' order
        if model is None:
            return best
        if model.count == 0:  # the model would not draft: a free proposal against a plain step
            return best if best.rate(costs) > model.rate(costs) else model
        return best if best.rate(costs) >= model.rate(costs) else model

    def finish(self, request) -> None:
        for member in self.members:
            member.finish(request)
