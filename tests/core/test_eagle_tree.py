"""EAGLE-2's dynamic tree drafting (core/proposers/eagle_tree.py) over a scripted head: the tree
keeps the best-scored nodes, and expansions none of whose children could be kept are not run."""

import numpy as np
import pytest

from speccompile.core.proposers.eagle_tree import TreeShape, _can_enter, _Node, _tree_of, draft_tree

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

    monkeypatch.setattr(module, "_can_enter", lambda nodes, frontier, count: True)
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
    tree, tokens = draft_tree(ScriptedRunner(head, first), None, shape)
    tree_all, tokens_all = unpruned(ScriptedRunner(reference, first), shape, monkeypatch)
    assert tree.paths == tree_all.paths and tokens.tolist() == tokens_all.tolist()
    assert reference.calls == shape.depth - 1 and head.calls == calls


def test_a_child_tying_the_last_kept_node_loses_to_it():
    nodes = [_Node(1, -1, 1, -1.0, 0), _Node(2, -1, 1, -2.0, 1)]
    assert not _can_enter(nodes, [1], count=2)  # its children score at most -2.0: the kept node wins ties
    assert _can_enter(nodes, [0], count=2)
    assert _can_enter(nodes, [1], count=3)  # room left: anything enters
    tree, tokens = _tree_of(nodes + [_Node(3, 1, 2, -2.0, 0)], 2)
    assert tokens.tolist() == [1, 2]
