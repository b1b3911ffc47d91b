"""The in-graph SpecAccept op (ONNX local function, run by ONNX Runtime) against the numpy reference."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from speccompile.compiler.onnx_graph import FLOAT, INT64, GraphBuilder
from speccompile.compiler.spec_accept import DOMAIN, PLUGIN_NAMESPACE, PLUGIN_VERSION, spec_accept_node
from speccompile.compiler.trt_rules import tensorrt_violations
from speccompile.core.acceptance import greedy_accept


def spec_accept_model(gamma: int, vocab: int) -> onnx.ModelProto:
    g = GraphBuilder("spec_accept")
    logits = g.input("target_logits", FLOAT, ["batch", gamma + 1, vocab])
    drafts = g.input("draft_tokens", INT64, ["batch", gamma])
    past_len = g.input("past_len", INT64, ["batch"])
    spec_accept_node(g, logits, drafts, past_len)
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


@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
def test_in_graph_rule_equals_numpy_reference(gamma):
    rng = np.random.default_rng(gamma)
    vocab, batch = 11, 16
    session = ort.InferenceSession(spec_accept_model(gamma, vocab).SerializeToString())
    logits = rng.standard_normal((batch, gamma + 1, vocab)).astype(np.float32)
    target_tokens = logits.argmax(-1)
    wanted = rng.integers(0, gamma + 1, size=batch)
    wanted[:2] = [0, gamma]  # always cover none and all accepted
    drafts = drafts_with_prefixes(target_tokens, wanted, vocab, rng)
    past_len = rng.integers(0, 50, size=batch)
    accepted, next_token, new_len = session.run(
        ["accepted", "next_token", "new_len"], {"target_logits": logits, "draft_tokens": drafts, "past_len": past_len}
    )
    ref = greedy_accept(target_tokens, drafts, past_len)
    assert accepted.tolist() == wanted.tolist() == ref[0].tolist()
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
