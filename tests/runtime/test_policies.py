"""The load's γ policies (runtime/policies.py): one per batch size, one draft-model acceptance."""

from speccompile.core.cost_model import LoopCosts
from speccompile.runtime.policies import LoadPolicies


def test_every_batch_size_s_policy_learns_the_one_acceptance_and_keeps_its_own_costs():
    """How often the draft model's drafts are kept does not depend on the batch size, what they cost
    does: a batch whose rows finish runs at each smaller size, and a policy that started each size
    from the prior had the draft model at a neutral prior again (demo pair with its EAGLE-3 head,
    batch 8: it ranked below the head, whose acceptance is the load's, and never drafted again).
    forget() takes both back to the prior."""
    policies = LoadPolicies(None, [2, 4], max_batch=8, max_seq=256)
    policies.calibration = LoopCosts(10.0, {2: 1.0, 4: 2.0}, {2: 11.0, 4: 12.0})
    eight = policies.policy_for(8, 16)
    prior = eight.acceptance_by_position(4)
    for _ in range(20):
        eight.observe(4, 4)
    seven = policies.policy_for(7, 16)
    assert seven is not eight and seven.costs != eight.costs
    assert seven.counts.observed[0] == 20 and seven.acceptance_by_position(4) == eight.acceptance_by_position(4)
    assert seven.acceptance_by_position(4)[3] > prior[3] + 0.3
    policies.forget()
    assert policies.policy_for(7, 16).acceptance_by_position(4) == prior
