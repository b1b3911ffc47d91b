"""The narrow interface a backend implements for the scheduler (`scheduler.py`).

A `DecoderEngine` owns one model's KV cache for a number of *slots* (sequences) and the per-slot
cache lengths. Every call runs on a contiguous range of slots, rows `first .. first+B-1` with B the
batch of the tokens given: the scheduler keeps its active sequences packed at the front, so that a
step costs what the active sequences need, not what the cache could hold. The scheduler never
touches the cache itself: it reads and rewinds `cache_lengths` (rollback is a length update; stale
entries past a length are never read and get overwritten) and moves a sequence to another slot.
"""

from typing import Protocol

import numpy as np

from speccompile.bundle import GraphId
from speccompile.core.tree import TokenTree


class DecoderEngine(Protocol):
    """Every call that chooses a token also takes `processing` (the logits processors' inputs of its
    rows, core/processors.processing_inputs; None: none apply) and `logprobs` (whether to report
    log-probabilities: the call then sets `last_logprobs`, a core.sampling.Logprobs of its positions)."""

    cache_lengths: np.ndarray  # int64 [slots]: tokens cached per slot; writable (rollback)
    vocab_size: int
    last_logprobs: object  # the last call's that asked for them

    def start(self, slots: int) -> None:
        """Have caches for at least `slots` sequences (allocated once, reused after) and set every
        length to 0."""

    def forward(self, tokens: np.ndarray, token_count: np.ndarray, first: int = 0, processing: dict | None = None,
                logprobs: bool = False) -> np.ndarray:
        """Append tokens [B, T] (first token_count[b] real, rest padding; 0 real is allowed) at the
        lengths of slots first..first+B-1.

        Returns the greedy next token [B] after each row's last real token (undefined for a row of
        0 real tokens), and advances those slots' cache_lengths by token_count.
        """

    def forward_confident(self, tokens: np.ndarray, token_count: np.ndarray, first: int = 0,
                          processing: dict | None = None, logprobs: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """forward, returning (next_token [B], its probability [B]: how sure the model is of it)."""

    def forward_sample(self, tokens: np.ndarray, token_count: np.ndarray, params: dict, uniform: np.ndarray,
                       coupled: np.ndarray | None = None, noise: np.ndarray | None = None, first: int = 0,
                       processing: dict | None = None, logprobs: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Like forward, but the next token is sampled from the distribution that `params`
        (temperature, top_k, top_p per row) make of the logits: by inverse CDF with one uniform per
        row, or in the rows marked coupled [B] by Gumbel-max with the noise [B, V] (uniforms).
        Returns (next_token [B], that distribution [B, V])."""

    def move(self, source: int, destination: int) -> None:
        """Copy slot `source`'s cached entries and length into slot `destination`."""

    def load_graphs(self, graphs: list[GraphId], batch: int | None = None) -> None:
        """Load what these graphs run on at this batch size now, so that no generation times a load."""


class VerifierEngine(DecoderEngine, Protocol):
    def verify(self, tokens: np.ndarray, draft_len: np.ndarray, first: int = 0, processing: dict | None = None,
               logprobs: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Score tokens [B, γ+1] = [last, d_1..d_γ] in one pass and apply SpecAccept; row b's drafts
        are its first draft_len[b] (0..γ), the rest padding that is never accepted.

        Returns (accepted [B], next_token [B]) and sets the slots' cache_lengths to the rolled-back
        lengths.
        """

    def verify_sample(self, tokens: np.ndarray, draft_len: np.ndarray, draft_probs: np.ndarray, params: dict,
                      u_accept: np.ndarray, u_sample: np.ndarray, coupled: np.ndarray | None = None,
                      noise: np.ndarray | None = None, first: int = 0, processing: dict | None = None,
                      logprobs: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """verify with rejection sampling: draft token d_k is accepted with probability
        min(1, p/q) (u_accept [B, γ]); the correction or bonus token is drawn with u_sample [B] from
        the residual or from p (draft_probs [B, γ, V] is q). Rows with coupled [B] set take the
        coupled rule (core/acceptance.py: the target draws every position by Gumbel-max with the
        noise [B, γ+1, V], and drafts are kept while they equal its draws; q and the u are not
        read). Same returns and rollback as verify."""


    def score(self, tokens: np.ndarray, score_ids: np.ndarray, first: int = 0):
        """Prefill tokens [B, T] (all real) and return a core.sampling.Logprobs of each position's
        log-probability of score_ids [B, T] (the tokens that follow in the prompt) under the model's
        own distribution, with its most likely tokens: a prompt's scores (echo)."""


class TreeVerifierEngine(VerifierEngine, Protocol):
    def verify_tree(self, tokens: np.ndarray, draft_len: np.ndarray, tree: TokenTree, typical: tuple | None = None,
                    first: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Score the token trees tokens [B, N] (topology `tree`, node 0 the last accepted token) in one
        pass and keep each row's longest accepted path among its first 1 + draft_len[b] nodes (greedy
        rule, or with typical = (ε, δ) the typical one; core/tree.py); the path's cache entries are
        moved into place and the slots' cache_lengths set past it.

        Returns (best_node [B]: where each row's accepted path ends, its depth the accepted count;
        next_token [B]; next_tree [B, N]: the Medusa heads' tree for the next iteration, rooted at
        next_token)."""
