"""Numpy reference of the acceptance rule: the oracle for the in-graph SpecAccept op and the plugin.

Greedy speculative decoding is lossless by construction: the target scored [last, d_1..d_γ] in one
pass, so target_tokens[:, j] is the token the target itself would emit after input j. Draft d_j is
kept only while every earlier draft was kept and d_j equals the target's own choice at that point;
the first disagreement is replaced by the target's token (the correction) and, when all γ agree, the
target's choice after d_γ comes for free (the bonus token). Every emitted token is therefore a
target argmax given a prefix that is itself target-greedy, i.e. exactly autoregressive output.
"""

import numpy as np


def greedy_accept(target_tokens: np.ndarray, draft_tokens: np.ndarray, past_len: np.ndarray):
    """target_tokens [B, γ+1] (target argmax after each input), draft_tokens [B, γ], past_len [B].

    Returns (accepted [B], next_token [B], new_len [B]):
      accepted  n: length of the leading run where draft_tokens[:, j] == target_tokens[:, j]
      next_token: target_tokens[:, n]  (correction, or bonus when n == γ)
      new_len:   past_len + n + 1      (the last accepted token and the n drafts stay cached)
    """
    gamma = draft_tokens.shape[1]
    assert target_tokens.shape[1] == gamma + 1, f"target_tokens has {target_tokens.shape[1]} columns, expected γ+1 = {gamma + 1}"
    matches = draft_tokens == target_tokens[:, :gamma]
    accepted = np.cumprod(matches, axis=1).sum(axis=1).astype(np.int64)
    next_token = np.take_along_axis(target_tokens, accepted[:, None], axis=1)[:, 0]
    return accepted, next_token.astype(np.int64), (past_len + accepted + 1).astype(np.int64)
