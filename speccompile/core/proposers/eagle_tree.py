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
bundle whose head has the tree's graphs and whose target verifies them (its tree graph, or its
session graph where that serves the tree's kind). Elsewhere the proposer drafts the head's chain,
as `eagle` does.
"""

import math
import time
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


class TreeSizing:
    """How many of a tree's nodes to verify, and whether to expand it further, at the loop's costs.

    EAGLE-2 verifies a fixed number of nodes, sized for a GPU, where verifying 60 tokens costs about
    what verifying 1 does. On a CPU each verified token costs (demo target, 2 cores: about 0.11 ms
    on a 4.4 ms verification), so a node is worth verifying only where the tokens it is expected to add pay
    for it. A node's chance of being kept is taken as exp(score), its path's draft probability (the
    EAGLE-2 authors show it tracks acceptance), times `scale`, the measured ratio of tokens kept to
    tokens so expected (TreeEconomy). The iteration's rate with the n best nodes is

        (1 + scale x sum of their exp(score)) / (drafting so far + verify(n + 1 tokens) + overhead)

    and the n of the best rate is verified (the n best always hold their ancestors). An expansion
    is skipped where even a child as likely as its parent would not pay its verification."""

    def __init__(self, line: tuple[float, float], extra_ms: float, overhead_ms: float, scale: float, began: float):
        """line: (ms per token, fixed ms) of a verification as a line in the tokens it scores; extra_ms:
        what a tree's costs beyond it; began: the iteration's start (time.perf_counter), from which
        the drafting spent so far is measured."""
        self.line, self.extra_ms, self.overhead_ms, self.scale, self.began = line, extra_ms, overhead_ms, scale, began

    def line_ms(self, tokens: int) -> float:
        per_token, fixed = self.line
        return fixed + per_token * tokens

    def verify_ms(self, tokens: int) -> float:
        """A tree verification scoring `tokens` positions (its root included), in ms."""
        return self.line_ms(tokens) + self.extra_ms

    def expected(self, scores: np.ndarray) -> float:
        """The tokens nodes of these scores are expected to keep."""
        return float(self.scale * np.exp(scores).sum())

    def rates(self, scores: np.ndarray) -> np.ndarray:
        """Tokens per ms with the 1..len(scores) best of these nodes verified (scores best first)."""
        spent = (time.perf_counter() - self.began) * 1e3 + self.overhead_ms
        tokens = 1.0 + self.scale * np.cumsum(np.exp(scores))
        per_token, fixed = self.line
        verified = np.arange(2, len(scores) + 2)  # n nodes and the root
        return tokens / (spent + fixed + self.extra_ms + per_token * verified)

    def count(self, scores: np.ndarray) -> int:
        """How many of the best nodes to verify (at least one)."""
        return int(np.argmax(self.rates(scores))) + 1

    def expands(self, best: float, scores: np.ndarray) -> bool:
        """Whether a child of a frontier whose best node scores `best` could pay for its own
        verification at the best rate the nodes so far give (its head call not even counted)."""
        rates = self.rates(scores)
        n = int(np.argmax(rates)) + 1
        marginal_ms = self.verify_ms(n + 2) - self.verify_ms(n + 1)
        return self.scale * math.exp(best) >= rates[n - 1] * marginal_ms


class TreeEconomy:
    """What the loop learns of a head's trees, older trees fading (time constant `horizon`, in trees):
    `scale`, the drafts kept over those the nodes' scores expected (a ratio of sums, from a prior of
    `prior_tokens` at 1), and `extra_ms`, what a tree's verification costs beyond the γ
    verifications' line (its graph and mask; about 0.8 ms on the demo target), a mean from a prior
    of `prior_trees` trees at 0. The line's slope stays the calibrated one: the trees' own sizes
    vary too little to fit it (a sizing that finds large trees cheap verifies only large trees)."""

    EXPLORE_EVERY = 8  # iterations: one in this many runs the form (tree or chain) that measured slower

    def __init__(self, prior_tokens: float = 8.0, prior_trees: float = 2.0, horizon: float = 64.0):
        self.prior_tokens, self.prior_trees, self.fade = prior_tokens, prior_trees, math.exp(-1.0 / horizon)
        self.kept = self.expected = prior_tokens
        self.trees, self.extra_sum = prior_trees, 0.0
        self.measured = {True: [0.0, 0.0], False: [0.0, 0.0]}  # tree?: [tokens, ms] of its iterations, fading
        self.turns = 0

    def rate(self, tree: bool) -> float | None:
        """Tokens per ms the tree's (or the chain's) iterations gave a request asking for trees."""
        tokens, ms = self.measured[tree]
        return tokens / ms if ms > 0 else None

    def tree_turn(self) -> bool:
        """Whether this iteration drafts a tree rather than the head's chain (which γ auto may turn into a
        plain step): whichever has measured the more tokens per ms, the other once every
        EXPLORE_EVERY iterations (each first tried once). On a CPU a tree's verification costs by
        the token, and the chain may well pay more (demo pair, 2 cores: the sized tree at 1.29x
        beside the chain's 1.57x)."""
        self.turns += 1
        tree, chain = self.rate(True), self.rate(False)
        if tree is None or chain is None:
            return tree is None
        return (tree >= chain) != (self.turns % self.EXPLORE_EVERY == 0)

    def observe_rate(self, tree: bool, tokens: int, ms: float) -> None:
        """One iteration of a request asking for trees, as a tree or as the chain: what it emitted, in how long."""
        pair = self.measured[tree]
        pair[0], pair[1] = self.fade * pair[0] + tokens, self.fade * pair[1] + ms

    @property
    def scale(self) -> float:
        return min(4.0, max(0.1, self.kept / self.expected))

    @property
    def extra_ms(self) -> float:
        return self.extra_sum / self.trees

    def observe(self, expected: float, kept: int, verify_ms: float, predicted_ms: float) -> None:
        """One verified tree: the drafts its scores expected and those kept, its verification's
        measured ms and the line's prediction (extra_ms not included)."""
        if math.isfinite(expected):
            self.kept = self.prior_tokens + self.fade * (self.kept - self.prior_tokens) + kept
            self.expected = self.prior_tokens + self.fade * (self.expected - self.prior_tokens) + expected
        self.trees = self.prior_trees + self.fade * (self.trees - self.prior_trees) + 1.0
        self.extra_sum = self.fade * self.extra_sum + (verify_ms - predicted_ms)


@dataclass
class _Node:
    token: int
    parent: int  # index into the node list; -1: the root (the last token)
    depth: int
    score: float  # cumulative draft log-probability
    rank: int  # its place among its parent's candidates
    written: int = -1  # where its head output sits past the prefix (-1: never expanded)


def draft_tree(runner: EagleRunner, request, shape: TreeShape, slot: int = 0,
               sizing: "TreeSizing | None" = None) -> tuple[TokenTree, np.ndarray, float] | None:
    """The dynamic tree after the request's last token: (its topology, its non-root nodes' tokens in
    the topology's order, the tokens its draft scores expect it to keep); None where the head cannot
    draft one (out of step, nothing to read). With `sizing`, expansions and nodes that do not pay
    at the loop's costs are left out (TreeSizing); without, the shape's `nodes`."""
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
        scores, best = _scores(nodes), nodes[frontier[0]].score
        if not _can_enter(scores, best, shape.nodes) or (sizing is not None and not sizing.expands(best, scores)):
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
    scores = _scores(nodes)
    count = shape.nodes if sizing is None else sizing.count(scores[: shape.nodes])
    tree, tokens = _tree_of(nodes, count)
    return tree, tokens, sizing.expected(scores[:count]) if sizing is not None else float("nan")


def _scores(nodes: list[_Node]) -> np.ndarray:
    """Every node's score, best first."""
    return np.sort(np.array([node.score for node in nodes]))[::-1]


def _can_enter(scores: np.ndarray, best: float, count: int) -> bool:
    """Whether a child of a frontier whose best node scores `best` could be among the `count`
    best-scored nodes (`scores`: every node's so far, best first): a child scores at most its
    parent, and loses a tie to every node drafted so far (all shallower), so where `best` is no more
    than the count-th best score, neither the frontier's children nor their descendants are chosen
    and the expansions left would cost head calls for nothing. The tree is the same."""
    return len(scores) < count or best > scores[count - 1]


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
