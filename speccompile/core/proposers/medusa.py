"""Medusa heads (core/tree.py): heads on the target propose a token tree at every verification,
rooted at the token it returns; the next iteration verifies that tree in one pass. A row's first
iteration, with no proposal yet, and a plain row (γ 0) verify the root alone: a plain step that also
reads the heads. Heads propose nothing the target has not verified, so a tree never needs room
reserved: it shrinks near the cache's end.

Shared (`TreeShape`): the tree every row verifies and the prefix of it each batch size verifies, as
the runtime sized them by measured cost (runtime/tree_sizing.py) or the user set them.
"""

from dataclasses import dataclass, field

import numpy as np

from speccompile.core.gamma_policy import GammaPolicy
from speccompile.core.proposers.base import Offer, Proposer
from speccompile.core.tree import TokenTree


@dataclass
class TreeShape:
    tree: TokenTree | None = None  # None: not sized yet
    nodes_per_batch: dict[int, int] = field(default_factory=dict)  # decoding requests -> prefix nodes

    def for_batch(self, batch: int, room: int) -> TokenTree:
        """The tree a batch of this size verifies, cut to the cache room its rows leave."""
        return self.tree.prefix(min(room, self.nodes_per_batch.get(batch, self.tree.size)))


class MedusaHeads(Proposer):
    name = "medusa"
    tree = True
    reserves_room = False

    def __init__(self, shape: TreeShape):
        self.shape = shape
        self.next_tree: np.ndarray | None = None  # the heads' tree from the last verification (None: none yet)

    def offer(self, request, wanted: int, cap: int, policy: GammaPolicy | None) -> Offer:
        return Offer(0 if self.next_tree is None else len(self.next_tree) - 1, self, None)
