"""Engines with real cache semantics but a hash for a model: the loop's logic, without ONNX."""

import numpy as np

from speccompile.core.acceptance import greedy_accept


def next_token_of(prefix, vocab: int, salt: int) -> int:
    """A deterministic 'model': the next token is a hash of the whole prefix."""
    return hash((salt, tuple(int(t) for t in prefix))) % vocab


class FakeEngine:
    """Caches tokens by position; reads past a sequence's length are bugs and raise."""

    def __init__(self, vocab: int = 50, salt: int = 0, capacity: int = 256):
        self.vocab_size, self.salt, self.capacity = vocab, salt, capacity
        self.calls = 0

    def start(self, batch_size):
        self.cache = np.full((batch_size, self.capacity), -1, dtype=np.int64)
        self.cache_lengths = np.zeros(batch_size, dtype=np.int64)

    def _append(self, tokens):
        """Write tokens at each row's length; return the model's choice after each position."""
        choices = np.zeros(tokens.shape, dtype=np.int64)
        for row, length in enumerate(self.cache_lengths):
            assert (self.cache[row, :length] >= 0).all(), "read of an unwritten cache entry"
            self.cache[row, length : length + tokens.shape[1]] = tokens[row]
            for t in range(tokens.shape[1]):
                choices[row, t] = next_token_of(self.cache[row, : length + t + 1], self.vocab_size, self.salt)
        return choices

    def forward(self, tokens, token_count):
        self.calls += 1
        choices = self._append(tokens)
        self.cache_lengths = self.cache_lengths + token_count
        return choices[np.arange(len(tokens)), token_count - 1]

    def verify(self, tokens):
        self.calls += 1
        choices = self._append(tokens)
        accepted, next_token, self.cache_lengths = greedy_accept(choices, tokens[:, 1:], self.cache_lengths)
        return accepted, next_token


class AgreeingDraft(FakeEngine):
    """Agrees with a target of the same salt except on a fraction of prefixes."""

    def __init__(self, disagree_every: int, **kwargs):
        super().__init__(**kwargs)
        self.disagree_every = disagree_every

    def forward(self, tokens, token_count):
        out = super().forward(tokens, token_count)
        flip = (self.cache_lengths % self.disagree_every) == 0
        return np.where(flip, (out + 1) % self.vocab_size, out)
