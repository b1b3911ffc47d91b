"""Engines with real cache semantics but a hash for a model: the scheduler's logic, without ONNX."""

import numpy as np

from speccompile.core.acceptance import greedy_accept


def next_token_of(prefix, vocab: int, salt: int) -> int:
    """A deterministic 'model': the next token is a hash of the whole prefix."""
    return hash((salt, tuple(int(t) for t in prefix))) % vocab


class FakeEngine:
    """Caches tokens by slot and position; reads of unwritten entries are bugs and raise, and so are
    writes past the cache's end."""

    def __init__(self, vocab: int = 50, salt: int = 0, capacity: int = 256):
        self.vocab_size, self.salt, self.capacity = vocab, salt, capacity
        self.calls = 0
        self.batches: list[int] = []  # rows of every call, in order
        self.cache = np.zeros((0, capacity), dtype=np.int64)
        self.cache_lengths = np.zeros(0, dtype=np.int64)

    def start(self, slots):
        if slots > len(self.cache):
            self.cache = np.full((slots, self.capacity), -1, dtype=np.int64)
        self.cache_lengths = np.zeros(len(self.cache), dtype=np.int64)

    def _append(self, tokens, first):
        """Write tokens at each row's length; return the model's choice after each position."""
        self.calls += 1
        self.batches.append(len(tokens))
        choices = np.zeros(tokens.shape, dtype=np.int64)
        for row in range(len(tokens)):
            slot, length = first + row, self.cache_lengths[first + row]
            assert length + tokens.shape[1] <= self.capacity, "write past the end of the cache"
            assert (self.cache[slot, :length] >= 0).all(), "read of an unwritten cache entry"
            self.cache[slot, length : length + tokens.shape[1]] = tokens[row]
            for t in range(tokens.shape[1]):
                choices[row, t] = self.choose(self.cache[slot, : length + t + 1])
        return choices

    def choose(self, prefix) -> int:
        return next_token_of(prefix, self.vocab_size, self.salt)

    def forward(self, tokens, token_count, first=0, processing=None, logprobs=False):
        assert processing is None and not logprobs, "fake engines neither process logits nor score them"
        choices = self._append(tokens, first)
        self.cache_lengths[first : first + len(tokens)] += token_count
        return choices[np.arange(len(tokens)), np.maximum(token_count - 1, 0)]

    def forward_confident(self, tokens, token_count, first=0, processing=None, logprobs=False):
        """forward, and a confidence in [0, 1) that is a hash of the prefix it follows."""
        token = self.forward(tokens, token_count, first, processing, logprobs)
        rows = range(first, first + len(tokens))
        confidence = [next_token_of(self.cache[s, : self.cache_lengths[s]], 1000, self.salt + 1) / 1000 for s in rows]
        return token, np.array(confidence, dtype=np.float32)

    def verify(self, tokens, draft_len, first=0, processing=None, logprobs=False):
        assert processing is None and not logprobs, "fake engines neither process logits nor score them"
        choices = self._append(tokens, first)
        rows = slice(first, first + len(tokens))
        accepted, next_token, self.cache_lengths[rows] = greedy_accept(choices, tokens[:, 1:], self.cache_lengths[rows],
                                                                       draft_len)
        return accepted, next_token

    def move(self, source, destination):
        length = self.cache_lengths[source]
        self.cache[destination, :length] = self.cache[source, :length]
        self.cache[destination, length:] = -1
        self.cache_lengths[destination] = length

    def load_graphs(self, graphs, batch=None):
        pass


class AgreeingDraft(FakeEngine):
    """Agrees with a target of the same salt except on a fraction of prefixes."""

    def __init__(self, disagree_every: int, **kwargs):
        super().__init__(**kwargs)
        self.disagree_every = disagree_every

    def forward(self, tokens, token_count, first=0, processing=None, logprobs=False):
        out = super().forward(tokens, token_count, first, processing, logprobs)
        flip = (self.cache_lengths[first : first + len(tokens)] % self.disagree_every) == 0
        return np.where(flip, (out + 1) % self.vocab_size, out)


class RepeatingEngine(FakeEngine):
    """A 'model' that mostly repeats its last `period` tokens, as code repeats its own lines, and
    breaks the repetition at one prefix in `every`: prompt lookup finds most of its text."""

    def __init__(self, period: int = 5, every: int = 7, **kwargs):
        super().__init__(**kwargs)
        self.period, self.every = period, every

    def choose(self, prefix) -> int:
        fresh = next_token_of(prefix, self.vocab_size, self.salt)
        if len(prefix) < self.period or fresh % self.every == 0:
            return fresh
        return int(prefix[-self.period])
