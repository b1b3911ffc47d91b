"""`auto`: per iteration and per request, the member whose offer has the better predicted rate,
tokens per millisecond (cost_model.tokens_per_ms): each member's expected tokens per iteration
(1 + Σ P_k, from that request's own acceptance at each draft position, learned as it runs, from a
prior) over its iteration time (draft steps, if it runs a model, + verification + the loop's own
work), at the costs the load's γ policy has measured. Code and edits repeat their own text, and
where they do a lookup is accepted as often as a draft model, for nothing; elsewhere lookups find no
match and the draft model drafts.

Where two models may draft (a draft model and an EAGLE-3 head), each is tried first: a model the
load has not seen draft EXPLORE_ITERATIONS times, whose offer beats a plain step, is the one model
offered (the least seen first). Expectations start from priors, and the model ranked first would
otherwise be the only one ever measured: on the demo pair the head, whose prior is above the draft
model's neutral one, drafted every request though it drafts slower (0.82x the same call without
it), or, after an unlucky first iteration (2 of 10 kept), never again.

After that, the model ranked second drafts again now and then: a few iterations are a small sample
(demo pair, default call on the bundle with a head: the draft model kept 5 of its first 8 drafts,
ranked below the head, and never drafted again, at 0.76x the same call without the head). Its turns
grow as the square root of the first's (_owed_a_turn): a ranking made on a few iterations is checked
soon, and a settled one costs less and less. A fixed share of one turn in nine had the head draft 33-40
of 246 iterations of 16 requests, each turn on a new request reading that request's whole context
into the head first (a third of the target's prefill cost per position on the demo pair).

Whether the chosen offer beats plain decoding is the scheduler's question for every proposer alike
(Scheduler._against_plain, GammaPolicy.worth_running): `auto` only ranks its members.
"""

from speccompile.core.gamma_policy import GammaPolicy
from speccompile.core.proposers.base import Offer, Proposer

EXPLORE_ITERATIONS = 4  # iterations each model drafts at a load before auto ranks it by what it measured
RETRY_SHARE = 8  # then the model ranked second drafts once the first has drafted this many times as often,
# a share that shrinks as the second's turns add up (_owed_a_turn)


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
        rates = {id(offer): offer.rate(costs) for offer in drafting}  # each priced once: asked per row and iteration
        drafting = self._exploring(drafting, rates, request, policy, costs)
        return max(drafting, key=lambda o: rates[id(o)])  # on a tie the first: free proposers come first

    @staticmethod
    def _exploring(drafting: list[Offer], rates: dict[int, float], request, policy: GammaPolicy | None,
                   costs) -> list[Offer]:
        """The offers to rank: where two models offer drafts and one of them has not been seen drafting
        EXPLORE_ITERATIONS times at this load, only the least seen of those among the models; where the
        model ranked second by rate is owed a turn (_owed_a_turn), only it among the models. Either
        only if it is no worse a bet than the model auto would draft with otherwise: its offer beats
        a plain step, or the best model's does not either (in a batch, rows drafting for free can carry
        a row's drafts that do not pay alone: on the demo pair at batch 8 the head, ranked first on its
        prior, drafted every batch and the draft model was never tried, 0.86x the call without the head)."""
        models = [offer for offer in drafting if offer.source.runs_model]
        if len(models) < 2:
            return drafting
        plain = 1.0 / costs.plain_ms if costs is not None else 0.0
        best_pays = max(rates[id(offer)] for offer in models) >= plain

        def worth_trying(offer: Offer) -> bool:
            return rates[id(offer)] >= plain or not best_pays

        seen = {id(offer): offer.source.observed(request, policy) for offer in models}
        unseen = [offer for offer in models if seen[id(offer)] < EXPLORE_ITERATIONS and worth_trying(offer)]
        if unseen:
            trying = min(unseen, key=lambda offer: seen[id(offer)])
        else:
            first, second = sorted(models, key=lambda offer: rates[id(offer)], reverse=True)[:2]
            if not _owed_a_turn(seen[id(first)], seen[id(second)]) or not worth_trying(second):
                return drafting
            trying = second
        return [offer for offer in drafting if not offer.source.runs_model or offer is trying]

    def finish(self, request) -> None:
        for member in self.members:
            member.finish(request)


def _owed_a_turn(first_seen: int, second_seen: int) -> bool:
    """Whether the model ranked second drafts next: once the first has drafted RETRY_SHARE x
    (second_seen / EXPLORE_ITERATIONS) times as often as it, so that its turns grow as the square root
    of the first's (after its 4 exploring turns: at the first's 33rd iteration, then its 51st, 73rd,
    99th, 129th...)."""
    return first_seen * EXPLORE_ITERATIONS > RETRY_SHARE * second_seen * second_seen
