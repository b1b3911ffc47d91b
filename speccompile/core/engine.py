"""The narrow interface a backend implements for the speculative loop.

A `DecoderEngine` owns one model's KV cache for a batch and the per-sequence cache lengths.
The loop never touches the cache itself: it only reads and rewinds `cache_lengths` (rollback is a
length update; stale entries past a length are never read and get overwritten).
"""

from typing import Protocol

import numpy as np


class DecoderEngine(Protocol):
    cache_lengths: np.ndarray  # int64 [B]: tokens cached per sequence; writable (rollback)
    vocab_size: int

    def start(self, batch_size: int) -> None:
        """Allocate (or reuse) the cache for `batch_size` sequences and set every length to 0."""

    def forward(self, tokens: np.ndarray, token_count: np.ndarray) -> np.ndarray:
        """Append tokens [B, T] (first token_count[b] real, rest padding) at each sequence's length.

        Returns the greedy next token [B] after each sequence's last real token, and advances
        cache_lengths by token_count.
        """

    def forward_sample(self, tokens: np.ndarray, token_count: np.ndarray, params: dict,
                       uniform: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Like forward, but the next token is sampled from the distribution that `params`
        (temperature, top_k, top_p per sequence) make of the logits, with one uniform per sequence.
        Returns (next_token [B], that distribution [B, V])."""


class VerifierEngine(DecoderEngine, Protocol):
    def verify(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Score tokens [B, γ+1] = [last, d_1..d_γ] in one pass and apply SpecAccept.

        Returns (accepted [B], next_token [B]) and sets cache_lengths to the rolled-back lengths.
        """

    def verify_sample(self, tokens: np.ndarray, draft_probs: np.ndarray, params: dict, u_accept: np.ndarray,
                      u_sample: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """verify with rejection sampling: draft token d_k is accepted with probability
        min(1, p/q) (u_accept [B, γ]); the correction or bonus token is drawn with u_sample [B] from
        the residual or from p (draft_probs [B, γ, V] is q). Same returns and rollback as verify."""

