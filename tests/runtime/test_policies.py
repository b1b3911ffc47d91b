"""The load's γ policies (runtime/policies.py): one per batch size, one draft-model acceptance."""

from speccompile.core.cost_model import LoopCosts
from speccompile.runtime.gamma_profile import KeptDrafts
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


# a low-bit target's costs: a verification of 5 tokens 2.5 plain steps, four draft steps 0.8
LOW_BIT = LoopCosts(10.0, {4: 8.0}, {4: 25.0})


def low_bit_policy(kept: tuple[int, ...] | None):
    """The batch-1 policy of a load without a profile whose calibration's iterations at γ=4 kept
    `kept` drafts each (None: it had no draft model to run)."""
    policies = LoadPolicies(None, [4], max_batch=1, max_seq=256)
    policies.calibration = LOW_BIT
    policies.calibrated_acceptance = None if kept is None else KeptDrafts(4, kept)
    return policies.policy_for(1, 16)


def test_without_a_profile_the_calibration_s_iterations_are_the_acceptance_prior():
    """The guess (half of each position's drafts kept) declines γ=4 at a low-bit target's costs and
    leaves it to the first probe; the calibration's iterations decide instead, worth as many
    iterations as they were: a draft that kept everything speculates from the first iteration, one
    that kept nothing is declined without a free probe."""
    guessed = low_bit_policy(None)
    assert guessed.guessed_prior and guessed.choose() == 0
    agrees = low_bit_policy((4,) * 8)
    assert not agrees.guessed_prior and agrees.counts.weight == 8.0
    assert agrees.choose() == 4 and agrees.speedup(4) > 1.1
    never = low_bit_policy((0,) * 8)
    assert not never.guessed_prior and never.choose() == 0 and never.acceptance_by_position(1)[0] < 0.2
    assert low_bit_policy(()).guessed_prior  # no iteration ran: the guess
