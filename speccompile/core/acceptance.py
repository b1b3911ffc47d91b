"""Numpy reference of the acceptance rule: the oracle for the in-graph SpecAccept op and the plugin.

Greedy speculative decoding is lossless by construction: the target scored [last, d_1..d_γ] in one
pass, so target_tokens[:, j] is the token the target itself would emit after input j. Draft d_j is
kept only while every earlier draft was kept and d_j equals the target's own choice at that point;
the first disagreement is replaced by the target's token (the correction) and, when all γ agree, the
target's choice after d_γ comes for free (the bonus token). Every emitted token is therefore a
target argmax given a prefix that is itself target-greedy, i.e. exactly autoregressive output.

Per-row draft length. A batch verified in one pass has one γ, but a row may carry only k = draft_len[b]
real drafts (0 <= k <= γ) and pad the other slots. Its result is that of a verification of
[last, d_1..d_k] at γ = k: the target is causal, so t_0..t_k (or p_0..p_k) read inputs 0..k only and
the pads cannot change them; pads are never proposals, so n <= k and the token after n comes from
position n <= k; the pads' cache entries sit at or past new_len, dead like any rejected draft's. So
every proof below holds row by row with γ := k, and k = γ everywhere is the plain rule.
"""

import numpy as np

from speccompile.core.sampling import gumbel_argmax, sample_from


def proposed(draft_len, batch: int, gamma: int) -> np.ndarray:
    """[B, γ] bool: slot j of row b holds a real draft (j < draft_len[b]); None means all γ do."""
    if draft_len is None:
        return np.ones((batch, gamma), bool)
    return np.arange(gamma)[None, :] < np.asarray(draft_len, np.int64)[:, None]


def leading_run(kept: np.ndarray) -> np.ndarray:
    """[B]: the number of leading True values of each row of kept [B, γ]."""
    return np.cumprod(kept, axis=1).sum(axis=1).astype(np.int64)


def greedy_accept(target_tokens: np.ndarray, draft_tokens: np.ndarray, past_len: np.ndarray, draft_len=None):
    """target_tokens [B, γ+1] (target argmax after each input), draft_tokens [B, γ], past_len [B],
    draft_len [B] (real drafts per row, 0..γ; None = γ; the slots after them may hold anything).

    Returns (accepted [B], next_token [B], new_len [B]):
      accepted  n: min(leading run where draft_tokens[:, j] == target_tokens[:, j], draft_len)
      next_token: target_tokens[:, n]  (correction, or the target's own token after the last real
                                        draft when n == draft_len: the bonus token when that is γ)
      new_len:   past_len + n + 1      (the last accepted token and the n drafts stay cached)
    """
    batch, gamma = draft_tokens.shape
    assert target_tokens.shape[1] == gamma + 1, \
        f"target_tokens has {target_tokens.shape[1]} columns, expected γ+1 = {gamma + 1}"
    matches = (draft_tokens == target_tokens[:, :gamma]) & proposed(draft_len, batch, gamma)
    accepted = leading_run(matches)
    next_token = np.take_along_axis(target_tokens, accepted[:, None], axis=1)[:, 0]
    return accepted, next_token.astype(np.int64), (past_len + accepted + 1).astype(np.int64)


def sample_accept(target_probs, draft_probs, draft_tokens, u_accept, u_sample, past_len, draft_len=None):
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023), batched.

    target_probs p [B, γ+1, V] and draft_probs q [B, γ, V] are the transformed distributions the
    target and the draft had at each position; d_j was drawn from q_j. Row b proposes its first
    k = draft_len[b] drafts (None: all γ); its later slots, tokens and q rows alike, are ignored.

      accept d_j  iff  j < k  and  u_j * q_j(d_j) < p_j(d_j)    i.e. w.p. min(1, p_j(d_j) / q_j(d_j))
      n = the leading run of accepts                           (so n <= k)
      n < k:  next ~ normalise(max(0, p_n - q_n))     the residual: what p has that q over-proposed
      n = k:  next ~ p_k                              the bonus token (q_k := 0); k = 0 is plain sampling

    Why this is exact: P(emit x at position j) = q(x) min(1, p(x)/q(x)) + P(reject) r(x)
    = min(q(x), p(x)) + (1 - sum_y min(q(y), p(y))) * max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y)),
    and since sum_y max(0, p - q) = 1 - sum_y min(p, q), this is min(p, q) + max(0, p - q) = p(x).
    At j = k nothing was proposed and x ~ p_k directly. With one-hot p and q (temperature 0) the rule
    is exactly the greedy rule.

    Returns (accepted [B], next_token [B], new_len [B]) like `greedy_accept`.
    """
    p, q = np.asarray(target_probs, np.float32), np.asarray(draft_probs, np.float32)
    batch, gamma = draft_tokens.shape
    real = proposed(draft_len, batch, gamma)
    rows, positions = np.arange(batch)[:, None], np.arange(gamma)[None, :]
    drafts = np.where(real, draft_tokens, 0)  # a pad slot may hold any integer: never index with it
    p_d, q_d = p[rows, positions, drafts], q[rows, positions, drafts]
    accepted = leading_run((np.asarray(u_accept, np.float32) * q_d < p_d) & real)
    p_n = p[np.arange(batch), accepted]  # [B, V]: p at the first rejection, or p_k
    q_n = np.concatenate([q, np.zeros_like(p[:, :1])], axis=1)[np.arange(batch), accepted]
    q_n = np.where(real.sum(axis=1, keepdims=True) > accepted[:, None], q_n, 0.0)  # q_k := 0
    residual = np.maximum(p_n - q_n, 0.0)
    # p == q leaves no residual; rejection then has probability 0, but keep a valid distribution.
    residual = np.where(residual.sum(-1, keepdims=True) > 0, residual, p_n)
    next_token = sample_from(residual, u_sample)
    return accepted, next_token, (np.asarray(past_len) + accepted + 1).astype(np.int64)


def coupled_accept(target_probs, draft_tokens, noise, past_len, draft_len=None):
    """The coupled rule (drafter-invariant speculative sampling; Daliri, Musco and Suresh 2024): the
    target draws every position itself by the Gumbel-max trick, t_j = argmax_x log p_j(x) + G_j(x)
    with G_j = -log(-log u_j) from the noise u_j [V] of that position, and drafts are kept while they
    equal its draws: the greedy rule on t,

      n    = min(leading run of d_{j+1} == t_j, k)
      next = t_n

    Every emitted token is t_j for its own position j, so the output is a function of p and the noise
    alone: the proposals decide only how many tokens one pass yields. When a request's noise is keyed
    by output position (core/request.py), its tokens equal those of sampling the target
    autoregressively by Gumbel-max with the same noise, whatever γ, proposer or batch produced them;
    each token is a Gumbel-max draw from p with fresh noise, so the output is distributed exactly as
    p. A draft model that proposes by Gumbel-max with the same noise agrees with t_j with probability
    at least (1 - TV) / (1 + TV) for the total variation TV between p_j and q_j, against 1 - TV for
    rejection sampling; point proposals (lookups) are kept when they equal the target's draw.
    noise: [B, γ+1, V] uniforms in [0, 1).
    """
    target_tokens = gumbel_argmax(target_probs, noise)  # [B, γ+1]
    return greedy_accept(target_tokens, np.asarray(draft_tokens), np.asarray(past_len), draft_len)
