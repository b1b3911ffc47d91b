"""The numpy reference of the greedy acceptance rule, on hand-worked cases."""

import numpy as np

from speccompile.core.acceptance import greedy_accept


def run(target_tokens, draft_tokens, past_len):
    return greedy_accept(np.array(target_tokens), np.array(draft_tokens), np.array(past_len))


def test_all_accepted_takes_the_bonus_token():
    accepted, next_token, new_len = run([[5, 6, 7, 8]], [[5, 6, 7]], [10])
    assert accepted.tolist() == [3]
    assert next_token.tolist() == [8]  # the target's choice after d_3: free
    assert new_len.tolist() == [14]  # last + 3 drafts stay cached


def test_none_accepted_takes_the_correction():
    accepted, next_token, new_len = run([[5, 6, 7, 8]], [[9, 6, 7]], [10])
    assert accepted.tolist() == [0]
    assert next_token.tolist() == [5]
    assert new_len.tolist() == [11]  # only `last` stays cached


def test_acceptance_stops_at_first_mismatch_even_if_later_drafts_match():
    accepted, next_token, _ = run([[5, 6, 7, 8]], [[5, 0, 7]], [0])
    assert accepted.tolist() == [1]
    assert next_token.tolist() == [6]


def test_mixed_batch_each_row_independent():
    target = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
    drafts = [[1, 2, 3], [9, 2, 3], [1, 2, 9]]
    accepted, next_token, new_len = run(target, drafts, [3, 7, 0])
    assert accepted.tolist() == [3, 0, 2]
    assert next_token.tolist() == [4, 1, 3]
    assert new_len.tolist() == [7, 8, 3]


def test_gamma_one():
    accepted, next_token, new_len = run([[4, 2], [4, 2]], [[4], [3]], [5, 5])
    assert accepted.tolist() == [1, 0]
    assert next_token.tolist() == [2, 4]
    assert new_len.tolist() == [7, 6]
