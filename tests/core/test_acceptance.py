"""The numpy reference of the acceptance rules: the greedy rule on hand-worked cases, per-row draft
lengths (a row with k real drafts is verified as at γ = k, whatever its pad slots hold), and the
sampling rule's output distribution, which must be exactly the target's."""

import numpy as np
import pytest

from speccompile.core.acceptance import greedy_accept, sample_accept
from speccompile.core.sampling import sample_from


def run(target_tokens, draft_tokens, past_len, draft_len=None):
    draft_len = None if draft_len is None else np.array(draft_len)
    return greedy_accept(np.array(target_tokens), np.array(draft_tokens), np.array(past_len), draft_len)


def test_all_accepted_takes_the_bonus_token():
    accepted, next_token, new_len = run([[5, 6, 7, 8]], [[5, 6, 7]], [10])
    assert accepted.tolist() == [3]
    assert next_token.tolist() == [8]  # the target's choice after d_3: free
    assert new_len.tolist() == [14]  # last + 3 drafts stay cached


def test_none_accepted_takes_the_correction():
    accepted, next_token, new_len = run([[5, 6, 7, 8]], [[9, 6, 7]], [10])
    assert accepted.tolist() == [0]
    assert next_token.tolist() == [5]
    assert new_len.tolist() == [11]  # only `last` stays cached


def test_acceptance_stops_at_first_mismatch_even_if_later_drafts_match():
    accepted, next_token, _ = run([[5, 6, 7, 8]], [[5, 0, 7]], [0])
    assert accepted.tolist() == [1]
    assert next_token.tolist() == [6]


def test_mixed_batch_each_row_independent():
    target = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
    drafts = [[1, 2, 3], [9, 2, 3], [1, 2, 9]]
    accepted, next_token, new_len = run(target, drafts, [3, 7, 0])
    assert accepted.tolist() == [3, 0, 2]
    assert next_token.tolist() == [4, 1, 3]
    assert new_len.tolist() == [7, 8, 3]


def test_gamma_one():
    accepted, next_token, new_len = run([[4, 2], [4, 2]], [[4], [3]], [5, 5])
    assert accepted.tolist() == [1, 0]
    assert next_token.tolist() == [2, 4]
    assert new_len.tolist() == [7, 6]


# ---- greedy, per-row draft length ----------------------------------------------------------------


def test_a_row_accepts_at_most_its_draft_len_and_takes_the_targets_token_after_it():
    target, drafts = [[5, 6, 7, 8]] * 4, [[5, 6, 7]] * 4  # every draft agrees with the target
    accepted, next_token, new_len = run(target, drafts, [10, 10, 10, 10], draft_len=[0, 1, 2, 3])
    assert accepted.tolist() == [0, 1, 2, 3]
    assert next_token.tolist() == [5, 6, 7, 8]  # t_k: the target's own token after the last real draft
    assert new_len.tolist() == [11, 12, 13, 14]


def test_a_mismatch_before_draft_len_still_ends_the_run():
    target, drafts = [[5, 6, 7, 8]] * 3, [[5, 0, 7]] * 3
    accepted, next_token, _ = run(target, drafts, [0, 0, 0], draft_len=[3, 2, 1])
    assert accepted.tolist() == [1, 1, 1]
    assert next_token.tolist() == [6, 6, 6]  # the correction at d_2, or (k = 1) the token after d_1


def test_greedy_pads_never_count_whatever_they_hold():
    target = [[5, 6, 7, 8], [5, 6, 7, 8]]
    agreeing, garbage = [[5, 6, 7], [5, 6, 7]], [[5, -1, 10**9], [5, 6, 0]]
    for drafts in (agreeing, garbage):
        accepted, next_token, new_len = run(target, drafts, [3, 3], draft_len=[1, 2])
        assert (accepted.tolist(), next_token.tolist(), new_len.tolist()) == ([1, 2], [6, 7], [5, 6])


# ---- sampling ------------------------------------------------------------------------------------


def naive_sample_accept(p, q, drafts, u_accept, u_sample, past_len, draft_len):
    """The rule for one row at a time, as the paper writes it: the tests' second implementation."""
    out = []
    for b, k in enumerate(draft_len):
        n = 0
        while n < k and u_accept[b, n] * q[b, n, drafts[b, n]] < p[b, n, drafts[b, n]]:
            n += 1
        weights = p[b, n] if n == k else np.maximum(p[b, n] - q[b, n], 0)
        weights = weights if weights.sum() > 0 else p[b, n]
        out.append((n, int(sample_from(weights[None], u_sample[b : b + 1])[0]), past_len[b] + n + 1))
    return tuple(np.array(column) for column in zip(*out))


def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def sampling_case(rng, batch, gamma, vocab):
    """p, q and drafts d_j ~ q_j (every slot drawn, as a draft that withheld some would have), the
    uniforms, past_len, and draft lengths covering 0 and γ."""
    p = softmax(2 * rng.standard_normal((batch, gamma + 1, vocab)))
    q = softmax(np.log(p[:, :gamma]) + rng.standard_normal((batch, gamma, vocab)))
    drafts = np.stack([sample_from(q[:, j], rng.random(batch, dtype=np.float32)) for j in range(gamma)], axis=1)
    draft_len = rng.integers(0, gamma + 1, size=batch)
    draft_len[:2] = [0, gamma]
    return {"target_probs": p, "draft_probs": q, "draft_tokens": drafts, "draft_len": draft_len,
            "u_accept": rng.random((batch, gamma), np.float32), "u_sample": rng.random(batch, np.float32),
            "past_len": rng.integers(0, 50, batch)}


def assert_same(got, want):
    for name, a, b in zip(("accepted", "next_token", "new_len"), got, want):
        assert a.tolist() == b.tolist(), name


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_sample_accept_equals_the_row_by_row_rule(gamma):
    case = sampling_case(np.random.default_rng(gamma), 256, gamma, 7)
    p, q, drafts = case["target_probs"], case["draft_probs"], case["draft_tokens"]
    u_accept, u_sample, past_len, draft_len = (case[k] for k in ("u_accept", "u_sample", "past_len", "draft_len"))
    assert_same(sample_accept(**case), naive_sample_accept(p, q, drafts, u_accept, u_sample, past_len, draft_len))
    full = {**case, "draft_len": np.full(256, gamma)}
    assert_same(sample_accept(**full), sample_accept(**{**case, "draft_len": None}))  # draft_len = γ: the plain rule


@pytest.mark.parametrize("sample", [False, True])
def test_a_row_is_verified_as_at_gamma_equal_to_its_draft_len(sample):
    gamma = 4
    case = sampling_case(np.random.default_rng(1), 64, gamma, 9)
    got = accept_rows(case, sample)
    for b, k in enumerate(case["draft_len"]):
        alone = {name: value[b : b + 1] for name, value in case.items()}
        for name in ("target_probs", "draft_probs", "draft_tokens", "u_accept"):  # cut to γ = k
            alone[name] = alone[name][:, : k + 1 if name == "target_probs" else k]
        want = accept_rows({**alone, "draft_len": None}, sample)
        assert [int(out[b]) for out in got] == [int(out[0]) for out in want], (b, k)


def accept_rows(case, sample: bool):
    if sample:
        return sample_accept(**case)
    # the greedy rule on the same data: the target's argmax, and drafts that are its choices where u < 0.7
    target_tokens = case["target_probs"].argmax(-1)
    agree = case["u_accept"] < 0.7
    drafts = np.where(agree, target_tokens[:, :-1], case["draft_tokens"])
    return greedy_accept(target_tokens, drafts, case["past_len"], case["draft_len"])


def test_pad_slots_do_not_matter_whatever_they_hold():
    gamma, batch = 4, 128
    case = sampling_case(np.random.default_rng(2), batch, gamma, 9)
    pads = np.arange(gamma)[None, :] >= case["draft_len"][:, None]  # [B, γ]
    garbage = {**case, "draft_tokens": np.where(pads, np.int64(-3), case["draft_tokens"])}
    garbage["draft_tokens"][pads & (np.arange(batch)[:, None] % 2 == 0)] = 10**9  # not a token id
    garbage["draft_probs"] = np.where(pads[..., None], np.float32(np.nan), case["draft_probs"])
    garbage["u_accept"] = np.where(pads, np.float32(0), case["u_accept"])  # u = 0 would accept anything
    zeros = {**case, "draft_probs": np.where(pads[..., None], np.float32(0), case["draft_probs"])}
    want = sample_accept(**case)
    assert_same(sample_accept(**garbage), want)
    assert_same(sample_accept(**zeros), want)


# ---- sampling: the emitted tokens follow the target exactly -------------------------------------------

P = np.array([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.1, 0.3, 0.2, 0.3], [0.05, 0.6, 0.05, 0.1, 0.2]], np.float32)
Q = np.array([[0.1, 0.1, 0.2, 0.4, 0.2], [0.4, 0.3, 0.1, 0.1, 0.1]], np.float32)  # far from P: many rejections
ROWS = 200_000


def frequencies(tokens, vocab=P.shape[1]):
    return np.bincount(tokens, minlength=vocab) / len(tokens)


def assert_follows(tokens, p):
    """Frequencies within 5 standard errors of p (a fixed seed: deterministic, and far from the edge)."""
    bound = 5 * np.sqrt(p * (1 - p) / len(tokens)) + 1e-9
    assert (np.abs(frequencies(tokens) - p) <= bound).all(), (frequencies(tokens), p)


@pytest.mark.parametrize("draft_len", [0, 1, 2])
def test_sampled_tokens_follow_the_target_with_fewer_drafts_than_gamma(draft_len):
    """γ = 2, a fixed target p_j and draft q_j per position. A row proposing k drafts emits d_1..d_n
    and then one token: the first emitted token must be ~ p_0 and, when all k were accepted, the token
    after them ~ p_k (the bonus rule: q_k := 0). The pad slots hold the draft's real q and a real draw
    from it, as after confidence thresholding: taking them for a proposal would sample the k-th token
    from the residual max(0, p_k - q_k) instead, which is far from p_k here."""
    rng = np.random.default_rng(draft_len)
    gamma, vocab = Q.shape
    p = np.broadcast_to(P, (ROWS, gamma + 1, vocab))
    q = np.broadcast_to(Q, (ROWS, gamma, vocab))
    drafts = np.stack([sample_from(q[:, j], rng.random(ROWS, dtype=np.float32)) for j in range(gamma)], axis=1)
    accepted, next_token, _ = sample_accept(p, q, drafts, rng.random((ROWS, gamma), np.float32),
                                            rng.random(ROWS, np.float32), np.zeros(ROWS, np.int64),
                                            np.full(ROWS, draft_len))
    assert accepted.max() == draft_len
    first = drafts[:, 0] if draft_len else next_token
    assert_follows(np.where(accepted > 0, first, next_token), P[0])
    assert_follows(next_token[accepted == draft_len], P[draft_len])
    if draft_len < gamma:  # the test can tell: the residual at the pad is a different distribution
        residual = np.maximum(P[draft_len] - Q[draft_len], 0)
        assert np.abs(residual / residual.sum() - P[draft_len]).max() > 0.1
