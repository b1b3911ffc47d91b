"""Token-tree verification (core/tree.py, transformer.build_tree_verify_graph) against HF.

Oracle: HF transformers run on each node's *flattened* sequence (prompt + the path to the node), so a
tree's depth-based positions and ancestor mask must give every node exactly those logits; the tree
SpecAccept against its numpy reference; the Medusa heads' candidates against numpy heads on HF's
final hidden state.
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers

from speccompile.bundle import open_bundle
from speccompile.compiler.checkpoint import load_checkpoint
from speccompile.compiler.onnx_graph import FLOAT, INT64, GraphBuilder, WeightFile
from speccompile.compiler.transformer import _decoder, _lm_head
from speccompile.core.tree import TokenTree, grow_tree, tree_accept, tree_candidates, typical_accept
from speccompile.medusa_heads import load_medusa_heads
from tests.compiler.test_session_graph import run_session, session
from tests.compiler.test_transformer_parity import empty_cache, run_with_cache
from tests.conftest import FAMILIES, MEDUSA_HEADS

ATOL = 1e-4
PROMPTS = [[5, 17, 33, 2, 9, 100, 7], [8, 9, 10, 11]]
ACCURACY = [[0.5 * 0.6**c / (k + 1) for c in range(10)] for k in range(MEDUSA_HEADS)]
TREE = grow_tree(ACCURACY, 9)


def test_the_grown_tree_branches():
    assert not TREE.is_chain and TREE.max_depth >= 2 and TREE.size == 10  # what the tests below rely on


def hf_model(checkpoints, family):
    return transformers.AutoModelForCausalLM.from_pretrained(checkpoints(family)).eval()


def flattened(model, prompt, tree_tokens, tree: TokenTree):
    """HF's logits [N, V] and final hidden state [N, H] after each node, from its flattened sequence."""
    logits, hidden = [], []
    for node in range(tree.size):
        ids = prompt + [int(tree_tokens[0])] + [int(tree_tokens[i]) for i in tree.path_to(node)]
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        logits.append(out.logits[0, -1].numpy())
        hidden.append(out.hidden_states[-1][0, -1].numpy())
    return np.stack(logits), np.stack(hidden)


def agreeing_tree(model, prompt, tree: TokenTree, rng, root: int, agree: float = 0.7):
    """Tree tokens that follow the target's own choice at a node's parent with probability `agree`
    (else a random token), so that acceptance has paths of several lengths to choose from."""
    tokens = np.zeros(tree.size, np.int64)
    tokens[0] = root
    for node in range(1, tree.size):
        ids = prompt + [root] + [int(tokens[i]) for i in tree.path_to(int(tree.parents[node]))]
        with torch.no_grad():
            choice = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        tokens[node] = choice if rng.random() < agree else int(rng.integers(0, 300))
    return tokens


_REFERENCES = {}


def hf_reference(checkpoints, family, first: tuple[int, ...]):
    """Per prompt, agreeing tree tokens rooted at the prefill's token and HF's logits and hidden
    states on their flattened paths (the same for every graph variant: computed once per family)."""
    if (family, first) not in _REFERENCES:
        model, rng = hf_model(checkpoints, family), np.random.default_rng(2)
        tokens = np.stack([agreeing_tree(model, p, TREE, rng, first[row]) for row, p in enumerate(PROMPTS)])
        _REFERENCES[family, first] = tokens, [flattened(model, p, tokens[row], TREE) for row, p in enumerate(PROMPTS)]
    return _REFERENCES[family, first]


@pytest.fixture(scope="module")
def tree_logits_graph(checkpoints, tmp_path_factory):
    """A test graph: the decoder over a tree, then the LM head at every node (what the tree graphs
    compute before SpecAccept)."""
    made = {}

    def get(family):
        if family not in made:
            spec = load_checkpoint(checkpoints(family))
            g = GraphBuilder("tree_logits")
            ids, past_len = g.input("input_ids", INT64, ["batch", "nodes"]), g.input("past_len", INT64, ["batch"])
            hidden = _decoder(g, spec, ids, past_len, 96, tree=True)
            g.output(_lm_head(g, spec, hidden, spec.hp["vocab_size"]), "logits", FLOAT, ["batch", "nodes", "vocab"])
            path = tmp_path_factory.mktemp(f"tree-{family}")
            weights = WeightFile("w.weights")
            weights.add(g.weights)
            weights.write(path / weights.filename)
            onnx.save_model(g.model(weights.locations), str(path / "tree.onnx"))
            made[family] = ort.InferenceSession(str(path / "tree.onnx"))
        return made[family]

    return get


def prefill(bundle, prompts):
    sess = ort.InferenceSession(str(bundle.graph_path("target_forward")))
    ids = np.array([p + [0] * (max(map(len, prompts)) - len(p)) for p in prompts], np.int64)
    lengths = np.array([len(p) for p in prompts], np.int64)
    cache = empty_cache(bundle.manifest, "target", len(prompts))
    out = run_with_cache(sess, {"input_ids": ids, "past_len": np.zeros(len(prompts), np.int64),
                                "token_count": lengths}, cache)
    return cache, lengths, out["next_token"]


def topology(tree: TokenTree) -> dict:
    return {"tree_parents": tree.parents, "tree_depths": tree.depths, "tree_ranks": tree.ranks,
            "tree_mask": tree.ancestors}


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_logits_equal_hf_on_each_flattened_path(family, checkpoints, bundles, tree_logits_graph):
    bundle = open_bundle(bundles(family, "medusa"))
    model, rng = hf_model(checkpoints, family), np.random.default_rng(1)
    cache, lengths, first = prefill(bundle, PROMPTS)
    tokens = rng.integers(3, 300, (2, TREE.size))
    tokens[:, 0] = first
    out = run_with_cache(tree_logits_graph(family), {"input_ids": tokens, "past_len": lengths,
                                                     "tree_depths": TREE.depths, "tree_mask": TREE.ancestors}, cache)
    for row, prompt in enumerate(PROMPTS):
        np.testing.assert_allclose(out["logits"][row], flattened(model, prompt, tokens[row], TREE)[0], atol=ATOL)


def numpy_heads(bundle, checkpoints, family, hidden):
    """The Medusa heads on HF's final hidden state [B, H] (numpy), through HF's LM head: [B, K, V]."""
    _, heads = load_medusa_heads(bundle.medusa["source"])
    lm_head = hf_model(checkpoints, family).get_output_embeddings().weight.detach().numpy()  # [V, H]
    blocks = [hidden + (z := hidden @ w.T + b) / (1 + np.exp(-z)) for w, b in heads]
    return np.stack(blocks, axis=1) @ lm_head[: bundle.vocab_size].T


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("graph", ["standalone", "session", "batch-1 variant"])
def test_tree_verification_accepts_and_proposes_as_the_references(family, graph, checkpoints, bundles):
    bundle = open_bundle(bundles(family, "medusa"))
    if graph == "batch-1 variant" and bundle.graph("target_verify_tree").single_sequence is None:
        pytest.skip(f"{family}: ONNX Runtime's fused kernel does not take this model (no batch-1 variants)")
    prompts = PROMPTS[:1] if graph == "batch-1 variant" else PROMPTS
    cache, lengths, _ = prefill(bundle, prompts)
    tokens, flat = hf_reference(checkpoints, family, tuple(int(t) for t in prefill(bundle, PROMPTS)[2]))
    tokens, flat = tokens[: len(prompts)], flat[: len(prompts)]
    draft_len = np.array([TREE.size - 1, 5], np.int64)[: len(prompts)]  # row 2 verifies a prefix of the tree
    feeds = {"input_ids": tokens, "past_len": lengths, "draft_len": draft_len, **topology(TREE)}
    for typical in (False, True):
        kind = "verify_tree_typical" if typical else "verify_tree"
        batch = len(prompts)
        run_feeds = {**feeds, **({"typical_epsilon": np.full(batch, 0.09, np.float32),
                                  "typical_delta": np.full(batch, 0.3, np.float32)} if typical else {})}
        if graph == "session":
            out = run_session(session(bundle, "target"), bundle, "target", kind, False, run_feeds, dict(cache))
        else:
            entry = bundle.graph(f"target_{kind}")
            file = entry.single_sequence.file if graph == "batch-1 variant" else entry.file
            sess = ort.InferenceSession(str(bundle.path / file))
            names = {i.name for i in sess.get_inputs()}
            out = run_with_cache(sess, {k: v for k, v in run_feeds.items() if k in names}, dict(cache))
        logits = np.stack([f[0] for f in flat])
        if typical:
            expected = typical_accept(logits, tokens, TREE, lengths, draft_len)
        else:
            expected = tree_accept(logits.argmax(-1), tokens, TREE, lengths, draft_len)
        for name, want in zip(("accepted", "next_token", "new_len", "best_node"), expected):
            np.testing.assert_array_equal(out[name], want, err_msg=f"{kind} {name}")
        hidden = np.stack([f[1][node] for f, node in zip(flat, expected[3])])
        head_logits = numpy_heads(bundle, checkpoints, family, hidden)
        np.testing.assert_array_equal(out["next_tree"], tree_candidates(expected[1], head_logits, TREE))
    assert expected[0].max() >= 2, "the trees were built to accept paths of several tokens"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_shallow_tree_reads_only_the_heads_it_needs(family, checkpoints, bundles):
    """A tree of depth 1 runs one head through the LM head; its candidates are still that head's."""
    bundle = open_bundle(bundles(family, "medusa"))
    shallow = TokenTree.from_paths([(0,), (1,), (2,)])
    cache, lengths, first = prefill(bundle, PROMPTS)
    tokens = np.stack([first, first + 1, first + 2, first + 3], axis=1) % bundle.vocab_size
    feeds = {"input_ids": tokens, "past_len": lengths, "draft_len": np.array([3, 3]), **topology(shallow)}
    out = run_with_cache(ort.InferenceSession(str(bundle.graph_path("target_verify_tree"))), feeds, dict(cache))
    model = hf_model(checkpoints, family)
    hidden = np.stack([flattened(model, p, tokens[row], shallow)[1][node]
                       for row, (p, node) in enumerate(zip(PROMPTS, out["best_node"]))])
    head_logits = numpy_heads(bundle, checkpoints, family, hidden)
    np.testing.assert_array_equal(out["next_tree"], tree_candidates(out["next_token"], head_logits, shallow))
