"""core/tree.py: topologies, the tree acceptance references, candidates and compaction."""

import numpy as np
import pytest

from speccompile.core.acceptance import greedy_accept
from speccompile.core.tree import (
    TokenTree,
    best_tree,
    compaction,
    grow_tree,
    tree_accept,
    tree_candidates,
    typical_accept,
)

ACCURACY = [[0.6, 0.2, 0.1], [0.4, 0.2, 0.1], [0.3, 0.1, 0.05]]


def test_paths_are_numbered_breadth_first_with_parents_before_children():
    tree = TokenTree.from_paths([[0, 1], [1], [0], [0, 0], [0, 0, 0]])
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (0, 0, 0))
    np.testing.assert_array_equal(tree.parents, [0, 0, 0, 1, 1, 3])
    np.testing.assert_array_equal(tree.depths, [0, 1, 1, 2, 2, 3])
    np.testing.assert_array_equal(tree.ranks, [0, 0, 1, 0, 1, 0])
    assert tree.path_to(5) == [1, 3, 5] and tree.path_to(0) == []
    assert tree.ancestors[5].tolist() == [True, True, False, True, False, True]
    assert tree.nodes_within(1) == 2 and tree.nodes_within(2) == 4


def test_a_path_without_its_parent_is_refused():
    with pytest.raises(ValueError, match="no parent"):
        TokenTree.from_paths([[0], [1, 0]])


def test_grown_trees_are_the_most_likely_paths():
    tree = grow_tree(ACCURACY, 6)
    assert tree.paths == ((0,), (1,), (2,), (0, 0), (0, 1), (1, 0))  # 0.6, .2, .1, .24, .12, .08 (not .072)
    assert tree.expected_accepted(ACCURACY) == pytest.approx(0.6 + 0.2 + 0.1 + 0.24 + 0.12 + 0.08)
    assert all(tree.parents[i] < i for i in range(1, tree.size))  # so every prefix is a tree: rows verify prefixes
    assert grow_tree(ACCURACY, 100).size == 1 + 3 + 9 + 27  # no more paths than the heads have ranks


def test_the_best_size_trades_accepted_tokens_for_verification_cost():
    flat = {2: 1.0, 4: 1.0, 8: 1.0}  # free to verify: the biggest tree wins
    assert best_tree(ACCURACY, flat)[0].size == 8
    steep = {2: 1.0, 4: 1.6, 8: 4.0}
    tree, predictions = best_tree(ACCURACY, steep)
    assert tree.size == 2 and set(predictions) == {2, 4, 8}  # 1.6 tokens/ms at 2 nodes beats 2.0/1.6 and 2.3/4


def test_on_a_chain_the_tree_rule_is_the_chain_rule():
    rng = np.random.default_rng(0)
    chain = TokenTree.chain(4)
    for _ in range(50):
        target = rng.integers(0, 3, (3, 5))
        drafts = rng.integers(0, 3, (3, 4))
        draft_len = rng.integers(0, 5, 3)
        past = np.array([3, 7, 0])
        tokens = np.concatenate([np.zeros((3, 1), np.int64), drafts], axis=1)
        accepted, next_token, new_len, best = tree_accept(target, tokens, chain, past, draft_len)
        want = greedy_accept(target, drafts, past, draft_len)
        for got, expected in zip((accepted, next_token, new_len), want):
            np.testing.assert_array_equal(got, expected)
        np.testing.assert_array_equal(best, accepted)  # on a chain the node is its depth
        assert all(len(compaction(chain, b)[0]) == 0 for b in best)  # and nothing moves


def test_the_deepest_kept_path_wins_and_a_rejected_parent_cuts_its_children():
    tree = TokenTree.from_paths([[0], [1], [0, 0], [1, 0]])  # nodes: 1=(0) 2=(1) 3=(0,0) 4=(1,0)
    target = np.array([[7, 8, 9, 5, 6]])  # after root: 7; after node 1: 8; after node 2: 9
    tokens = np.array([[1, 4, 7, 8, 9]])  # node 1 is wrong (4 != 7), node 2 right, node 3 follows node 1
    accepted, next_token, new_len, best = tree_accept(target, tokens, tree, np.array([10]))
    assert (accepted[0], best[0], next_token[0], new_len[0]) == (2, 4, 6, 13)  # path 2 -> 4, then t_4 = 6
    sources, destinations = compaction(tree, 4)
    assert sources.tolist() == [2, 4] and destinations.tolist() == [1, 2]
    _, _, _, best = tree_accept(target, tokens, tree, np.array([10]), draft_len=np.array([3]))
    assert best[0] == 2  # node 4 is not verified: the path stops at node 2


def test_typical_acceptance_keeps_plausible_tokens_and_corrects_greedily():
    tree = TokenTree.chain(2)
    logits = np.log(np.array([[[0.5, 0.45, 0.05], [0.9, 0.05, 0.05], [0.1, 0.1, 0.8]]]))
    tokens = np.array([[0, 1, 0]])  # token 1 after the root: not the argmax, but p = 0.45 > 0.09
    accepted, next_token, _, _ = typical_accept(logits, tokens, tree, np.array([0]))
    assert accepted[0] == 2 and next_token[0] == 2
    assert tree_accept(logits.argmax(-1), tokens, tree, np.array([0]))[0][0] == 0  # greedy rejects it
    accepted, _, _, _ = typical_accept(logits, np.array([[0, 2, 0]]), tree, np.array([0]))
    assert accepted[0] == 0  # p = 0.05 < min(0.09, 0.3 exp(-H))


def test_candidates_follow_each_heads_ranking():
    tree = TokenTree.from_paths([[0], [1], [0, 0], [0, 1]])
    head_logits = np.array([[[0.1, 0.9, 0.5, 0.0], [0.7, 0.1, 0.2, 0.9]]])  # head 0: 1, 2; head 1: 3, 0
    np.testing.assert_array_equal(tree_candidates(np.array([5]), head_logits, tree), [[5, 1, 2, 3, 0]])


def test_measured_path_probabilities_replace_the_independence_estimate():
    measured = {(0,): 0.6, (0, 0): 0.45, (1,): 0.2}  # correlated heads: after a right head 0, head 1 is right 3/4
    assert TokenTree.chain(2).expected_accepted(ACCURACY, measured) == pytest.approx(0.6 + 0.45)
    assert TokenTree.chain(2).expected_accepted(ACCURACY) == pytest.approx(0.6 + 0.24)
    # unmeasured paths: the longest measured prefix times the later heads' rank accuracy
    assert TokenTree.chain(3).expected_accepted(ACCURACY, measured) == pytest.approx(0.6 + 0.45 + 0.45 * 0.3)
    grown = grow_tree(ACCURACY, 3, measured)
    assert grown.paths == ((0,), (1,), (0, 0))  # 0.45 beats (2,) at 0.1
    assert all(grown.parents[i] < i for i in range(1, grown.size))
