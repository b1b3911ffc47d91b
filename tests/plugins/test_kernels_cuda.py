"""The speccompile CUDA kernels against the numpy oracle, on a CUDA device.

The oracle is speccompile.core.acceptance (greedy_accept, sample_accept),
speccompile.core.sampling (sample_from, transform) and speccompile.core.tree (tree_accept,
typical_accept). Sampling compares exactly, not statistically: the kernels repeat numpy's fp32
operations in numpy's order, so the same uniforms must pick the same tokens. The transform's
probabilities agree to fp32 rounding (exp and the softmax sum differ from numpy's), and its kept set
exactly; the typical tree rule agrees exactly on inputs whose decisions do not move when its
thresholds move by far more than that rounding.
"""

import numpy as np
import pytest

from speccompile.core.acceptance import greedy_accept, sample_accept
from speccompile.core.sampling import sample_from, transform
from speccompile.core.tree import TokenTree, grow_tree, tree_accept, typical_accept
from tests.plugins import kernels_lib

NO_DEVICE = kernels_lib.no_cuda_device_reason()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(NO_DEVICE is not None, reason=str(NO_DEVICE))]

SHAPES = [(1, 1, 2), (2, 0, 16), (5, 3, 50), (4, 4, 1000), (3, 4, 8192)]  # (B, γ, V)
SAMPLE_SHAPES = [shape for shape in SHAPES if shape[1] > 0]  # k = 0 is covered by rows with draft_len 0
SAMPLE_KINDS = ["mixed", "all_accepted", "none_accepted", "one_hot", "p_equals_q"]
DRAFT_LENS = ["gamma", "per_row"]  # every row proposes γ drafts (the rule before draft_len), or its own number


@pytest.fixture(scope="module")
def kernels(kernels_library):
    return kernels_lib.load_kernels(kernels_library(kernels_lib.device_arch()))


@pytest.fixture
def device():
    dev = kernels_lib.open_device()
    yield dev
    dev.free()


def assert_same(got, want):
    assert len(got) == len(want)
    for name, g, w in zip(["accepted", "next_token", "new_len", "best_node"], got, want):
        np.testing.assert_array_equal(g, w, err_msg=name)


# ---- inputs ---------------------------------------------------------------------------------------


def softmax(logits):
    e = np.exp(logits - logits.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


def one_hot(tokens, vocab):
    return np.eye(vocab, dtype=np.float32)[tokens]


def uniforms(rng, batch):
    """Uniforms in [0, 1), with both ends of the range represented."""
    u = rng.random(batch, dtype=np.float32)
    u[0], u[-1] = 0.0, np.nextafter(np.float32(1), np.float32(0))
    return u


def drafts_with_runs(rng, target_tokens, vocab):
    """Drafts agreeing with the target for a random leading run; row 0 all, row 1 none."""
    batch, gamma = target_tokens.shape[0], target_tokens.shape[1] - 1
    runs = rng.integers(0, gamma + 1, size=batch)
    runs[0] = gamma
    if batch > 1:
        runs[1] = 0
    drafts = rng.integers(0, vocab, size=(batch, gamma))
    for row, n in enumerate(runs):
        drafts[row, :n] = target_tokens[row, :n]
        if n < gamma:
            drafts[row, n] = (target_tokens[row, n] + 1) % vocab  # the first mismatch
    return drafts


def draft_lengths(rng, kind, batch, gamma):
    """draft_len [B]: γ everywhere, or per row in 0..γ with rows 0 and 1 at γ and (when B > 2) row 2 at 0."""
    if kind == "gamma":
        return np.full(batch, gamma, np.int64)
    draft_len = rng.integers(0, gamma + 1, size=batch)
    draft_len[: min(batch, 3)] = [gamma, gamma, 0][: min(batch, 3)]
    return draft_len


def padded(rng, draft_tokens, draft_probs, draft_len, vocab):
    """The pad slots after each row's draft_len filled with what no kernel may read: ids that are no token
    and, in odd rows, NaN draft probabilities (even rows keep the draft's own q, which a kernel that took
    the slot for a proposal would subtract from p_k)."""
    batch, gamma = draft_tokens.shape
    pads = np.arange(gamma)[None, :] >= draft_len[:, None]
    tokens = np.where(pads, np.where(rng.random(pads.shape) < 0.5, -1, vocab + 5), draft_tokens)
    if draft_probs is None:
        return tokens, None
    odd = np.arange(batch)[:, None] % 2 == 1
    return tokens, np.where((pads & odd)[..., None], np.float32(np.nan), draft_probs)


def draw_drafts(rng, q):
    """d_j ~ q_j, the way the draft model proposes."""
    batch, gamma, _ = q.shape
    drafts = np.zeros((batch, gamma), np.int64)
    for j in range(gamma):
        drafts[:, j] = sample_from(q[:, j], rng.random(batch, dtype=np.float32))
    return drafts


def sample_case(rng, kind, batch, gamma, vocab):
    """(p, q, draft_tokens, u_accept) for one kind of batch."""
    target_logits = 2 * rng.standard_normal((batch, gamma + 1, vocab))
    p = softmax(target_logits)
    q = softmax(target_logits[:, :gamma] + rng.standard_normal((batch, gamma, vocab)))  # a draft that mostly agrees
    u_accept = rng.random((batch, gamma), dtype=np.float32)
    if kind == "all_accepted":  # u = 0 accepts every draft p gives mass to: all of them under a softmax
        u_accept[:] = 0
    if kind == "none_accepted":  # p puts no mass on d_1: rejected, and the residual is p_0's one-hot
        tokens = rng.integers(0, vocab, size=(batch, gamma + 1))
        p, q = one_hot(tokens, vocab), one_hot((tokens[:, :gamma] + 1) % vocab, vocab)
    if kind == "one_hot":  # temperature 0 on both sides: the greedy rule
        tokens = rng.integers(0, vocab, size=(batch, gamma + 1))
        proposed = np.where(rng.random((batch, gamma)) < 0.3, (tokens[:, :gamma] + 1) % vocab, tokens[:, :gamma])
        p, q = one_hot(tokens, vocab), one_hot(proposed, vocab)
    if kind == "p_equals_q":  # no residual: rows drafting a zero-mass token fall back to p_n
        keep = rng.random((batch, gamma + 1, vocab)) < 0.5
        keep[..., 0] = True
        p = softmax(np.where(keep, 2 * rng.standard_normal(keep.shape), -np.inf))
        q = p[:, :gamma].copy()
    drafts = draw_drafts(rng, q)
    if kind == "p_equals_q":
        for row in range(0, batch, 2):
            zero_mass = np.flatnonzero(p[row, 0] == 0)
            if zero_mass.size:
                drafts[row, 0] = zero_mass[0]
    return p, q, drafts, u_accept


# ---- greedy ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("draft_lens", DRAFT_LENS)
@pytest.mark.parametrize("batch,gamma,vocab", SHAPES)
def test_greedy_accept_equals_reference(kernels, device, batch, gamma, vocab, draft_lens):
    rng = np.random.default_rng([batch, gamma, vocab, DRAFT_LENS.index(draft_lens)])
    logits = rng.standard_normal((batch, gamma + 1, vocab)).astype(np.float32)
    if vocab <= 64:
        logits = np.round(logits)  # many ties: the first maximum must win
    draft_len = draft_lengths(rng, draft_lens, batch, gamma)
    drafts, _ = padded(rng, drafts_with_runs(rng, logits.argmax(-1), vocab), None, draft_len, vocab)
    past_len = rng.integers(0, 100, size=batch)
    got = kernels_lib.greedy_accept(kernels, device, logits, drafts, draft_len, past_len)
    assert_same(got, greedy_accept(logits.argmax(-1), drafts, past_len, draft_len))
    assert got[0][0] == gamma  # row 0's drafts all agree with the target


def test_greedy_argmax_takes_the_first_maximum(kernels, device):
    vocab = 300
    logits = np.zeros((3, 3, vocab), np.float32)  # row 0: all equal -> token 0
    logits[1, :, [7, 250]] = 5.0  # row 1: a tie at 7 and 250 -> 7
    logits[2] = -np.inf  # row 2: all -inf -> token 0
    drafts = np.array([[0, 0], [7, 250], [0, 1]])
    draft_len, past_len = np.full(3, 2), np.array([3, 4, 5])
    got = kernels_lib.greedy_accept(kernels, device, logits, drafts, draft_len, past_len)
    want = greedy_accept(logits.argmax(-1), drafts, past_len, draft_len)
    assert_same(got, want)
    assert got[0].tolist() == [2, 1, 1] and got[1].tolist() == [0, 7, 0]


# ---- speculative sampling ---------------------------------------------------------------------------


@pytest.mark.parametrize("draft_lens", DRAFT_LENS)
@pytest.mark.parametrize("kind", SAMPLE_KINDS)
@pytest.mark.parametrize("batch,gamma,vocab", SAMPLE_SHAPES)
def test_sample_accept_equals_reference(kernels, device, kind, batch, gamma, vocab, draft_lens):
    rng = np.random.default_rng([batch, gamma, vocab, SAMPLE_KINDS.index(kind), DRAFT_LENS.index(draft_lens)])
    p, q, drafts, u_accept = sample_case(rng, kind, batch, gamma, vocab)
    draft_len = draft_lengths(rng, draft_lens, batch, gamma)
    drafts, q = padded(rng, drafts, q, draft_len, vocab)
    u_sample, past_len = uniforms(rng, batch), rng.integers(0, 100, size=batch)
    got = kernels_lib.sample_accept(kernels, device, p, q, drafts, draft_len, u_accept, u_sample, past_len)
    want = sample_accept(p, q, drafts, u_accept, u_sample, past_len, draft_len)
    assert_same(got, want)
    if kind == "all_accepted":
        assert got[0].tolist() == draft_len.tolist()
    if kind == "none_accepted":
        assert got[0].tolist() == [0] * batch


# ---- plain sampling ---------------------------------------------------------------------------------


def sample_weights(rng, kind, batch, vocab):
    if kind == "softmax":
        return softmax(3 * rng.standard_normal((batch, vocab)))
    if kind == "sparse":  # zeros are never drawn
        keep = rng.random((batch, vocab)) < 0.1
        keep[:, -1] = True
        return softmax(np.where(keep, rng.standard_normal((batch, vocab)), -np.inf))
    if kind == "one_hot":
        return one_hot(rng.integers(0, vocab, size=batch), vocab)
    if kind == "boundaries":  # uniform weights: u lands exactly on CDF steps
        return np.full((batch, vocab), 1.0 / vocab, np.float32)
    return (3 * rng.random((batch, vocab))).astype(np.float32)  # unnormalised


@pytest.mark.parametrize("kind", ["softmax", "sparse", "one_hot", "boundaries", "unnormalised"])
@pytest.mark.parametrize("batch,vocab", [(1, 2), (8, 50), (4, 8192)])
def test_sample_equals_reference(kernels, device, kind, batch, vocab):
    rng = np.random.default_rng([batch, vocab, len(kind)])
    probs = sample_weights(rng, kind, batch, vocab)
    u = (np.arange(batch, dtype=np.float32) / batch) if kind == "boundaries" else uniforms(rng, batch)
    np.testing.assert_array_equal(kernels_lib.sample(kernels, device, probs, u), sample_from(probs, u))


# ---- sampling transform -------------------------------------------------------------------------------

TRANSFORM_SETTINGS = [  # (temperature, top_k, top_p), one per batch entry
    (0.0, 0, 1.0),  # greedy: one-hot on the first maximum
    (1.0, 0, 1.0),  # plain softmax
    (0.7, 5, 1.0),
    (1.3, 0, 0.8),
    (0.5, 3, 0.5),
    (2.0, 40, 0.95),
    (1.0, 0, 0.0),  # top_p 0: the most likely token and its ties
    (1.0, -1, 0.9),  # top_k <= 0: no top-k cut
    (0.9, 2**40, 0.99),  # top_k >= V: no top-k cut
    (1.0, 1, 1.0),  # top_k 1: the maximum and its ties
    (3.0, 1000, 0.999),
    (4.0, 0, 0.999),  # nearly flat: at large V the top-p walk runs over several chunks
]
TRANSFORM_KINDS = ["normal", "ties", "masked"]


def transform_logits(rng, kind, batch, rows, vocab):
    if kind == "ties":  # few distinct values: ties at the top-k and top-p thresholds
        return np.round(2 * rng.standard_normal((batch, rows, vocab))).astype(np.float32)
    logits = 3 * rng.standard_normal((batch, rows, vocab))
    if kind == "masked":  # -inf logits (banned tokens) end with probability 0
        logits[rng.random(logits.shape) < 0.3] = -np.inf
        logits[..., 0] = 1.0
    return logits.astype(np.float32)


def transform_params(settings):
    """temperature, top_k, top_p arrays ([B] each) for a list of settings."""
    columns = zip(*settings)
    return tuple(np.array(column, dtype) for column, dtype in zip(columns, (np.float32, np.int64, np.float32)))


@pytest.mark.parametrize("kind", TRANSFORM_KINDS)
@pytest.mark.parametrize("vocab", [7, 64, 8192, 50257])
def test_transform_equals_reference(kernels, device, vocab, kind):
    rng = np.random.default_rng([vocab, TRANSFORM_KINDS.index(kind)])
    logits = transform_logits(rng, kind, len(TRANSFORM_SETTINGS), 3, vocab)
    temperature, top_k, top_p = transform_params(TRANSFORM_SETTINGS)
    probs = kernels_lib.transform(kernels, device, logits, temperature, top_k, top_p)
    for b, setting in enumerate(TRANSFORM_SETTINGS):
        # the fp32 values the kernel saw
        want = transform(logits[b], float(temperature[b]), int(top_k[b]), float(top_p[b]))
        np.testing.assert_allclose(probs[b], want, rtol=0, atol=1e-6, err_msg=f"probabilities for {setting}")
        np.testing.assert_array_equal(probs[b] > 0, want > 0, err_msg=f"kept tokens for {setting}")


def test_transform_may_overwrite_its_logits(kernels, device):
    rng = np.random.default_rng(7)
    logits = transform_logits(rng, "normal", 3, 2, 1000)
    params = transform_params([(0.0, 0, 1.0), (0.8, 50, 0.9), (1.0, 0, 0.95)])
    in_place = kernels_lib.transform(kernels, device, logits, *params, in_place=True)
    np.testing.assert_array_equal(in_place, kernels_lib.transform(kernels, device, logits, *params))


# ---- token trees --------------------------------------------------------------------------------------

HEAD_ACCURACY = [[0.6, 0.2, 0.1, 0.05, 0.03, 0.02, 0.01, 0.01]] * 5  # 5 heads, 8 candidates each
TREES = {
    "root": TokenTree.from_paths([]),
    "chain": TokenTree.chain(4),
    "small": grow_tree(HEAD_ACCURACY, 9),
    "medusa": grow_tree(HEAD_ACCURACY, 63),
    "largest": grow_tree(HEAD_ACCURACY, kernels_lib.MAX_TREE_NODES - 1),
}
TREE_SHAPES = [("root", 2, 16), ("chain", 5, 50), ("small", 6, 1000), ("medusa", 5, 8192), ("largest", 2, 64)]
TREE_DRAFT_LENS = ["all", "per_row"]


def tree_draft_lengths(rng, kind, batch, size):
    """draft_len [B]: every node, or per row with rows 0 and 1 at all nodes, row 2 at none, and rows past
    that anywhere in -2..N+2 (outside 0..N-1 the kernels clamp, as the graph's comparison does)."""
    if kind == "all":
        return np.full(batch, size - 1, np.int64)
    draft_len = rng.integers(-2, size + 3, size=batch)
    draft_len[: min(batch, 3)] = [size - 1, size - 1, 0][: min(batch, 3)]
    return draft_len


def unverified(rng, logits, tokens, draft_len):
    """The nodes past each row's draft_len filled with what no kernel may read: ids that are no token and,
    in odd rows, NaN logits."""
    batch, size, vocab = logits.shape
    pads = np.arange(size)[None, :] > draft_len[:, None]
    tokens = np.where(pads, np.where(rng.random(pads.shape) < 0.5, -1, vocab + 5), tokens)
    odd = np.arange(batch)[:, None] % 2 == 1
    return np.where((pads & odd)[..., None], np.float32(np.nan), logits), tokens


def greedy_tree_tokens(rng, target_tokens, tree, vocab, agree=0.75):
    """[B, N]: each node the target's choice after its parent with probability `agree`, else another token;
    row 0 agrees everywhere, so its deepest node is accepted. The root's token is never checked."""
    choice = target_tokens[:, tree.parents]
    other = (choice + rng.integers(1, vocab, size=choice.shape)) % vocab
    tokens = np.where(rng.random(choice.shape) < agree, choice, other)
    tokens[0] = choice[0]
    tokens[:, 0] = rng.integers(0, vocab, size=len(tokens))
    return tokens


def typical_tree_tokens(rng, logits, tree, vocab):
    """[B, N]: each node the most likely token after its parent, the second most likely, or any token."""
    ranked = np.argsort(-logits, axis=-1, kind="stable")[:, tree.parents, :2]  # [B, N, 2]
    pick = rng.integers(0, 3, size=ranked.shape[:2])
    return np.where(pick == 2, rng.integers(0, vocab, size=pick.shape), np.take_along_axis(
        ranked, np.minimum(pick, 1)[..., None], axis=2)[..., 0])


def tree_case(rng, name, batch, vocab, draft_lens):
    tree = TREES[name]
    # rows from nearly flat to peaked, so the typical thresholds range over min(ε, δ·exp(-H))
    scale = np.array([0.5, 2.0, 6.0])[np.arange(batch) % 3][:, None, None]
    logits = (scale * rng.standard_normal((batch, tree.size, vocab))).astype(np.float32)
    if vocab <= 64:
        logits = np.round(logits)  # many ties: the first maximum must win
    draft_len = tree_draft_lengths(rng, draft_lens, batch, tree.size)
    return tree, logits, draft_len, rng.integers(0, 100, size=batch)


@pytest.mark.parametrize("draft_lens", TREE_DRAFT_LENS)
@pytest.mark.parametrize("name,batch,vocab", TREE_SHAPES)
def test_tree_accept_equals_reference(kernels, device, name, batch, vocab, draft_lens):
    rng = np.random.default_rng([list(TREES).index(name), batch, vocab, TREE_DRAFT_LENS.index(draft_lens)])
    tree, logits, draft_len, past_len = tree_case(rng, name, batch, vocab, draft_lens)
    tokens = greedy_tree_tokens(rng, logits.argmax(-1), tree, vocab)
    logits, tokens = unverified(rng, logits, tokens, draft_len)
    got = kernels_lib.tree_accept(kernels, device, logits, tokens, draft_len, past_len, tree.parents, tree.depths)
    assert_same(got, tree_accept(logits.argmax(-1), tokens, tree, past_len, draft_len))
    assert got[0][0] == tree.max_depth  # row 0 agrees everywhere


def robust_typical_reference(logits, tokens, tree, past_len, draft_len, epsilon, delta, margin=1e-4):
    """typical_accept, asserting first that scaling every threshold by 1 ± margin changes nothing. The kept
    sets only shrink as thresholds grow, so the kernel (its p and thresholds within ~1e-6 of the float64
    reference's) must then return the same. Ids that are no token, which sit only past draft_len where
    nothing checks them, become 0: the reference indexes every node's token."""
    tokens = np.where((tokens >= 0) & (tokens < logits.shape[-1]), tokens, 0)
    low, high = (typical_accept(logits, tokens, tree, past_len, draft_len, epsilon * f, delta * f)
                 for f in (1 - margin, 1 + margin))
    for name, a, b in zip(["accepted", "next_token", "new_len", "best_node"], low, high):
        np.testing.assert_array_equal(a, b, err_msg=f"{name}: a decision lies within {margin} of its threshold")
    return low


@pytest.mark.parametrize("draft_lens", TREE_DRAFT_LENS)
@pytest.mark.parametrize("name,batch,vocab", TREE_SHAPES)
def test_tree_typical_accept_equals_reference(kernels, device, name, batch, vocab, draft_lens):
    rng = np.random.default_rng([list(TREES).index(name), batch, vocab, TREE_DRAFT_LENS.index(draft_lens), 1])
    tree, logits, draft_len, past_len = tree_case(rng, name, batch, vocab, draft_lens)
    tokens = typical_tree_tokens(rng, logits, tree, vocab)
    logits, tokens = unverified(rng, logits, tokens, draft_len)
    epsilon = np.array([0.09, 0.3, 0.01, 0.5])[np.arange(batch) % 4].astype(np.float32)
    delta = np.array([0.3, 0.5, 0.1, 1.0])[np.arange(batch) % 4].astype(np.float32)
    want = robust_typical_reference(logits, tokens, tree, past_len, draft_len, epsilon, delta)
    got = kernels_lib.tree_typical_accept(kernels, device, logits, tokens, draft_len, past_len, tree.parents,
                                          tree.depths, epsilon, delta)
    assert_same(got, want)


def test_tree_typical_accept_keeps_what_greedy_rejects(kernels, device):
    """Row 0: a plausible second choice (node 1) passes the typical check but not the greedy one, and so
    does its child. Row 1: a token of probability 0 (a -inf logit) and an id that is no token are both
    rejected: the reference sees another token of probability 0 in place of the latter."""
    tree, vocab = TokenTree.from_paths([[0], [1], [0, 0]]), 8  # parents [0, 0, 0, 1]
    logits = np.full((2, tree.size, vocab), -4.0, np.float32)
    logits[:, :, 3], logits[:, :, 5] = 2.0, 1.5  # target argmax 3, a close second 5
    logits[1, 0, [6, 7]] = -np.inf
    tokens = np.array([[0, 5, 3, 3], [0, 6, vocab, 3]])
    draft_len, past_len = np.full(2, tree.size - 1), np.array([10, 20])
    args = (draft_len, past_len, tree.parents, tree.depths)
    params = (np.full(2, 0.09, np.float32), np.full(2, 0.3, np.float32))
    got = kernels_lib.tree_typical_accept(kernels, device, logits, tokens, *args, *params)
    as_reference = np.where(tokens == vocab, 7, tokens)
    assert_same(got, robust_typical_reference(logits, as_reference, tree, past_len, draft_len, *params))
    assert got[0].tolist() == [2, 0] and got[3].tolist() == [3, 0]
    greedy = kernels_lib.tree_accept(kernels, device, logits, tokens, *args)
    assert_same(greedy, tree_accept(logits.argmax(-1), tokens, tree, past_len, draft_len))
    assert greedy[0].tolist() == [1, 0] and greedy[3].tolist() == [2, 0] and greedy[1].tolist() == [3, 3]


def test_tree_accept_takes_the_first_deepest_node(kernels, device):
    """Two kept paths of the same depth: the lower node number wins, as ArgMax's first maximum."""
    tree, vocab = TokenTree.from_paths([[0], [1], [0, 0], [1, 0]]), 300
    logits = np.zeros((1, tree.size, vocab), np.float32)
    logits[0, :, [7, 250]] = 5.0  # every row: a tie at 7 and 250 -> 7
    tokens = np.array([[0, 7, 7, 7, 7]])
    args = (np.array([tree.size - 1]), np.array([4]), tree.parents, tree.depths)
    got = kernels_lib.tree_accept(kernels, device, logits, tokens, *args)
    assert_same(got, tree_accept(logits.argmax(-1), tokens, tree, args[1], args[0]))
    assert got[3].tolist() == [3] and got[1].tolist() == [7] and got[2].tolist() == [7]
