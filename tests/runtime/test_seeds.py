"""A seeded request's tokens depend on its prompt, seed and sampling parameters only: not on γ, the
proposer, or the requests beside it (the coupled rule, core/acceptance.py and core/request.py).

These fail under the rejection rule: there the draws are consumed per draft, so a γ chosen by load,
or another proposer, changes the tokens."""

import random
import time

import pytest

import speccompile
from tests.conftest import FAMILIES

PROMPT = [5, 17, 33, 2, 9]
SAMPLED = dict(max_new_tokens=24, temperature=0.9, seed=1234)


def company(runtime, rng: random.Random, count: int) -> list:
    """`count` other requests arriving at random moments, sampled and greedy, each its own γ."""
    handles = []
    for i in range(count):
        prompt = [rng.randrange(3, 250) for _ in range(rng.randint(1, 12))]
        handles.append(runtime.submit(prompt, max_new_tokens=rng.randint(4, 30), temperature=rng.choice([0.0, 0.7]),
                                      seed=i, gamma=rng.choice([None, 1, 4, "auto"])))
        time.sleep(rng.random() * 0.01)
    return handles


@pytest.mark.parametrize("family", FAMILIES)
def test_a_seeded_request_at_the_default_gamma_gives_the_same_tokens_alone_and_in_company(family, bundles):
    with speccompile.load(bundles(family, "random")) as runtime:
        alone = runtime.submit(PROMPT, **SAMPLED).result(timeout=60).token_ids
        for trial in range(3):
            rng = random.Random(trial)
            before = company(runtime, rng, rng.randint(3, 8))
            crowded = runtime.submit(PROMPT, **SAMPLED)
            after = company(runtime, rng, rng.randint(0, 3))
            assert crowded.result(timeout=60).token_ids == alone, trial
            for handle in before + after:
                handle.result(timeout=60)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_seeded_speculative_sample_is_the_seeded_autoregressive_sample(family, bundles):
    """Whatever proposes and however many drafts an iteration carries, the tokens are those of the
    target sampling alone with the same seed."""
    with speccompile.load(bundles(family, "random")) as runtime:
        plain = runtime.generate([PROMPT], mode="autoregressive", **SAMPLED)[0].token_ids
        for proposer in ("draft", "ngram", "suffix", "auto"):
            for gamma in (1, 4, "auto"):
                got = runtime.generate([PROMPT], proposer=proposer, gamma=gamma, **SAMPLED)[0]
                assert got.token_ids == plain, (proposer, gamma)
        assert runtime.generate([PROMPT], mode="autoregressive", **{**SAMPLED, "seed": 99})[0].token_ids != plain


def test_the_rejection_rule_depends_on_gamma(bundles):
    """Why the coupled rule is the default: under rejection sampling the same seed gives other tokens
    at another γ (the draws are consumed per draft)."""
    with speccompile.load(bundles("llama", "random")) as runtime:
        tokens = {gamma: runtime.generate([PROMPT], gamma=gamma, sampling_rule="rejection", **SAMPLED)[0].token_ids
                  for gamma in (1, 4)}
    assert tokens[1] != tokens[4]


def test_a_seed_chooses_the_coupled_rule_and_no_seed_rejection_sampling(bundles):
    with speccompile.load(bundles("llama", "random")) as runtime:
        seeded = runtime.submit(PROMPT, max_new_tokens=4, temperature=0.9, seed=3)
        unseeded = runtime.submit(PROMPT, max_new_tokens=4, temperature=0.9)
        chosen = runtime.submit(PROMPT, max_new_tokens=4, temperature=0.9, seed=3, sampling_rule="rejection")
        assert (seeded.request.coupled, unseeded.request.coupled, chosen.request.coupled) == (True, False, False)
        for handle in (seeded, unseeded, chosen):
            handle.result(timeout=60)
        with pytest.raises(speccompile.SpecCompileError, match="sampling_rule must be one of"):
            runtime.submit(PROMPT, temperature=0.9, sampling_rule="gumbel")
