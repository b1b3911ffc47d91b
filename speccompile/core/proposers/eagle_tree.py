"""EAGLE-2's dynamic token tree over an EAGLE-3 head (Li et al. 2024, "EAGLE-2: Faster Inference of
Language Models with Dynamic Draft Trees"): proposer "eagle_tree".

A chain verifies the head's single best continuation; a tree verifies several in the same target
pass, so a position where the head's best guess is wrong can still be kept through its second or
third. EAGLE-2 grows the tree where the head is confident: a node's score is its cumulative draft
log-probability (the sum over its path), which the authors show tracks how often a node is accepted.

  1. The head's catch-up reads the target's features up to the last token; its best tokens there are
     the tree's first level (`children` of them, each scored by its log-probability).
  2. Expansion, depth - 1 times: the `width` best-scored nodes of the newest level run through the
     head in one call (each with its parent's output and its own token, at its depth's position,
     attending to the prefix and its ancestors), and each adds its `children` best tokens, scored
     by its score plus their log-probability, as the next level.
     An expansion none of whose children could be chosen in step 3 is not run (nor any after it).
  3. Reranking: the `nodes` best-scored nodes of all levels form the tree. A child scores at most
     its parent (log-probabilities are <= 0; ties go to the shallower), so the choice holds every
     chosen node's ancestors.

The target verifies the tree in one pass (its topology an input: core/tree.py's TokenTree, ranks
being each node's place among its parent's children) by the greedy tree rule, which keeps exactly
the target's greedy output; the head then reads the features of the root and the accepted path.

Where: one greedy request decoding alone (batch 1), without a grammar or log-probabilities, on a
bundle whose head has the tree's graphs and whose target runs its own graph per call (not one
session graph). Elsewhere the proposer drafts the head's chain, as `eagle` does.
"""

from dataclasses import dataclass

import numpy as np

from speccompile.core.proposers.eagle import EagleDraft, EagleRunner
from speccompile.core.tree import TokenTree


@dataclass(frozen=True)
class TreeShape:
    depth: int = 5  # the deepest level verified (depth - 1 head calls after the catch-up)
    width: int = 3  # nodes of a level expanded by the next head call
    children: int = 3  # candidates each expanded node adds (its best tokens)
    nodes: int = 12  # nodes verified, the root excluded

    @property
    def head_positions(self) -> int:
        """Cache positions the head writes past its prefix while drafting one tree."""
        return (self.depth - 1) * self.width


@dataclass
class _Node:
    token: int
    parent: int  # index into the node list; -1: the root (the last token)
    depth: int
    score: float  # cumulative draft log-probability
    rank: int  # its place among its parent's candidates
    written: int = -1  # where its head output sits past the prefix (-1: never expanded)


def draft_tree(runner: EagleRunner, request, shape: TreeShape, slot: int = 0) -> tuple[TokenTree, np.ndarray] | None:
    """The dynamic tree after the request's last token: (its topology, its non-root nodes' tokens in
    the topology's order); None where the head cannot draft one (out of step, nothing to read)."""
    first = runner.read_for_tree(request, slot)
    if first is None:
        return None
    top_ids, top_logprobs = first
    prefix = int(runner.read_to[slot])
    nodes = [_Node(int(t), -1, 1, float(lp), rank) for rank, (t, lp) in
             enumerate(zip(top_ids[: shape.children], top_logprobs[: shape.children]))]
    level, written, outputs = list(range(len(nodes))), 0, {-1: runner.hidden[slot]}
    for depth in range(1, shape.depth):
        frontier = sorted(level, key=lambda i: -nodes[i].score)[: shape.width]
        if not _can_enter(nodes, frontier, shape.nodes):
            break
        tokens = np.array([[nodes[i].token for i in frontier]], dtype=np.int64)
        hidden = np.stack([outputs[nodes[i].parent] for i in frontier])[None]
        positions = np.full((1, len(frontier)), prefix + depth - 1, dtype=np.int64)
        visible = _visible(nodes, frontier, prefix, written)
        top_ids, top_logprobs, out = runner.engine.tree_step(tokens, hidden, positions, visible, first=slot)
        level = []
        for j, i in enumerate(frontier):
            nodes[i].written, outputs[i] = written + j, out[0, j]
            for rank in range(shape.children):
                level.append(len(nodes))
                nodes.append(_Node(int(top_ids[0, j, rank]), i, depth + 1,
                                   nodes[i].score + float(top_logprobs[0, j, rank]), rank))
        written += len(frontier)
    return _tree_of(nodes, shape.nodes)


def _can_enter(nodes: list[_Node], frontier: list[int], count: int) -> bool:
    """Whether a child of the frontier could be among the `count` best-scored nodes: a child scores at
    most its parent, and loses a tie to every node drafted so far (all shallower), so where the best
    frontier node scores no more than the count-th best node so far, neither it nor any descendant
    is chosen and the expansions left would cost head calls for nothing. The tree is the same."""
    if len(nodes) < count:
        return True
    kept = sorted((node.score for node in nodes), reverse=True)[count - 1]
    return max(nodes[i].score for i in frontier) > kept


def _visible(nodes: list[_Node], frontier: list[int], prefix: int, written: int) -> np.ndarray:
    """[1, T, prefix + written + T]: node t of the frontier sees the prefix, its ancestors' outputs
    (written past the prefix in expansion order) and its own (written now, at written + t)."""
    visible = np.zeros((1, len(frontier), prefix + written + len(frontier)), dtype=bool)
    visible[0, :, :prefix] = True
    for t, i in enumerate(frontier):
        visible[0, t, prefix + written + t] = True
        parent = nodes[i].parent
        while parent >= 0:
            visible[0, t, prefix + nodes[parent].written] = True
            parent = nodes[parent].parent
    return visible


def _tree_of(nodes: list[_Node], count: int) -> tuple[TokenTree, np.ndarray]:
    """The `count` best-scored nodes (ties: the shallower, then the earlier) as a TokenTree of paths of
    ranks, and their tokens in its order."""
    chosen = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, nodes[i].depth, i))[:count]
    paths = {}
    for i in sorted(chosen, key=lambda i: nodes[i].depth):
        node = nodes[i]
        paths[i] = (paths[node.parent] if node.parent >= 0 else ()) + (node.rank,)
    tree = TokenTree.from_paths(paths.values())
    token_of = {paths[i]: nodes[i].token for i in chosen}
    return tree, np.array([token_of[path] for path in tree.paths], dtype=np.int64)


class EagleTree(EagleDraft):
    """The head's dynamic tree where one greedy request decodes alone, its chain elsewhere."""

    name = "eagle_tree"

    def __init__(self, runner: EagleRunner, p_min: float = 0.0, shape: TreeShape = TreeShape()):
        super().__init__(runner, p_min)
        self.shape = shape

    def drafts_tree(self, request, batch: int, room: int) -> bool:
        """Whether this iteration verifies a dynamic tree: a greedy request alone, without a grammar or
        log-probabilities, with room in both caches (`room`: positions left past the request's tokens)."""
        return (batch == 1 and request.gamma != 0 and request.params.greedy and request.grammar is None
                and request.logprobs is None and self.runner.trees and request.remaining > 1
                and room > self.shape.nodes + self.shape.head_positions)
