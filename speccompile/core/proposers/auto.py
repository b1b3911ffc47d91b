"""`auto`: per iteration and per request, the member whose offer has the better predicted rate,
tokens per millisecond (cost_model.tokens_per_ms): each member's expected tokens per iteration
(1 + Σ P_k, from that request's own acceptance at each draft position, learned as it runs, from a
prior) over its iteration time (draft steps, if it runs a model, + verification + the loop's own
work), at the costs the load's γ policy has measured. Code and edits repeat their own text, and
where they do a lookup is accepted as often as a draft model, for nothing; elsewhere lookups find no
match and the draft model drafts.

Whether the chosen offer beats plain decoding is the scheduler's question for every proposer alike
(Scheduler._against_plain, GammaPolicy.worth_running): `auto` only ranks its members.
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
        offers = [member.offer(request, wanted, cap, policy) for member in self.members]
        drafting = [offer for offer in offers if offer.count > 0]
        if len(drafting) < 2:
            return drafting[0] if drafting else Offer(0, self.members[0])
        costs = policy.costs_now() if policy is not None else None
        return max(drafting, key=lambda o: o.rate(costs))  # on a tie the first: free proposers come first

    def finish(self, request) -> None:
        for member in self.members:
            member.finish(request)
