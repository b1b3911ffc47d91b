"""Token trees: verifying several candidate continuations in one target pass (Medusa, SpecInfer).

A static tree (`TokenTree`) is a set of *paths* of head ranks, as Medusa's sparse trees: path
(c_1, .., c_d) is the node at depth d whose token is the c_d-th most likely token of head d-1
(Medusa head k predicts the token k+2 positions after the position it reads, one after the target's
own next token), under the node of path (c_1, .., c_{d-1}). Node 0 is the root: the last accepted
token, which is not cached yet. Nodes are numbered breadth-first (by depth, then path), so every
node's parent has a smaller number, and the first m+1 nodes are a tree of their own: a row verifies
a prefix of the tree (`draft_len` non-root nodes), as a chain row verifies a prefix of its drafts.

One target pass scores every node: node i sits at position past_len + depth(i) (RoPE, position
embeddings) and attends to the cached prefix and to its own ancestors only (`ancestors`), so its
logits are exactly those of the sequence prefix + the path to i. Its cache entry is written at
past_len + i (the next free slots, in node order); after acceptance the accepted path's entries are
moved to past_len + 1 .. past_len + n (`compaction`), and rollback stays a length update. A chain of
γ nodes is the tree whose every path is (0, .., 0): positions, mask and compaction are then the
plain verification's, and nothing moves.

Greedy rule (exact). t_i is the target's argmax after node i. Node i (i > 0) is *kept* iff its token
equals t_parent(i) and every ancestor is kept; the root always is. The accepted path is the deepest
kept node (the first such in node order on ties), n its depth, the next token t_best. Every emitted
token is the target's argmax after a prefix that is itself target-greedy: exactly autoregressive.

Typical rule (approximate, Medusa-2's typical acceptance): node i is kept iff every ancestor is and
p(token_i) > min(ε, δ·exp(-H(p))) for p the target's distribution (temperature 1) after its parent;
the next token is still the target's argmax after the accepted path. It accepts plausible tokens the
target would not have chosen greedily: faster, and no longer the target's greedy output.
"""

import functools
import heapq
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from speccompile.core.cost_model import rate

TYPICAL_EPSILON, TYPICAL_DELTA = 0.09, 0.3  # Medusa's defaults (posterior_threshold, posterior_alpha)
ACCEPTANCE_RULES = ("exact", "typical")
MAX_TREE_NODES = 64  # the largest tree a runtime sizes (root included); more never paid on the hardware measured
TREE_SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # the sizes it measures to choose one


@dataclass(frozen=True)
class TokenTree:
    paths: tuple[tuple[int, ...], ...]  # every non-root node's path of head ranks, breadth-first

    @classmethod
    def from_paths(cls, paths) -> "TokenTree":
        """A tree from paths in any order; every path's prefixes must be paths too."""
        unique = sorted({tuple(int(c) for c in p) for p in paths}, key=lambda p: (len(p), p))
        known = set(unique)
        for path in unique:
            if not path or min(path) < 0:
                raise ValueError(f"tree path {list(path)}: paths are non-empty lists of ranks >= 0")
            if len(path) > 1 and path[:-1] not in known:
                raise ValueError(f"tree path {list(path)} has no parent {list(path[:-1])}")
        return cls(tuple(unique))

    @classmethod
    def chain(cls, length: int) -> "TokenTree":
        """The chain of `length` top-1 candidates: plain speculative verification of γ = length."""
        return cls(tuple((0,) * d for d in range(1, length + 1)))

    @property
    def size(self) -> int:
        """Nodes, the root included: the tokens one verification scores."""
        return len(self.paths) + 1

    @property
    def max_depth(self) -> int:
        return max(map(len, self.paths), default=0)

    @property
    def is_chain(self) -> bool:
        return all(set(p) == {0} for p in self.paths)

    @cached_property
    def parents(self) -> np.ndarray:
        """[N] int64: each node's parent (the root's is itself)."""
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        return np.array([0] + [index.get(p[:-1], 0) for p in self.paths], dtype=np.int64)

    @cached_property
    def depths(self) -> np.ndarray:
        """[N] int64: the position of each node after the root."""
        return np.array([0] + [len(p) for p in self.paths], dtype=np.int64)

    @cached_property
    def ranks(self) -> np.ndarray:
        """[N] int64: which of its head's candidates each node holds (the root's: 0, unused)."""
        return np.array([0] + [p[-1] for p in self.paths], dtype=np.int64)

    @cached_property
    def ancestors(self) -> np.ndarray:
        """[N, N] bool: node j is node i's ancestor or i itself (what i attends to in the tree)."""
        seen = np.eye(self.size, dtype=bool)
        for i in range(1, self.size):
            seen[i] |= seen[self.parents[i]]
        return seen

    def prefix(self, nodes: int) -> "TokenTree":
        """The tree of its first `nodes` nodes, the root included (a tree too: parents come first).
        Kept per size: a batch verifies the same prefix iteration after iteration, and its parents,
        depths and mask are computed once."""
        return self if nodes >= self.size else _prefix(self, nodes)

    def top_k(self) -> int:
        """The most candidates any head must supply."""
        return int(self.ranks.max()) + 1 if self.paths else 0

    def nodes_within(self, depth: int) -> int:
        """Non-root nodes at depth <= `depth`: the prefix a row that needs at most that many drafts verifies."""
        return int((self.depths[1:] <= depth).sum())

    def path_to(self, node: int) -> list[int]:
        """The nodes from depth 1 down to `node` (empty for the root)."""
        path = []
        while node:
            path.append(node)
            node = int(self.parents[node])
        return path[::-1]

    def expected_accepted(self, accuracies, measured: dict | None = None) -> float:
        """Expected accepted depth: the sum over nodes of their path's probability (at most one
        candidate per depth can be the target's token, so the events add up); see path_probability."""
        return float(sum(path_probability(p, accuracies, measured) for p in self.paths))

    def to_json(self) -> list[list[int]]:
        return [list(p) for p in self.paths]


@functools.lru_cache(maxsize=64)
def _prefix(tree: TokenTree, nodes: int) -> TokenTree:
    return TokenTree(tree.paths[: nodes - 1])


def path_probability(path, accuracies, measured: dict | None = None) -> float:
    """How often the node of `path` is accepted: as measured (`measured`: path -> probability, from
    `distill --medusa`'s path_probability), else the measured probability of its longest measured
    prefix times the rank accuracies of the heads after it (accuracies[k][c]: head k's rank-c
    candidate is right), as if those heads erred independently."""
    path = tuple(path)
    measured = measured or {}
    prob, known = 1.0, 0
    for depth in range(len(path), 0, -1):
        if path[:depth] in measured:
            prob, known = measured[path[:depth]], depth
            break
    for depth in range(known, len(path)):
        heads = accuracies[depth] if depth < len(accuracies) else []
        prob *= heads[path[depth]] if path[depth] < len(heads) else 0.0
    return prob


def measured_paths(pairs) -> dict:
    """path_probability's `measured` from the heads' [[path, probability]] list."""
    return {tuple(path): float(prob) for path, prob in pairs or []}


def grow_tree(accuracies, nodes: int, measured: dict | None = None) -> TokenTree:
    """The tree of `nodes` non-root nodes with the largest expected accepted depth (Medusa's sparse
    tree construction): best-first over paths by probability. A path is never likelier than its
    prefix, so the best `nodes` paths always form a tree."""
    def prob(path):
        return min(path_probability(path, accuracies, measured), parent_prob.get(path[:-1], 1.0))

    parent_prob: dict = {}  # keeps a path no likelier than its prefix where measured and estimated mix
    frontier = [(-prob((c,)), (c,)) for c in range(len(accuracies[0]))] if accuracies else []
    heapq.heapify(frontier)
    chosen = []
    while frontier and len(chosen) < nodes:
        negative, path = heapq.heappop(frontier)
        chosen.append(path)
        parent_prob[path] = -negative
        if len(path) < len(accuracies):
            for c in range(len(accuracies[len(path)])):
                heapq.heappush(frontier, (-prob(path + (c,)), path + (c,)))
    return TokenTree.from_paths(chosen)


def best_tree(accuracies, verify_ms: dict[int, float], extra_ms: float = 0.0,
              measured: dict | None = None) -> tuple[TokenTree, dict]:
    """The tree that maximises expected tokens per millisecond, (1 + expected accepted) / (cost of
    verifying its N nodes + extra_ms), over the sizes `verify_ms` (tokens scored -> measured ms) has.
    Returns it and, per size, the prediction (what the build records)."""
    predictions = {}
    for tokens, ms in sorted(verify_ms.items()):
        expected = grow_tree(accuracies, tokens - 1, measured).expected_accepted(accuracies, measured)
        predictions[tokens] = {"expected_accepted": round(expected, 3), "verify_ms": round(ms, 3),
                               "tokens_per_ms": round(rate(1 + expected, ms + extra_ms), 4)}
    best = max(predictions, key=lambda t: predictions[t]["tokens_per_ms"])
    return grow_tree(accuracies, best - 1, measured), predictions


# ---------------------------------------------------------------------------------------------
# numpy references: the oracle of the in-graph SpecAccept tree modes and of the plugin


def _real_nodes(draft_len, batch: int, size: int) -> np.ndarray:
    """[B, N] bool: node i of row b is verified (i <= draft_len[b]; the root always is)."""
    if draft_len is None:
        return np.ones((batch, size), bool)
    return np.arange(size)[None, :] <= np.asarray(draft_len, np.int64)[:, None]


def _accept_kept(kept: np.ndarray, target_tokens: np.ndarray, tree: TokenTree, past_len):
    """From per-node checks kept [B, N] (root: True) to (accepted, next_token, new_len, best_node)."""
    path_kept = ~((~kept).astype(np.int64) @ tree.ancestors.T.astype(np.int64) > 0)  # no rejected ancestor
    best = np.argmax(np.where(path_kept, tree.depths[None, :], -1), axis=1)  # first deepest: lowest index
    accepted = tree.depths[best]
    next_token = np.take_along_axis(target_tokens, best[:, None], axis=1)[:, 0]
    return accepted, next_token.astype(np.int64), (np.asarray(past_len) + accepted + 1).astype(np.int64), best


def tree_accept(target_tokens, tree_tokens, tree: TokenTree, past_len, draft_len=None):
    """Greedy rule. target_tokens [B, N] (the target's argmax after each node), tree_tokens [B, N]
    (node 0: the root), draft_len [B] (non-root nodes verified per row; None: all).
    Returns (accepted [B], next_token [B], new_len [B], best_node [B])."""
    target_tokens, tree_tokens = np.asarray(target_tokens, np.int64), np.asarray(tree_tokens, np.int64)
    kept = (tree_tokens == target_tokens[:, tree.parents]) & _real_nodes(draft_len, *tree_tokens.shape)
    kept[:, 0] = True
    return _accept_kept(kept, target_tokens, tree, past_len)


def typical_accept(target_logits, tree_tokens, tree: TokenTree, past_len, draft_len=None,
                   epsilon=TYPICAL_EPSILON, delta=TYPICAL_DELTA):
    """Typical rule over target_logits [B, N, V]; epsilon and delta per row ([B]) or one for all.
    Same returns as tree_accept."""
    logits = np.asarray(target_logits, np.float64)
    tree_tokens = np.asarray(tree_tokens, np.int64)
    batch, size = tree_tokens.shape
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    entropy = -(probs * np.log(np.maximum(probs, 1e-30))).sum(-1)  # [B, N]
    threshold = np.minimum(np.broadcast_to(epsilon, (batch,))[:, None],
                           np.broadcast_to(delta, (batch,))[:, None] * np.exp(-entropy))  # [B, N], per parent
    p_token = np.take_along_axis(probs[:, tree.parents], tree_tokens[:, :, None], axis=2)[:, :, 0]
    kept = (p_token > threshold[:, tree.parents]) & _real_nodes(draft_len, batch, size)
    kept[:, 0] = True
    return _accept_kept(kept, logits.argmax(-1), tree, past_len)


def tree_candidates(next_token, head_logits, tree: TokenTree) -> np.ndarray:
    """The next iteration's tree tokens [B, N]: the root is next_token [B], node i the rank(i)-th
    most likely token of head depth(i)-1 in head_logits [B, K, V] (ties: the lower token id first)."""
    head_logits = np.asarray(head_logits)
    ranked = np.argsort(-head_logits, axis=-1, kind="stable")[:, :, : max(1, tree.top_k())]  # [B, K, top]
    tokens = np.zeros((len(head_logits), tree.size), dtype=np.int64)
    tokens[:, 0] = next_token
    heads = np.maximum(tree.depths[1:] - 1, 0)
    tokens[:, 1:] = ranked[:, heads, tree.ranks[1:]]
    return tokens


def compaction(tree: TokenTree, best_node: int) -> tuple[np.ndarray, np.ndarray]:
    """Cache moves after acceptance, relative to past_len: the accepted path's entries from their
    node slots to depths 1..n, in order (sources are at or past their destinations, which
    increase, so moving in order never overwrites an entry still to be moved). Empty for a chain."""
    path = np.array(tree.path_to(int(best_node)), dtype=np.int64)
    depth = np.arange(1, len(path) + 1, dtype=np.int64)
    moved = path != depth
    return path[moved], depth[moved]
