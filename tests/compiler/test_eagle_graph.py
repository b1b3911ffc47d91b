"""An EAGLE-3 head's graphs (compiler/eagle_graph.py) against the torch reference of its drafting.

Oracle: tests/eagle_reference.py (float64): a catch-up over a prompt's positions, then steps that feed
back the head's hidden state and draft, give the reference's drafts exactly and its hidden states
within RTOL; a batch of rows of different lengths gives each row's own answer; a catch-up in two
calls is one call; the cache is bound as the target's graphs bind theirs.
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from speccompile.bundle import STANDARD_OPS, kv_cache_shape
from speccompile.compiler.eagle_graph import (
    CATCH_UP,
    EAGLE_KINDS,
    OUTPUTS,
    STEP,
    TREE_CATCH_UP,
    TREE_STEP,
    WEIGHTS_FILE,
    borrowed_embedding,
    build_eagle_graphs,
    write_eagle_graphs,
)
from speccompile.compiler.onnx_graph import WeightFile
from speccompile.compiler.rope import Rope
from speccompile.compiler.transformer import rope_tables
from speccompile.compiler.trt_rules import check_tensorrt_compatible
from speccompile.errors import SpecCompileError
from tests.eagle_reference import Eagle3Reference, draft, random_head, with_config
from tests.tiny_models import EMBEDDING_PADDING, VOCAB

TARGET = {"model_type": "llama", "hidden_size": 64, "vocab_size": VOCAB + EMBEDDING_PADDING, "num_hidden_layers": 8}
MAX_SEQ = 32
DRAFTS = 4  # per row: the catch-up's, then DRAFTS - 1 steps
LENGTHS = (7, 4)  # prompt positions per row of the batch
RTOL = 1e-4  # of the largest magnitude the reference's hidden states reach


def target_embedding(seed: int = 7) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((TARGET["vocab_size"], TARGET["hidden_size"])).astype(
        np.float32)


def prompt(seed: int, length: int):
    """The target's features at `length` positions and the `length + 1` tokens that go with them."""
    rng = np.random.default_rng(100 + seed)
    return (rng.standard_normal((length, 3 * TARGET["hidden_size"])).astype(np.float32),
            rng.integers(0, TARGET["vocab_size"], length + 1))


def sessions(directory, head, embed=None, **kwargs) -> dict:
    graphs = build_eagle_graphs(head, embed, MAX_SEQ, **kwargs)
    write_eagle_graphs(directory, graphs)
    return {kind: ort.InferenceSession(str(directory / f"{kind}.onnx")) for kind in EAGLE_KINDS}


def empty_cache(head, batch: int) -> dict:
    shape = kv_cache_shape(head.config.num_key_value_heads, head.config.head_dim, MAX_SEQ, batch)
    return {name: np.zeros(shape, np.float32) for name in ("key.0", "value.0")}


def run(session, feeds: dict, cache: dict) -> dict:
    """One call with the cache as past_*; its present_* replace it."""
    out = dict(zip([o.name for o in session.get_outputs()],
                   session.run(None, {**feeds, **{f"past_{k}": v for k, v in cache.items()}})))
    cache.update({k: out[f"present_{k}"] for k in cache})
    return out


def catch_up_feeds(prompts, past_len, begin: int = 0, ends=None) -> dict:
    """Positions begin..end of each row's prompt, right-padded to the longest: (aux, tokens) per row."""
    ends = ends or [len(aux) for aux, _ in prompts]
    width = max(end - begin for end in ends)
    ids, aux = np.zeros((len(prompts), width), np.int64), np.zeros((len(prompts), width, prompts[0][0].shape[1]),
                                                                   np.float32)
    for row, ((features, tokens), end) in enumerate(zip(prompts, ends)):
        ids[row, :end - begin], aux[row, :end - begin] = tokens[begin + 1:end + 1], features[begin:end]
    return {"input_ids": ids, "aux_hidden": aux, "past_len": np.asarray(past_len, np.int64),
            "token_count": np.array([end - begin for end in ends], np.int64)}


def drafting(graphs, head, prompts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A catch-up over every row's prompt, then DRAFTS - 1 steps: drafts [B, K], hidden [B, K, H],
    confidence [B, K], the k-th of each from the call that drafted it."""
    cache = empty_cache(head, len(prompts))
    out = run(graphs[CATCH_UP], catch_up_feeds(prompts, [0] * len(prompts)), cache)
    calls = [out]
    for k in range(1, DRAFTS):
        past_len = np.array([len(aux) + k - 1 for aux, _ in prompts], np.int64)
        calls.append(run(graphs[STEP], {"input_ids": calls[-1]["next_token"][:, None],
                                        "hidden_in": calls[-1]["hidden"][:, None], "past_len": past_len}, cache))
    return tuple(np.stack([call[name] for call in calls], axis=1) for name in ("next_token", "hidden", "confidence"))


def reference(head, features, tokens, embed) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference's drafts [K], the hidden states that drafted them [K, H] and their probabilities [K]."""
    drafts, hidden = draft(head, features, tokens, DRAFTS, embed_tokens=embed)
    drafted_from = hidden[len(features) - 1:]
    with torch.no_grad():
        logits = Eagle3Reference(head, embed).logits(torch.as_tensor(drafted_from, dtype=torch.float64))
    return drafts, drafted_from, torch.softmax(logits, -1).max(-1).values.numpy()


def assert_as_reference(ours, expected):
    (drafts, hidden, confidence), (ref_drafts, ref_hidden, ref_confidence) = ours, expected
    assert drafts.tolist() == ref_drafts.tolist()
    error = np.abs(hidden - ref_hidden).max() / np.abs(ref_hidden).max()
    assert error <= RTOL, f"hidden off by {error:.2e} of its range"
    np.testing.assert_allclose(confidence, ref_confidence, atol=1e-5)


# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_drafts_match_the_reference_row_by_row(tmp_path, norm_before_residual):
    head = random_head(TARGET, seed=5, norm_before_residual=norm_before_residual)  # a seed whose drafts vary
    embed = target_embedding()
    prompts = [prompt(row, length) for row, length in enumerate(LENGTHS)]
    ours = drafting(sessions(tmp_path, head, embed), head, prompts)
    for row, (features, tokens) in enumerate(prompts):
        assert_as_reference([each[row] for each in ours], reference(head, features, tokens, embed))


def test_norm_before_residual_changes_the_drafts(tmp_path):
    """The switch reaches the graph: the same weights draft otherwise with it (random_head's scaled fc)."""
    prompts = [prompt(row, length) for row, length in enumerate(LENGTHS)]
    made = []
    for before in (False, True):
        head = random_head(TARGET, seed=5, norm_before_residual=before)
        (tmp_path / str(before)).mkdir()
        made.append(drafting(sessions(tmp_path / str(before), head, target_embedding()), head, prompts)[0])
    assert made[0].tolist() != made[1].tolist()


def test_a_head_s_own_embedding_is_the_one_it_reads(tmp_path):
    head = random_head(TARGET, seed=5, with_embedding=True)
    prompts = [prompt(2, 5)]
    ours = drafting(sessions(tmp_path, head, target_embedding()), head, prompts)
    assert_as_reference([each[0] for each in ours], reference(head, *prompts[0], None))


def test_a_catch_up_in_two_calls_is_one_call_and_the_cache_bound_in_place_as_the_target_s(tmp_path):
    """Rows split at different places (padding within each call); the second call and a step after it
    run on one OrtValue per cache bound as both past_* and present_*, as the runtime binds the target's."""
    head = random_head(TARGET, seed=4, norm_before_residual=True)
    graphs = sessions(tmp_path, head, target_embedding())
    prompts = [prompt(row, length) for row, length in enumerate(LENGTHS)]
    whole_cache, split_cache = empty_cache(head, 2), empty_cache(head, 2)
    whole = run(graphs[CATCH_UP], catch_up_feeds(prompts, [0, 0]), whole_cache)
    split_at = [3, 1]
    run(graphs[CATCH_UP], catch_up_feeds(prompts, [0, 0], ends=split_at), split_cache)
    bound = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in split_cache.items()}
    for row in range(2):
        feeds = catch_up_feeds(prompts[row:row + 1], [split_at[row]], begin=split_at[row])
        second = run_in_place(graphs[CATCH_UP], feeds, bound, row)
        for name in ("next_token", "confidence", "hidden"):
            np.testing.assert_allclose(second[name][0], whole[name][row], rtol=1e-5, atol=1e-6)
    step = {"input_ids": whole["next_token"][:, None], "hidden_in": whole["hidden"][:, None],
            "past_len": np.array(LENGTHS, np.int64)}
    after_whole = run(graphs[STEP], step, whole_cache)
    for row in range(2):
        after_split = run_in_place(graphs[STEP], {name: value[row:row + 1] for name, value in step.items()}, bound, row)
        np.testing.assert_allclose(after_split["hidden"][0], after_whole["hidden"][row], rtol=1e-5, atol=1e-6)
        assert after_split["next_token"][0] == after_whole["next_token"][row]


def test_a_row_that_reads_nothing_leaves_the_others_alone(tmp_path):
    head = random_head(TARGET, seed=5)
    graphs = sessions(tmp_path, head, target_embedding())
    prompts = [prompt(0, 5), prompt(1, 3)]
    alone = run(graphs[CATCH_UP], catch_up_feeds(prompts[:1], [0]), empty_cache(head, 1))
    beside = run(graphs[CATCH_UP], catch_up_feeds(prompts, [0, 2], ends=[5, 0]), empty_cache(head, 2))
    assert beside["next_token"][0] == alone["next_token"][0]
    np.testing.assert_allclose(beside["hidden"][0], alone["hidden"][0], rtol=1e-5, atol=1e-6)


def run_in_place(session, feeds: dict, cache: dict, row: int) -> dict:
    """A batch-1 call on row `row` of the cache OrtValues, bound as input and output (written in place)."""
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    outputs = [o.name for o in session.get_outputs() if not o.name.startswith("present_")]
    for name in outputs:  # first: copy_outputs_to_cpu returns the bound outputs in this order
        binding.bind_output(name)
    for name, value in cache.items():
        view = value.numpy()[row:row + 1]  # a view of the OrtValue's own memory
        assert np.shares_memory(view, value.numpy())
        binding.bind_input(f"past_{name}", "cpu", 0, np.float32, list(view.shape), view.ctypes.data)
        binding.bind_output(f"present_{name}", "cpu", 0, np.float32, list(view.shape), view.ctypes.data)
    session.run_with_iobinding(binding)
    return dict(zip(outputs, binding.copy_outputs_to_cpu()))


# -- the interface and the weights ----------------------------------------------------------------


def io(path) -> dict:
    model = onnx.load(str(path), load_external_data=False)
    types = {onnx.TensorProto.INT64: "int64", onnx.TensorProto.FLOAT: "float32"}
    return {"inputs": {v.name: (types[v.type.tensor_type.elem_type], [d.dim_param or d.dim_value
                                                                       for d in v.type.tensor_type.shape.dim])
                       for v in model.graph.input},
            "outputs": {v.name: (types[v.type.tensor_type.elem_type], [d.dim_param or d.dim_value
                                                                        for d in v.type.tensor_type.shape.dim])
                        for v in model.graph.output},
            "external": {t.name: {e.key: e.value for e in t.external_data}["location"]
                         for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}}


def test_the_graphs_interface_and_one_shared_weights_file(tmp_path):
    head = random_head(TARGET, seed=1)
    graphs = build_eagle_graphs(head, target_embedding(), MAX_SEQ)
    weight_file = write_eagle_graphs(tmp_path, graphs)
    cache = ("float32", kv_cache_shape(2, 16, MAX_SEQ))
    caches = {f"{way}_{kind}.0": cache for way in ("past", "present") for kind in ("key", "value")}
    read = {"next_token": ("int64", ["batch"]), "confidence": ("float32", ["batch"]),
            "hidden": ("float32", ["batch", 64])}
    catch_up, step = io(tmp_path / f"{CATCH_UP}.onnx"), io(tmp_path / f"{STEP}.onnx")
    assert catch_up["inputs"] == {"input_ids": ("int64", ["batch", "tokens"]),
                                  "aux_hidden": ("float32", ["batch", "tokens", 3 * 64]),
                                  "past_len": ("int64", ["batch"]), "token_count": ("int64", ["batch"]),
                                  **{k: v for k, v in caches.items() if k.startswith("past_")}}
    assert step["inputs"] == {"input_ids": ("int64", ["batch", 1]), "hidden_in": ("float32", ["batch", 1, 64]),
                              "past_len": ("int64", ["batch"]),
                              **{k: v for k, v in caches.items() if k.startswith("past_")}}
    assert tuple(read) == OUTPUTS
    for graph in (catch_up, step):
        assert graph["outputs"] == {**read, **{k: v for k, v in caches.items() if k.startswith("present_")}}
        assert set(graph["external"].values()) == {WEIGHTS_FILE}
    # the step reads the catch-up's weights, all but fc, from the one file that holds each once
    assert set(step["external"]) == set(catch_up["external"]) - {"fc_w"}
    assert (tmp_path / WEIGHTS_FILE).stat().st_size == weight_file.size
    for kind in EAGLE_KINDS:  # the build's own checks of every graph it writes, and a bundle reader's ops
        onnx.checker.check_model(str(tmp_path / f"{kind}.onnx"), full_check=True)
        model = onnx.load(str(tmp_path / f"{kind}.onnx"), load_external_data=False)
        assert check_tensorrt_compatible(model, kind) == []
        assert {node.op_type for node in model.graph.node} <= STANDARD_OPS
    assert weight_file.size < sum(array.nbytes for graph in graphs.values() for array in graph.weights.values())


def test_the_target_s_embedding_read_from_its_own_file_drafts_the_same(tmp_path):
    """write_eagle_graphs(borrowed=...): the head's graphs read the table from the target's weights
    file, written by the target's WeightFile, and the head's file goes without it."""
    head, embed = random_head(TARGET, seed=2), target_embedding()
    prompts = [prompt(row, length) for row, length in enumerate(LENGTHS)]
    (tmp_path / "copy").mkdir(), (tmp_path / "shared").mkdir()
    copied = drafting(sessions(tmp_path / "copy", head, embed), head, prompts)
    target_file = WeightFile("target.weights")
    target_file.add({"embed": embed})
    target_file.write(tmp_path / "shared" / target_file.filename)
    graphs = build_eagle_graphs(head, embed, MAX_SEQ)
    own = write_eagle_graphs(tmp_path / "shared", graphs, borrowed=borrowed_embedding(graphs, target_file.locations))
    assert io(tmp_path / "shared" / f"{STEP}.onnx")["external"]["embed"] == "target.weights"
    assert own.size <= (tmp_path / "copy" / WEIGHTS_FILE).stat().st_size - embed.nbytes
    shared = drafting({kind: ort.InferenceSession(str(tmp_path / "shared" / f"{kind}.onnx")) for kind in EAGLE_KINDS},
                      head, prompts)
    for a, b in zip(copied, shared):
        np.testing.assert_array_equal(a, b)


def test_a_llama3_scaled_head_s_rope_tables_are_the_scaling_s():
    params = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    head = with_config(random_head(TARGET, seed=1, rope_theta=500000.0), rope_scaling={"rope_type": "llama3", **params})
    weights = build_eagle_graphs(head, target_embedding(), MAX_SEQ)[STEP].weights
    cos, sin = rope_tables(Rope("llama3", 500000.0, MAX_SEQ, params), head.config.head_dim, MAX_SEQ)
    plain_cos, _ = rope_tables(Rope("default", 500000.0, MAX_SEQ), head.config.head_dim, MAX_SEQ)
    assert np.array_equal(np.asarray(weights["rope_cos"]), cos) and np.array_equal(np.asarray(weights["rope_sin"]), sin)
    assert not np.array_equal(cos, plain_cos)


WIDE = np.zeros((TARGET["vocab_size"], 32), np.float32)
SHORT = np.zeros((100, 64), np.float32)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize("embed, config, message", [
    (None, {}, "no embed_tokens of its own"),
    (WIDE, {}, "needs 64 columns"),
    (SHORT, {}, f"at least {TARGET['vocab_size']} rows"),
    ("target", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
    ("target", {"rope_scaling": LLAMA3}, "needs original_max_position_embeddings"),
])
def test_what_the_graphs_cannot_take_is_refused_in_one_line(embed, config, message):
    head = with_config(random_head(TARGET, seed=1), **config)
    with pytest.raises(SpecCompileError, match=message):
        build_eagle_graphs(head, target_embedding() if isinstance(embed, str) else embed, MAX_SEQ)


def test_a_tree_step_is_the_chain_step_of_each_node_and_its_batch_1_variant_agrees(tmp_path):
    """A dynamic tree's step over several nodes, each seeing the prefix and its ancestors: every node's
    output is what the chain step gives after its own path, in the standard graph and in the batch-1
    variant (fused attention and a bias); the tree catch-up's best tokens are its draft's distribution's."""
    head, embed = random_head(TARGET, seed=3), target_embedding()
    variants = build_eagle_graphs(head, embed, MAX_SEQ, tree=True, single_sequence=True)
    write_eagle_graphs(tmp_path, build_eagle_graphs(head, embed, MAX_SEQ, tree=True),
                       variants={kind: (graph, f"{kind}_b1.onnx") for kind, graph in variants.items()})
    features, tokens = prompt(5, 6)
    chain = {kind: ort.InferenceSession(str(tmp_path / f"{kind}.onnx")) for kind in (CATCH_UP, STEP)}
    for suffix in ("", "_b1"):
        graph = {kind: ort.InferenceSession(str(tmp_path / f"{kind}{suffix}.onnx"))
                 for kind in (TREE_CATCH_UP, TREE_STEP)}
        cache = empty_cache(head, 1)
        root = run(graph[TREE_CATCH_UP], catch_up_feeds([(features, tokens)], [0]), cache)
        assert root["top_ids"][0, 0, 0] == root["next_token"][0]
        # level 1: the root's two best tokens; level 2: a child of the first (nodes written at 6, 7, then 8)
        first = root["top_ids"][0, 0, :2]
        visible = np.array([[[True] * 6 + [True, False], [True] * 6 + [False, True]]])
        level1 = run(graph[TREE_STEP], {"input_ids": first[None], "hidden_in": np.repeat(root["hidden"][:, None], 2, 1),
                                        "past_len": np.array([6]), "positions": np.array([[6, 6]]),
                                        "visible": visible}, cache)
        child = level1["top_ids"][0, 1, 0]  # the second node's best token
        level2 = run(graph[TREE_STEP], {"input_ids": np.array([[child]]), "hidden_in": level1["node_hidden"][:, 1:2],
                                        "past_len": np.array([8]), "positions": np.array([[7]]),
                                        "visible": np.array([[[True] * 6 + [False, True, True]]])}, cache)
        for path, out, node in (([first[0]], level1, 0), ([first[1]], level1, 1), ([first[1], child], level2, 0)):
            chain_cache = empty_cache(head, 1)
            hidden = run(chain[CATCH_UP], catch_up_feeds([(features, tokens)], [0]), chain_cache)["hidden"]
            for k, token in enumerate(path):
                step = run(chain[STEP], {"input_ids": np.array([[token]]), "hidden_in": hidden[:, None],
                                         "past_len": np.array([6 + k])}, chain_cache)
                hidden = step["hidden"]
            np.testing.assert_allclose(out["node_hidden"][0, node], hidden[0], rtol=1e-4, atol=1e-4)
            assert out["top_ids"][0, node, 0] == step["next_token"][0], (suffix, path)
