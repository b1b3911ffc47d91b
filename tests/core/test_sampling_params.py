"""Sampling controls: which settings can change a token."""

import pytest

from speccompile.core.sampling import SamplingParams


@pytest.mark.parametrize("params, inert", [
    (SamplingParams(0.0, 5, 1.0), ["top_k=5"]),
    (SamplingParams(0.0, 0, 0.9), ["top_p=0.9"]),
    (SamplingParams(0.0, 5, 0.9), ["top_k=5", "top_p=0.9"]),
    (SamplingParams(0.0, 0, 1.0), []),  # the defaults are off, not set
    (SamplingParams(0.7, 5, 0.9), []),  # sampling: both shape the distribution
])
def test_top_k_and_top_p_have_no_effect_on_greedy_decoding(params, inert):
    assert params.without_effect() == inert
