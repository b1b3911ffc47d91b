"""Numpy reference of the acceptance rule: the oracle for the in-graph SpecAccept op and the plugin.

Greedy speculative decoding is lossless by construction: the target scored [last, d_1..d_γ] in one
pass, so target_tokens[:, j] is the token the target itself would emit after input j. Draft d_j is
kept only while every earlier draft was kept and d_j equals the target's own choice at that point;
the first disagreement is replaced by the target's token (the correction) and, when all γ agree, the
target's choice after d_γ comes for free (the bonus token). Every emitted token is therefore a
target argmax given a prefix that is itself target-greedy, i.e. exactly autoregressive output.
"""

import numpy as np

from speccompile.core.sampling import sample_from


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


def sample_accept(target_probs, draft_probs, draft_tokens, u_accept, u_sample, past_len):
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), batched.

    target_probs p [B, γ+1, V] and draft_probs q [B, γ, V] are the transformed distributions the
    target and the draft had at each position; d_j was drawn from q_j.

      accept d_j  iff  u_j * q_j(d_j) < p_j(d_j)      i.e. with probability min(1, p_j(d_j) / q_j(d_j))
      n = the leading run of accepts
      n < γ:  next ~ normalise(max(0, p_n - q_n))     the residual: what p has that q over-proposed
      n = γ:  next ~ p_γ                              the bonus token

    Why this is exact: P(emit x at position j) = q(x) min(1, p(x)/q(x)) + P(reject) r(x)
    = min(q(x), p(x)) + (1 - sum_y min(q(y), p(y))) * max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)),
    and since sum_y max(0, p - q) = 1 - sum_y min(p, q), this is min(p, q) + max(0, p - q) = p(x).
    With one-hot p and q (temperature 0) the rule is exactly the greedy rule.

    Returns (accepted [B], next_token [B], new_len [B]) like `greedy_accept`.
    """
    p, q = np.asarray(target_probs, np.float32), np.asarray(draft_probs, np.float32)
    batch, gamma = draft_tokens.shape
    rows = np.arange(batch)[:, None]
    positions = np.arange(gamma)[None, :]
    p_d, q_d = p[rows, positions, draft_tokens], q[rows, positions, draft_tokens]
    accepts = np.asarray(u_accept, np.float32) * q_d < p_d
    accepted = np.cumprod(accepts, axis=1).sum(axis=1).astype(np.int64)
    p_n = p[np.arange(batch), accepted]  # [B, V]: p at the first rejection, or p_γ
    q_n = np.concatenate([q, np.zeros_like(q[:, :1])], axis=1)[np.arange(batch), accepted]  # q_γ := 0
    residual = np.maximum(p_n - q_n, 0.0)
    # p == q leaves no residual; rejection then has probability 0, but keep a valid distribution.
    residual = np.where(residual.sum(-1, keepdims=True) > 0, residual, p_n)
    next_token = sample_from(residual, u_sample)
    return accepted, next_token, (np.asarray(past_len) + accepted + 1).astype(np.int64)
