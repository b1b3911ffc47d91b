"""Sizing a Medusa bundle's token tree by measured cost, beside the γ policies (policies.py).

The tree every Medusa request verifies is grown from the heads' accuracies (core/tree.py) at each
size, each size's verification is timed here at batch 1, and the size with the most expected tokens
per millisecond wins; then the prefix of it each batch size verifies. It is recorded in the bundle
per machine (profiles/tree-*.json, like γ profiles) and read from there by the next process. The
result lives in the proposers' shared `TreeShape`, which the scheduler reads.
"""

import logging

from speccompile.core.cost_model import between, expected_tokens, rate
from speccompile.core.proposers import TreeShape
from speccompile.core.tree import MAX_TREE_NODES, TREE_SIZES, TokenTree, best_tree, grow_tree, measured_paths
from speccompile.errors import SpecCompileError

log = logging.getLogger("speccompile")


class TreeSizing:
    def __init__(self, bundle, target, backend: str, max_batch: int, shape: TreeShape):
        self.bundle, self.target, self.backend, self.max_batch, self.shape = bundle, target, backend, max_batch, shape
        self.medusa = bundle.medusa
        self.record: dict | None = None  # per tree size, the prediction and measured cost it was chosen by

    @property
    def measured(self) -> dict:
        """How often the heads' rank paths were right, as `distill --medusa` measured (core/tree.py)."""
        return measured_paths(self.medusa.get("path_probability"))

    def set(self, tree) -> None:
        """A TokenTree, "chain" (the heads' top-1 candidates, as deep as there are heads), a number of
        nodes (the root included; grown from the heads' accuracies) or None (the size recorded for this
        machine, or measured now)."""
        heads, accuracy = self.medusa["num_heads"], self.medusa["top_k_accuracy"]
        if tree == "chain":
            tree = TokenTree.chain(heads)
        elif isinstance(tree, int) and not isinstance(tree, bool):
            if not 2 <= tree <= MAX_TREE_NODES:
                raise SpecCompileError(f"a token tree has 2..{MAX_TREE_NODES} nodes, not {tree}")
            tree = grow_tree(accuracy, tree - 1, self.measured)
        elif tree is not None and not isinstance(tree, TokenTree):
            raise SpecCompileError(f"tree must be a TokenTree, 'chain', a number of nodes or None, not {tree!r}")
        candidates = self.medusa["candidates"]
        if tree is not None and (tree.max_depth > heads or tree.top_k() > candidates):
            raise SpecCompileError(f"this tree needs {tree.max_depth} heads and {tree.top_k()} candidates per head; "
                                   f"the bundle has {heads} heads of {candidates} candidates")
        self.shape.tree, self.shape.nodes_per_batch = tree, {}
        if tree is None:
            self.size()

    def size(self) -> None:
        """The recorded sizing for this machine, or a new one measured now (drives the target model:
        only with no request in flight)."""
        from speccompile.runtime.calibration import measure_tree_costs
        from speccompile.runtime.gamma_profile import find_tree_profile, write_tree_profile
        from speccompile.runtime.hardware import fingerprint

        fp = fingerprint(self.backend)
        recorded = find_tree_profile(self.bundle.path, fp)
        if recorded is not None:
            paths, prefixes, self.record = recorded
            self.shape.tree, self.shape.nodes_per_batch = TokenTree.from_paths(paths), prefixes
            return
        accuracy = self.medusa["top_k_accuracy"]
        context = min(64, self.bundle.max_seq // 4)
        sizes = [n for n in TREE_SIZES if n + context <= self.bundle.max_seq]
        trees = {n: grow_tree(accuracy, n - 1, self.measured) for n in sizes}
        costs = measure_tree_costs(self.target, trees, 1, context, repeats=5)
        tree, self.record = best_tree(accuracy, costs, measured=self.measured)
        log.info(f"Medusa token tree: {tree.size} nodes, depth {tree.max_depth} (expected accepted "
                 f"{tree.expected_accepted(accuracy, self.measured):.2f}, verification {costs[tree.size]:.2f} ms here)")
        self.shape.tree, self.shape.nodes_per_batch = tree, self._prefix_per_batch(tree, context)
        written = write_tree_profile(self.bundle.path, fp, tree.to_json(), self.shape.nodes_per_batch, self.record)
        if written is not None:
            log.info(f"  recorded in {written}")

    def _prefix_per_batch(self, tree: TokenTree, context: int) -> dict[int, int]:
        """Per number of decoding requests, the prefix of the tree that pays best: every row verifies
        its own tree, so a pass grows with batch × nodes, and a larger batch affords fewer nodes each.
        The prefixes are timed at the bundle's max batch; between it and batch 1 the costs are linear."""
        from speccompile.runtime.calibration import measure_tree_costs

        if self.max_batch == 1:
            return {}
        accuracy = self.medusa["top_k_accuracy"]
        prefixes = {n: tree.prefix(n) for n in TREE_SIZES if n <= tree.size}
        low = measure_tree_costs(self.target, prefixes, 1, context, repeats=3)
        high = measure_tree_costs(self.target, prefixes, self.max_batch, context, repeats=3)
        expected = {n: expected_tokens([p.expected_accepted(accuracy, self.measured)]) for n, p in prefixes.items()}
        chosen = {}
        for batch in range(1, self.max_batch + 1):
            w = (batch - 1) / (self.max_batch - 1)
            rates = {n: rate(expected[n], between(low[n], high[n], w)) for n in prefixes}
            chosen[batch] = max(rates, key=rates.get)
        self.record = {"batch_1": self.record, "prefix_nodes_per_batch": chosen}
        return chosen
