"""EAGLE-2's dynamic tree drafting (core/proposers/eagle_tree.py) over a scripted head: the tree
keeps the best-scored nodes, and expansions none of whose children could be kept are not run."""

import time
from dataclasses import replace

import numpy as np
import pytest

from speccompile.core.proposers.eagle_tree import (
    TreeEconomy,
    TreeShape,
    TreeSizing,
    _can_enter,
    _Node,
    _tree_of,
    draft_tree,
)

VOCAB = 50


class ScriptedHead:
    """tree_step's top tokens and log-probabilities as a fixed function of the node's token: a node
    of token t proposes t + 1, t + 2, ... with log-probabilities `steepness` x (1, 2, ...)."""

    def __init__(self, steepness: float):
        self.steepness, self.calls = steepness, 0

    def tree_step(self, tokens, hidden, positions, visible, first=0):
        self.calls += 1
        k = 4
        top = (tokens[..., None] + 1 + np.arange(k)) % VOCAB
        logprobs = np.broadcast_to(-self.steepness * (1 + np.arange(k, dtype=np.float32)), top.shape)
        return top, logprobs.copy(), np.zeros((*tokens.shape, 2), dtype=np.float32)


class ScriptedRunner:
    def __init__(self, head: ScriptedHead, first_logprobs: list[float]):
        self.engine, self.first = head, first_logprobs
        self.read_to, self.hidden = np.array([7]), np.zeros((1, 2), dtype=np.float32)

    def read_for_tree(self, request, slot):
        return np.arange(1, 1 + len(self.first)), np.array(self.first, dtype=np.float32)


def unpruned(runner, shape: TreeShape, monkeypatch):
    import speccompile.core.proposers.eagle_tree as module

    monkeypatch.setattr(module, "_can_enter", lambda scores, best, count: True)
    try:
        return draft_tree(runner, None, shape)
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("shape, steepness, first, calls", [
    # a steep head: the first level's three nodes and one child beat anything deeper
    (TreeShape(depth=5, width=2, children=3, nodes=4), 3.0, [-0.1, -0.2, -0.3], 1),
    # a flat head fills the tree with shallow siblings: two levels below the first, not four
    (TreeShape(depth=5, width=2, children=3, nodes=4), 0.01, [-0.01, -2.0, -3.0], 2),
    # a chain of 4 nodes drafted to depth 5: the fourth expansion's child is never kept
    (TreeShape(depth=5, width=1, children=1, nodes=4), 0.01, [-0.01], 3),
    # a confident head and room for a deep tree: every expansion runs
    (TreeShape(depth=5, width=1, children=2, nodes=8), 0.01, [-0.01, -5.0], 4),
])
def test_expansions_that_cannot_change_the_tree_are_not_run_and_the_tree_is_the_same(shape, steepness, first, calls,
                                                                                   monkeypatch):
    head, reference = ScriptedHead(steepness), ScriptedHead(steepness)
    tree, tokens, _ = draft_tree(ScriptedRunner(head, first), None, shape)
    tree_all, tokens_all, _ = unpruned(ScriptedRunner(reference, first), shape, monkeypatch)
    assert tree.paths == tree_all.paths and tokens.tolist() == tokens_all.tolist()
    assert reference.calls == shape.depth - 1 and head.calls == calls


def test_a_child_tying_the_last_kept_node_loses_to_it():
    nodes = [_Node(1, -1, 1, -1.0, 0), _Node(2, -1, 1, -2.0, 1)]
    scores = np.array([-1.0, -2.0])
    assert not _can_enter(scores, -2.0, count=2)  # its children score at most -2.0: the kept node wins ties
    assert _can_enter(scores, -1.0, count=2)
    assert _can_enter(scores, -2.0, count=3)  # room left: anything enters
    tree, tokens = _tree_of(nodes + [_Node(3, 1, 2, -2.0, 0)], 2)
    assert tokens.tolist() == [1, 2]


def sizing(per_token_ms: float, scale: float = 1.0) -> TreeSizing:
    return TreeSizing((per_token_ms, 4.0), 0.0, 0.0, scale, time.perf_counter())


def test_a_node_is_verified_where_the_tokens_it_is_expected_to_add_pay_for_its_verification():
    scores = np.log([0.9, 0.8, 0.5, 0.3, 0.1, 0.05, 0.02])
    assert sizing(0.0).count(scores) == len(scores)  # verification free per token (a GPU): every node
    # 0.25 ms a token on a 4 ms call: a node pays where its chance beats the rate times 0.25 ms
    count = sizing(0.25).count(scores)
    rates = [(1 + np.exp(scores[:n]).sum()) / (4.0 + 0.25 * (n + 1)) for n in range(1, len(scores) + 1)]
    assert count == int(np.argmax(rates)) + 1 == 4
    assert sizing(0.25, scale=0.2).count(scores) < count  # drafts kept less often than scored: fewer nodes
    assert sizing(50.0).count(scores) == 1  # at least one


def test_an_expansion_is_skipped_where_even_its_best_child_would_not_pay():
    scores = np.log([0.9, 0.8, 0.5])
    assert sizing(0.25).expands(np.log(0.5), scores)
    assert not sizing(0.25).expands(np.log(0.01), scores)
    assert sizing(0.0).expands(np.log(0.01), scores)  # free verification: anything may pay


def test_sized_drafting_keeps_the_best_nodes_of_the_full_tree(monkeypatch):
    shape = TreeShape(depth=5, width=2, children=3, nodes=12)
    first = [-0.1, -1.5, -3.0]
    head = ScriptedHead(0.7)
    tree, tokens, expected = draft_tree(ScriptedRunner(head, first), None, shape, sizing=sizing(0.25))
    assert 1 <= len(tokens) < shape.nodes and head.calls < shape.depth - 1 and expected > 0
    best, best_tokens, _ = unpruned(ScriptedRunner(ScriptedHead(0.7), first), replace(shape, nodes=len(tokens)),
                                    monkeypatch)  # the same number of best nodes of every expansion
    assert tree.paths == best.paths and tokens.tolist() == best_tokens.tolist()


def test_the_economy_learns_how_often_scored_drafts_are_kept_and_what_trees_cost():
    economy = TreeEconomy()
    assert economy.scale == 1.0 and economy.extra_ms == 0.0
    for _ in range(300):
        economy.observe(expected=3.0, kept=1, verify_ms=6.0, predicted_ms=5.5)
    # the priors stay mixed in, as a few trees' worth against the horizon's 64
    assert economy.scale == pytest.approx(1 / 3, rel=0.1) and economy.extra_ms == pytest.approx(0.5, rel=0.05)


def test_the_faster_of_tree_and_chain_drafts_and_the_other_is_tried_now_and_then():
    economy = TreeEconomy()
    assert economy.tree_turn()  # a tree first,
    economy.observe_rate(True, tokens=3, ms=10.0)
    assert not economy.tree_turn()  # then the chain, once
    economy.observe_rate(False, tokens=3, ms=6.0)
    turns = [economy.tree_turn() for _ in range(4 * TreeEconomy.EXPLORE_EVERY)]
    assert sum(turns) == 4  # the chain pays more: a tree once every EXPLORE_EVERY iterations
    for _ in range(200):  # the text turns: trees now pay more
        economy.observe_rate(True, tokens=5, ms=8.0)
    turns = [economy.tree_turn() for _ in range(4 * TreeEconomy.EXPLORE_EVERY)]
    assert len(turns) - sum(turns) == 4
