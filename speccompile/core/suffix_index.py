"""Suffix tries with counts: the draft source of SuffixDecoding (Oliaro et al. 2024, arXiv 2411.04975).

A `SuffixTree` indexes every suffix start of its sequences, each up to `max_depth` tokens deep: the node of path
p counts the indexed occurrences of p (the suffix starts i with tokens[i:i+len(p)] == p), so a node never counts
more than its parent. Appending a token extends only the suffixes that started in the last `max_depth` positions,
one node step each: O(max_depth) a token, never re-walking the sequence.

Speculation matches the longest suffix of the context (min_match..max_match tokens) whose node has a
continuation, then follows the most frequent child while the running product of count(child)/count(node)
stays >= min_probability. A node's count includes occurrences that stop at it (a sequence's end, the context
itself when it is indexed), so the ratios are conservative. The match and the proposal share the `max_depth`
budget: a match of m tokens leaves at most max_depth - m proposed tokens.

`SuffixCache` keeps a tree per running request (prompt and output, extended as tokens come) and one global tree
of finished requests' outputs (the `max_sequences` most recent), and proposes the better of the two.
"""

from collections import deque

ROOT = 0


class SuffixTree:
    """A bounded-depth suffix trie over token sequences with counts (the structure SuffixDecoding keeps).

    Nodes are ints into flat lists (fewer objects made per token than node objects, the cost of `extend`):
    `_counts[node]`, and `_kids[node]`: None (a leaf), a (token, child) pair (one child) or {token: child}.
    """

    def __init__(self, max_depth: int = 24):
        if max_depth < 1:
            raise ValueError(f"max_depth {max_depth}: must be >= 1")
        self.max_depth = max_depth
        self._counts, self._kids, self._free = [0], [None], []  # the root's count: every indexed suffix start
        self._tokens: dict[int, list[int]] = {}
        self._open: dict[int, list[int]] = {}  # per sequence: the deepest node of each suffix still < max_depth

    def __contains__(self, sequence_id: int) -> bool:
        return sequence_id in self._tokens

    def sequence(self, sequence_id: int) -> list[int]:
        """The tokens indexed under `sequence_id` (a copy)."""
        return list(self._tokens[sequence_id])

    def count(self, path: list[int]) -> int:
        """How many indexed suffix occurrences start with `path` (0 when none does, or past max_depth)."""
        node = self._walk(path)
        return 0 if node is None else self._counts[node]

    def children(self, path: list[int]) -> dict[int, int]:
        """The tokens seen after `path`, each with its count."""
        node = self._walk(path)
        return {} if node is None else {token: self._counts[child] for token, child in self._items(node)}

    def add(self, sequence_id: int, tokens: list[int]) -> None:
        """Index a new sequence: every suffix start of `tokens`, up to max_depth deep."""
        if sequence_id in self._tokens:
            raise ValueError(f"sequence {sequence_id} is already indexed; extend it")
        self._tokens[sequence_id], self._open[sequence_id] = [], []
        self.extend(sequence_id, tokens)

    def extend(self, sequence_id: int, new_tokens: list[int]) -> None:
        """Append tokens to an indexed sequence: each new token adds one node step per suffix in the window."""
        tokens, open_nodes = self._tokens[sequence_id], self._open[sequence_id]
        counts, kids, free = self._counts, self._kids, self._free
        for token in new_tokens:
            token = int(token)
            open_nodes.append(ROOT)  # the suffix starting at this token
            for j, node in enumerate(open_nodes):
                children = kids[node]
                child = children.get(token) if type(children) is dict else \
                    children[1] if children is not None and children[0] == token else None
                if child is not None:
                    counts[child] += 1
                else:  # a new node
                    if free:
                        child = free.pop()
                        counts[child] = 1
                    else:
                        child = len(counts)
                        counts.append(1)
                        kids.append(None)
                    if children is None:
                        kids[node] = (token, child)
                    elif type(children) is tuple:
                        kids[node] = {children[0]: children[1], token: child}
                    else:
                        children[token] = child
                open_nodes[j] = child
            counts[ROOT] += 1
            if len(open_nodes) == self.max_depth:  # the oldest suffix reached max_depth: it grows no more
                del open_nodes[0]
            tokens.append(token)

    def remove(self, sequence_id: int) -> None:
        """Forget a sequence: take its occurrences off the counts, freeing nodes no sequence reaches any more."""
        tokens = self._tokens.pop(sequence_id)
        del self._open[sequence_id]
        counts, kids = self._counts, self._kids
        counts[ROOT] -= len(tokens)
        for start in range(len(tokens)):
            node = ROOT
            for token in tokens[start:start + self.max_depth]:
                parent, node = node, self._child(node, token)
                counts[node] -= 1
                if counts[node] == 0:  # its subtree counted nothing else (a child never counts more than its parent)
                    if type(kids[parent]) is dict:
                        del kids[parent][token]
                    else:
                        kids[parent] = None
                    self._release(node)
                    break

    def _release(self, node: int) -> None:
        stack = [node]
        while stack:
            node = stack.pop()
            stack.extend(child for _, child in self._items(node))
            self._kids[node] = None
            self._free.append(node)

    def speculate(self, context: list[int], max_tokens: int, min_match: int = 2, max_match: int = 16,
                  min_probability: float = 0.1) -> tuple[list[int], float, int]:
        """Find the longest suffix of `context` (between min_match and max_match tokens) found in the trie with a
        continuation; from its node follow greedily the most frequent child (ties: the smaller token) while the
        product of count(child)/count(node) stays >= min_probability, up to max_tokens. Returns (tokens, that final
        product: the estimated probability that all are accepted, the match length); ([], 0.0, 0) when nothing
        matches, ([], 0.0, match length) when the first step already falls under min_probability."""
        tokens, probabilities, matched = self.propose(context, max_tokens, min_match, max_match, min_probability)
        return tokens, (probabilities[-1] if tokens else 0.0), matched

    def propose(self, context: list[int], max_tokens: int, min_match: int = 2, max_match: int = 16,
                min_probability: float = 0.1) -> tuple[list[int], list[float], int]:
        """As `speculate`, with the running probability after each proposed token instead of the last one."""
        low, high = max(min_match, 1), min(max_match, len(context), self.max_depth - 1)
        if max_tokens <= 0 or high < low or not self._continues(context, low):
            return [], [], 0
        while low < high:  # a continued suffix's own suffixes are continued too: bisect for the longest
            middle = (low + high + 1) // 2
            if self._continues(context, middle):
                low = middle
            else:
                high = middle - 1
        counts, node = self._counts, self._walk(context[len(context) - low:])
        out, probabilities, probability = [], [], 1.0
        while len(out) < max_tokens and self._kids[node]:
            token, child = max(self._items(node), key=lambda item: (counts[item[1]], -item[0]))
            probability *= counts[child] / counts[node]
            if probability < min_probability:
                break
            out.append(token)
            probabilities.append(probability)
            node = child
        return out, probabilities, low

    def _items(self, node: int):
        children = self._kids[node]
        return () if children is None else (children,) if type(children) is tuple else children.items()

    def _child(self, node: int, token: int) -> int | None:
        children = self._kids[node]
        if type(children) is dict:
            return children.get(token)
        return children[1] if children is not None and children[0] == token else None

    def _walk(self, path: list[int]) -> int | None:
        node = ROOT
        for token in path:
            node = self._child(node, token)
            if node is None:
                return None
        return node

    def _continues(self, context: list[int], length: int) -> bool:
        node = self._walk(context[len(context) - length:])
        return node is not None and bool(self._kids[node])


def expected_accepted(probabilities: list[float]) -> float:
    """Expected accepted draft tokens: sum over k of P(the first k are accepted), the running products."""
    return float(sum(probabilities))


class SuffixCache:
    """Per-request suffix trees (prompt + output so far) and a global tree of finished requests' outputs."""

    def __init__(self, max_depth: int = 24, max_sequences: int = 256):
        self.max_depth, self.max_sequences = max_depth, max_sequences
        self.global_tree = SuffixTree(max_depth)
        self._requests: dict = {}  # request key -> (its tree, its prompt's length)
        self._finished: deque[int] = deque()  # global tree's sequence ids, oldest first
        self._next_id = 0

    def start(self, request_key, prompt: list[int]) -> None:
        """Open a request: index its prompt in a tree of its own."""
        tree = SuffixTree(self.max_depth)
        tree.add(0, prompt)
        self._requests[request_key] = (tree, len(prompt))

    def extend(self, request_key, new_tokens: list[int]) -> None:
        """Append a request's newly generated (accepted) tokens to its tree."""
        self._requests[request_key][0].extend(0, new_tokens)

    def finish(self, request_key, remember: bool = True) -> None:
        """Close a request; with `remember`, its output joins the global tree, evicting the oldest past the bound."""
        tree, prompt_len = self._requests.pop(request_key)
        if remember:
            self.remember(tree.sequence(0)[prompt_len:])

    def remember(self, output: list[int]) -> None:
        """A finished request's output joins the global tree (the oldest is evicted past the bound)."""
        if not output or self.max_sequences <= 0:
            return
        self.global_tree.add(self._next_id, output)
        self._finished.append(self._next_id)
        self._next_id += 1
        while len(self._finished) > self.max_sequences:
            self.global_tree.remove(self._finished.popleft())

    def forget_outputs(self) -> None:
        """Drop every finished request's output (open requests keep their own trees): what a fresh
        process knows. Benchmarks call it so that no measured run drafts from answers it saw before."""
        self.global_tree = SuffixTree(self.max_depth)
        self._finished.clear()

    def speculate(self, request_key, context: list[int], max_tokens: int, **options) -> tuple[list[int], float, int]:
        """The better proposal of the request's tree and the global tree, by expected accepted tokens (ties: the
        request's own). Returns as `SuffixTree.speculate`; `options` are its min_match, max_match, min_probability."""
        tokens, probabilities, matched = self.propose(request_key, context, max_tokens, **options)
        return tokens, (probabilities[-1] if tokens else 0.0), matched

    def propose(self, request_key, context: list[int], max_tokens: int,
                **options) -> tuple[list[int], list[float], int]:
        """As `speculate`, with the running probability after each proposed token (`SuffixTree.propose`)."""
        best, best_score = ([], [], 0), 0.0
        entry = self._requests.get(request_key)
        for tree in ([entry[0]] if entry else []) + [self.global_tree]:
            proposal = tree.propose(context, max_tokens, **options)
            score = expected_accepted(proposal[1])
            if score > best_score:
                best, best_score = proposal, score
        return best
