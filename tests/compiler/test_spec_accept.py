"""The in-graph SpecAccept op (ONNX local function, run by ONNX Runtime) against the numpy reference."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from speccompile.compiler.onnx_graph import FLOAT, INT64, GraphBuilder
from speccompile.compiler.spec_accept import (
    DOMAIN,
    PLUGIN_NAMESPACE,
    PLUGIN_VERSION,
    accept_tokens,
    gumbel_scores,
    spec_accept_node,
    spec_op,
)
from speccompile.compiler.trt_rules import tensorrt_violations
from speccompile.core.acceptance import coupled_accept, greedy_accept, sample_accept
from speccompile.core.sampling import gumbel_argmax, sample_from, transform


def spec_accept_model(gamma: int, vocab: int) -> onnx.ModelProto:
    g = GraphBuilder("spec_accept")
    logits = g.input("target_logits", FLOAT, ["batch", gamma + 1, vocab])
    drafts = g.input("draft_tokens", INT64, ["batch", gamma])
    draft_len = g.input("draft_len", INT64, ["batch"])
    past_len = g.input("past_len", INT64, ["batch"])
    spec_accept_node(g, logits, drafts, draft_len, past_len)
    for name in ("accepted", "next_token", "new_len"):
        g.outputs.append(onnx.helper.make_tensor_value_info(name, INT64, ["batch"]))
    model = g.model({})
    onnx.checker.check_model(model, full_check=True)
    return model


def drafts_with_prefixes(target_tokens, accepted_wanted, vocab, rng):
    """Drafts that agree with the target's choices for exactly `accepted_wanted[b]` leading positions."""
    gamma = target_tokens.shape[1] - 1
    drafts = rng.integers(0, vocab, size=(len(target_tokens), gamma))
    for row, n in enumerate(accepted_wanted):
        drafts[row, :n] = target_tokens[row, :n]
        if n < gamma:
            drafts[row, n] = (target_tokens[row, n] + 1) % vocab  # a guaranteed mismatch
    return drafts


def draft_lengths(rng, batch, gamma):
    """Random real-draft counts per row, with 0 and γ always among them."""
    draft_len = rng.integers(0, gamma + 1, size=batch)
    draft_len[-2:] = [0, gamma]
    return draft_len


@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
def test_in_graph_rule_equals_numpy_reference(gamma):
    rng = np.random.default_rng(gamma)
    vocab, batch = 11, 32
    session = ort.InferenceSession(spec_accept_model(gamma, vocab).SerializeToString())
    logits = rng.standard_normal((batch, gamma + 1, vocab)).astype(np.float32)
    target_tokens = logits.argmax(-1)
    wanted = rng.integers(0, gamma + 1, size=batch)
    wanted[:2] = [0, gamma]  # always cover none and all accepted
    drafts = drafts_with_prefixes(target_tokens, wanted, vocab, rng)
    past_len = rng.integers(0, 50, size=batch)
    for draft_len in (np.full(batch, gamma), draft_lengths(rng, batch, gamma)):
        feeds = {"target_logits": logits, "draft_tokens": drafts, "draft_len": draft_len, "past_len": past_len}
        accepted, next_token, new_len = session.run(["accepted", "next_token", "new_len"], feeds)
        ref = greedy_accept(target_tokens, drafts, past_len, draft_len)
        assert accepted.tolist() == np.minimum(wanted, draft_len).tolist() == ref[0].tolist()
        assert next_token.tolist() == ref[1].tolist()
        assert new_len.tolist() == ref[2].tolist()


def test_node_carries_plugin_attributes_and_is_tensorrt_parsable():
    model = spec_accept_model(4, 11)
    [node] = [n for n in model.graph.node if n.op_type == "SpecAccept"]
    attrs = {a.name: a.s.decode() for a in node.attribute}
    assert node.domain == DOMAIN
    assert attrs["plugin_namespace"] == PLUGIN_NAMESPACE and attrs["plugin_version"] == PLUGIN_VERSION
    assert [f.name for f in model.functions] == ["SpecAccept"]
    assert tensorrt_violations(model) == []


# -- sampling ops ------------------------------------------------------------------------------

SETTINGS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 3, 0.5), (2.0, 40, 0.95)]


def session_for(build_graph):
    g = GraphBuilder("ops")
    build_graph(g)
    model = g.model({})
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString())


def transform_session(vocab):
    def build_graph(g):
        ins = [g.input("logits", FLOAT, ["batch", "rows", vocab]), g.input("temperature", FLOAT, ["batch"]),
               g.input("top_k", INT64, ["batch"]), g.input("top_p", FLOAT, ["batch"])]
        probs = spec_op(g, "SpecTransform", *ins, vocab_size=vocab, out="probs")
        g.output(probs, "probs", FLOAT, ["batch", "rows", vocab])
    return session_for(build_graph)


@pytest.mark.parametrize("vocab", [7, 64])
def test_in_graph_transform_equals_numpy_reference(vocab):
    rng = np.random.default_rng(vocab)
    logits = (3 * rng.standard_normal((len(SETTINGS), 3, vocab))).astype(np.float32)
    temperature, top_k, top_p = (np.array(col, dtype)
                                 for col, dtype in zip(zip(*SETTINGS), (np.float32, np.int64, np.float32)))
    feeds = {"logits": logits, "temperature": temperature, "top_k": top_k, "top_p": top_p}
    [probs] = transform_session(vocab).run(None, feeds)
    for row, (t, k, p) in enumerate(SETTINGS):
        expected = transform(logits[row], t, k, p)
        np.testing.assert_allclose(probs[row], expected, atol=1e-6)
        assert ((probs[row] > 0) == (expected > 0)).all(), f"different support for {SETTINGS[row]}"


def test_in_graph_sample_equals_numpy_reference():
    def build_graph(g):
        probs, uniform = g.input("probs", FLOAT, ["batch", 9]), g.input("uniform", FLOAT, ["batch"])
        g.output(spec_op(g, "SpecSample", probs, uniform, out="token"), "token", INT64, ["batch"])

    rng = np.random.default_rng(0)
    probs = rng.random((256, 9)).astype(np.float32) * (rng.random((256, 9)) < 0.5)
    probs[:, 4] += 0.01  # every row has some mass
    uniform = rng.random(256, dtype=np.float32)
    uniform[:3] = [0.0, np.nextafter(np.float32(1), np.float32(0)), 0.5]
    [tokens] = session_for(build_graph).run(None, {"probs": probs, "uniform": uniform})
    assert tokens.tolist() == sample_from(probs, uniform).tolist()
    assert (probs[np.arange(256), tokens] > 0).all()  # never a zero-probability token


def sample_accept_session(gamma, vocab):
    def build_graph(g):
        ins = [g.input("target_probs", FLOAT, ["batch", gamma + 1, vocab]),
               g.input("draft_probs", FLOAT, ["batch", gamma, vocab]), g.input("draft_tokens", INT64, ["batch", gamma]),
               g.input("draft_len", INT64, ["batch"]), g.input("u_accept", FLOAT, ["batch", gamma]),
               g.input("u_sample", FLOAT, ["batch"]), g.input("past_len", INT64, ["batch"])]
        for name in spec_op(g, "SpecAccept", *ins, mode="sample", outputs=3, out=["accepted", "next_token", "new_len"]):
            g.output(name, name, INT64, ["batch"])
    return session_for(build_graph)


def sampling_feeds(rng, gamma, vocab, batch):
    p = transform(rng.standard_normal((batch, gamma + 1, vocab)) * 2, 1.0, 0, 0.9)
    q = transform(rng.standard_normal((batch, gamma, vocab)) * 2, 1.0, 4, 1.0)
    q[:8] = p[:8, :gamma]  # rows where the draft equals the target: everything accepted
    u_draft = rng.random((batch, gamma), dtype=np.float32)
    drafts = np.stack([sample_from(q[:, j], u_draft[:, j]) for j in range(gamma)], axis=1)
    return {"target_probs": p, "draft_probs": q, "draft_tokens": drafts, "draft_len": np.full(batch, gamma),
            "u_accept": rng.random((batch, gamma), dtype=np.float32), "u_sample": rng.random(batch, dtype=np.float32),
            "past_len": rng.integers(0, 30, batch)}


def assert_agrees(got, expected):
    for name, a, b in zip(("accepted", "next_token", "new_len"), got, expected):
        assert a.tolist() == b.tolist(), name


@pytest.mark.parametrize("gamma", [1, 3])
def test_in_graph_sampling_rule_equals_numpy_reference(gamma):
    vocab, batch = 11, 64
    feeds = sampling_feeds(np.random.default_rng(gamma), gamma, vocab, batch)
    got = sample_accept_session(gamma, vocab).run(["accepted", "next_token", "new_len"], feeds)
    expected = sample_accept(**feeds)
    assert_agrees(got, expected)
    assert (expected[0][:8] == gamma).all() and 0 < expected[0][8:].mean() < gamma


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_in_graph_sampling_rule_with_a_draft_len_per_row_equals_numpy_reference(gamma):
    """Rows with fewer real drafts than γ: the pads hold ids that are no token and, in odd rows, NaN draft
    probabilities (in even rows the draft's own q, as after confidence thresholding). Both forms must
    ignore them alike, and draw the token after k accepted drafts from p_k, not from max(0, p_k - q_k)."""
    vocab, batch = 11, 96
    rng = np.random.default_rng(10 + gamma)
    feeds = sampling_feeds(rng, gamma, vocab, batch)
    feeds["draft_len"] = draft_lengths(rng, batch, gamma)
    feeds["u_accept"][::3] = 0  # every third row accepts all its real drafts: the bonus rule at k < γ
    pads = np.arange(gamma)[None, :] >= feeds["draft_len"][:, None]
    feeds["draft_tokens"] = np.where(pads, np.where(rng.random(pads.shape) < 0.5, -5, 10**6), feeds["draft_tokens"])
    odd_pads = pads & (np.arange(batch)[:, None] % 2 == 1)
    feeds["draft_probs"] = np.where(odd_pads[..., None], np.float32(np.nan), feeds["draft_probs"])
    got = sample_accept_session(gamma, vocab).run(["accepted", "next_token", "new_len"], feeds)
    expected = sample_accept(**feeds)
    assert_agrees(got, expected)
    assert (expected[0] <= feeds["draft_len"]).all()
    assert ((expected[0] == feeds["draft_len"]) & (feeds["draft_len"] < gamma)).sum() >= 8


def coupled_session(gamma, vocab):
    """The coupled rule as the verification graph runs it: the greedy rule (standard ops) on the
    target's Gumbel-max draws."""
    def build_graph(g):
        probs, noise = g.input("target_probs", FLOAT, ["batch", gamma + 1, vocab]), g.input("noise", FLOAT,
                                                                                           ["batch", gamma + 1, vocab])
        draws = g.op("ArgMax", gumbel_scores(g, probs, noise), axis=-1, keepdims=0)
        outs = accept_tokens(g, draws, g.input("draft_tokens", INT64, ["batch", gamma]),
                             g.input("draft_len", INT64, ["batch"]), g.input("past_len", INT64, ["batch"]))
        for tensor, name in zip(outs, ["accepted", "next_token", "new_len"]):
            g.output(tensor, name, INT64, ["batch"])
    return session_for(build_graph)


@pytest.mark.parametrize("gamma", [1, 4])
def test_in_graph_coupled_rule_equals_numpy_reference(gamma):
    """Drafts drawn by Gumbel-max from q with the noise the target draws with (as the loop couples
    them), some rows with fewer real drafts than γ: the graph matches the reference, and every row's
    emitted tokens are the target's own draws with that noise, whatever the draft proposed."""
    vocab, batch = 11, 96
    rng = np.random.default_rng(20 + gamma)
    feeds = sampling_feeds(rng, gamma, vocab, batch)
    noise = rng.random((batch, gamma + 1, vocab), dtype=np.float32)
    drafts = gumbel_argmax(feeds["draft_probs"], noise[:, :gamma])
    case = {"target_probs": feeds["target_probs"], "noise": noise, "draft_tokens": drafts,
            "draft_len": draft_lengths(rng, batch, gamma), "past_len": feeds["past_len"]}
    got = coupled_session(gamma, vocab).run(["accepted", "next_token", "new_len"], case)
    expected = coupled_accept(**case)
    assert_agrees(got, expected)
    own = gumbel_argmax(case["target_probs"], noise)  # [B, γ+1]: the target's draw at every position
    for row in range(batch):
        n = expected[0][row]
        assert [*drafts[row, :n], expected[1][row]] == own[row, : n + 1].tolist()
    same = np.arange(batch) < 8  # q = p: the draws coincide, every real draft is kept
    assert (expected[0][same] == case["draft_len"][same]).all()


def test_gumbel_max_never_draws_a_token_of_zero_probability_and_matches_the_graph():
    rng = np.random.default_rng(5)
    probs = transform(rng.standard_normal((256, 1, 13)) * 2, 1.0, 4, 1.0)  # top-4: 9 zeros per row
    noise = rng.random((256, 1, 13), dtype=np.float32)
    noise[:4, 0, :] = 0.0  # the edge of the noise's range: every token scores -inf but the argmax stays defined
    def build_graph(g):
        p, u = g.input("probs", FLOAT, ["batch", 1, 13]), g.input("noise", FLOAT, ["batch", 1, 13])
        g.output(g.op("ArgMax", gumbel_scores(g, p, u), axis=-1, keepdims=0), "token", INT64, ["batch", 1])
    [tokens] = session_for(build_graph).run(None, {"probs": probs, "noise": noise})
    assert tokens[4:].tolist() == gumbel_argmax(probs, noise)[4:].tolist()
    assert (np.take_along_axis(probs[4:, 0], tokens[4:], axis=1) > 0).all()


def test_one_hot_sampling_rule_is_the_greedy_rule():
    rng = np.random.default_rng(3)
    logits = rng.standard_normal((32, 5, 13)).astype(np.float32)
    drafts = np.where(rng.random((32, 4)) < 0.6, logits[:, :4].argmax(-1), rng.integers(0, 13, (32, 4)))
    q = np.eye(13, dtype=np.float32)[drafts]
    sampled = sample_accept(transform(logits, 0.0), q, drafts, rng.random((32, 4), dtype=np.float32),
                            rng.random(32, dtype=np.float32), np.zeros(32, np.int64))
    greedy = greedy_accept(logits.argmax(-1), drafts, np.zeros(32, np.int64))
    for a, b in zip(sampled, greedy):
        assert a.tolist() == b.tolist()
