"""`build --eagle HEAD`: the head as the bundle's "eagle" model, its two graphs beside the target's (which
output the features of the layers it names), refused in one line where it does not fit; and a bundle
without a head exactly as it was.

Oracles: the manifest the build wrote before heads existed (its session kinds, no trace of a head, the
same target graphs), and the manifest's own JSON read back byte for byte.
"""

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from speccompile.bundle import AUX_HIDDEN, EAGLE_TREE_KINDS, GRAPH_KINDS, MANIFEST, GraphId, Manifest, open_bundle
from speccompile.cli import main
from speccompile.compiler.build import build_bundle
from speccompile.eagle_head import Layout, write_eagle3_head
from speccompile.errors import SpecCompileError
from tests.eagle_reference import random_head
from tests.runtime.test_eagle import AUX, eagle_target, target_config

OPTIONS = dict(gammas=[2], max_seq=64, max_batch=2)


@pytest.fixture(scope="module")
def target(tmp_path_factory, tokenizer):
    return eagle_target(tmp_path_factory.mktemp("target") / "ckpt", tokenizer)


@pytest.fixture(scope="module")
def head_dir(target, tmp_path_factory):
    """head_dir(layout, **random_head options) -> a random head for the target, written in that layout."""
    made = {}

    def get(layout=Layout.SPECULATORS, **options):
        key = layout, *sorted(options.items())
        if key not in made:
            head = random_head(target_config(target), seed=1, **{"aux_layer_ids": AUX, **options})
            made[key] = write_eagle3_head(tmp_path_factory.mktemp("head") / "h", head, layout)
        return made[key]

    return get


@pytest.fixture(scope="module")
def built(target, head_dir, tmp_path_factory):
    """built(with_head) -> the opened draft-free bundle of the target, with the speculators-layout head or none."""
    made = {}

    def get(with_head: bool):
        if with_head not in made:
            out = tmp_path_factory.mktemp("bundle") / "b"
            made[with_head] = open_bundle(build_bundle(target, None, out, eagle_dir=head_dir() if with_head else None,
                                                       **OPTIONS))
        return made[with_head]

    return get


def manifest_json(bundle) -> dict:
    return json.loads((bundle.path / MANIFEST).read_text())


def external(bundle, name: str) -> dict:
    model = onnx.load(str(bundle.path / f"{name}.onnx"), load_external_data=False)
    return {t.name: {e.key: e.value for e in t.external_data}["location"] for t in model.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL}


def test_the_head_is_the_bundle_s_eagle_model_with_its_two_graphs(built, head_dir):
    bundle = built(True)
    head, target = bundle.model("eagle"), bundle.model("target")
    config = json.loads((head_dir() / "config.json").read_text())
    assert bundle.has_eagle and not bundle.has_draft and target.eagle_aux_layers == AUX
    assert (head.num_layers, head.num_heads, head.num_kv_heads, head.head_dim, head.hidden_size) == (1, 4, 2, 16, 64)
    assert (head.vocab_size, head.scored_vocab) == (target.vocab_size, 50)
    assert (head.weights_file, head.matmul_weights, head.session, head.model_type) == ("eagle.weights", "int8",
                                                                                     None, "eagle3")
    assert head.config == config and head.eagle_aux_layers == ()
    graphs = {name: entry.id for name, entry in bundle.manifest.graphs.items()
              if entry.id.model == "eagle" and not entry.id.sampling and entry.id.kind not in EAGLE_TREE_KINDS}
    assert graphs == {"eagle_catch_up": GraphId.eagle_catch_up(), "eagle_step": GraphId.eagle_step()}
    trees = {name: entry.id for name, entry in bundle.manifest.graphs.items() if entry.id.kind in EAGLE_TREE_KINDS}
    assert trees == {graph.name: graph for graph in map(GraphId.eagle_tree, EAGLE_TREE_KINDS)} and bundle.eagle_trees
    assert bundle.manifest.read_back(GraphId.eagle_tree("verify_eagle_tree"))[-1] == AUX_HIDDEN
    assert GraphId.eagle_tree("tree_step").positions_scored == "all"
    sampled = {name: entry.id for name, entry in bundle.manifest.graphs.items()
               if entry.id.model == "eagle" and entry.id.sampling}
    assert sampled == {"eagle_catch_up_sample": GraphId.eagle_catch_up(True),
                       "eagle_step_sample": GraphId.eagle_step(True)} and bundle.eagle_samples
    for graph in sampled.values():
        assert bundle.manifest.read_back(graph) == ("next_token", "probs", "hidden")
    for graph in graphs.values():
        assert bundle.manifest.read_back(graph) == ("next_token", "confidence", "hidden")
        assert graph.positions_scored == "last"
    for name in [*graphs, *sampled, *trees]:  # each with its batch-1 variant (fused attention), over the same weights
        variant = bundle.graph(name).single_sequence
        layers = target.num_layers if trees.get(name) == GraphId.eagle_tree("verify_eagle_tree") else 1
        assert variant is not None and variant.op_counts.get("GroupQueryAttention") == layers
        assert set(external(bundle, name).values()) <= {"eagle.weights", "target.weights"}
    catch_up = bundle.graph("eagle_catch_up")
    assert [spec.shape for spec in catch_up.inputs if spec.name == AUX_HIDDEN] == [("batch", "tokens", 3 * 64)]
    assert Manifest.from_json(manifest_json(bundle)) == bundle.manifest
    assert json.dumps(bundle.manifest.to_json(), indent=1) == (bundle.path / MANIFEST).read_text()


def test_a_head_without_an_embedding_reads_the_target_s_and_one_with_its_own_carries_it(built, target, head_dir,
                                                                                          tmp_path):
    borrowing = built(True)
    embedding_bytes = target_config(target)["vocab_size"] * 64 * 4
    assert external(borrowing, "eagle_step")["embed"] == "target.weights"
    owning = open_bundle(build_bundle(target, None, tmp_path / "b", eagle_dir=head_dir(with_embedding=True),
                                      **OPTIONS))
    assert set(external(owning, "eagle_step").values()) == {"eagle.weights"}
    copy = (owning.path / "eagle.weights").stat().st_size - (borrowing.path / "eagle.weights").stat().st_size
    assert embedding_bytes <= copy < embedding_bytes + 64  # the table, and an alignment's padding at most
    assert owning.model("eagle").num_params == borrowing.model("eagle").num_params + embedding_bytes // 4


def test_a_bundle_without_a_head_is_the_one_built_before_heads(built):
    """The manifest of before: the target's session kinds numbered as they were, no head or feature
    anywhere, the head bundle's target graphs less their features (those outside AUX_KINDS the same files)."""
    plain, with_head = built(False), built(True)
    text = (plain.path / MANIFEST).read_text()
    assert "eagle" not in text and AUX_HIDDEN not in text and "catch_up" not in text
    assert json.dumps(Manifest.from_json(json.loads(text)).to_json(), indent=1) == text
    assert plain.model("target").session.kinds == {"forward": 0, "sample": 1, "verify": 2, "verify_sample": 3,
                                                   "score": 4}
    # the same numbers, and the tree the head drafts verified on the session graph too
    tree_kind = {"verify_eagle_tree": GRAPH_KINDS.index("verify_eagle_tree")}
    assert with_head.model("target").session.kinds == {**plain.model("target").session.kinds, **tree_kind}
    target_graphs = {name for name, entry in with_head.manifest.graphs.items()
                     if entry.id.model == "target" and entry.id.kind not in EAGLE_TREE_KINDS}  # a head's own tree
    assert set(plain.manifest.graphs) == target_graphs
    assert plain.manifest.files["target_score.onnx"] == with_head.manifest.files["target_score.onnx"]


def _other_head(tmp_path, target, changes: dict):
    """A head made for a target of another config (`changes` to the test target's)."""
    config = {**target_config(target), **changes}
    return write_eagle3_head(tmp_path / "other", random_head(config, seed=2, aux_layer_ids=AUX), Layout.EAGLE)


# case -> (its head: the test target's config changed, random_head's options, or the target itself;
# build options; what the refusal says)
REFUSED = {
    "another width": ({"hidden_size": 32}, {}, "for a target of hidden size 32"),
    "a larger vocabulary": ({"vocab_size": 400}, {}, "over a vocabulary of 400 tokens"),
    "a layer the target lacks": (dict(aux_layer_ids=(0, 2, 4)), {}, "reads the input of target layer 4"),
    "no layers named, too shallow a target": (dict(aux_layer_ids=None), {}, "not three distinct layers"),
    "Medusa heads too": ({}, dict(medusa_dir="heads"), "--eagle and --medusa"),
    "aux layers given": ({}, dict(eagle_aux_layers=(0, 1, 2)), "eagle_aux_layers is for a bundle without a head"),
    "TensorRT": ({}, dict(backend="tensorrt"), "ONNX Runtime only"),
    "a vocabulary cut without counts": ({}, dict(eagle_vocab=20), "needs token frequencies"),
    "a vocabulary cut to all of it": ({}, dict(eagle_vocab=50), "--eagle-vocab must be between 1 and 49"),
    "not a head": ("target", {}, "not an EAGLE-3 head"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_what_does_not_fit_is_refused_in_one_line_and_leaves_nothing(case, target, head_dir, tmp_path):
    head, options, message = REFUSED[case]
    if head == "target":
        eagle_dir = target
    elif set(head) & {"hidden_size", "vocab_size"}:
        eagle_dir = _other_head(tmp_path, target, head)
    else:
        eagle_dir = head_dir(**head)
    with pytest.raises(SpecCompileError) as refused:
        build_bundle(target, None, tmp_path / "b", eagle_dir=eagle_dir, **OPTIONS, **options)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    assert not (tmp_path / "b").exists()


def _without_features(data: dict) -> None:
    del data["models"]["target"]["eagle_aux_layers"]
    for graph in data["graphs"].values():
        if graph["model"] == "target":
            graph["outputs"] = [o for o in graph["outputs"] if o["name"] != AUX_HIDDEN]


def _output(data: dict, graph: str, name: str) -> dict:
    return next(o for o in data["graphs"][graph]["outputs"] if o["name"] == name)


MANIFEST_CHANGES = {
    "a head without the target's features": (_without_features, "records no eagle_aux_layers"),
    "a head without its step": (lambda d: d["graphs"].pop("eagle_step"), "without its graph eagle_step"),
    "a tree without its step": (lambda d: d["graphs"].pop("eagle_tree_step"), "some of the dynamic tree's graphs"),
    "a head of two layers": (lambda d: d["models"]["eagle"].update(num_layers=2), "has 2 layers"),
    "features of another width": (lambda d: next(i for i in d["graphs"]["eagle_catch_up"]["inputs"]
                                                 if i["name"] == AUX_HIDDEN)["shape"].__setitem__(2, 100),
                                  "reads features of width [100]"),
    "a hidden state of another width": (lambda d: _output(d, "eagle_step", "hidden")["shape"].__setitem__(1, 32),
                                        "returns a hidden state of width [32]"),
    "a head kind on the target": (lambda d: d["graphs"]["eagle_step"].update(model="target"),
                                  "is no graph speccompile makes"),
    "a target kind on the head": (lambda d: d["graphs"]["eagle_step"].update(kind="forward"),
                                  "is no graph speccompile makes"),
    "the head's graphs without a head": (lambda d: d["models"].pop("eagle"), "the eagle's, a model it does not hold"),
    "features read by the head": (lambda d: d["models"]["eagle"].update(eagle_aux_layers=[0]),
                                  "its eagle records eagle_aux_layers"),
}


@pytest.mark.parametrize("change", MANIFEST_CHANGES)
def test_the_manifest_refuses_a_head_its_bundle_cannot_run_in_one_line(change, built):
    data = manifest_json(built(True))
    edit, message = MANIFEST_CHANGES[change]
    edit(data)
    with pytest.raises(SpecCompileError) as refused:
        Manifest.from_json(data)
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_the_head_is_stored_as_asked_and_cut_to_its_most_frequent_tokens(target, head_dir, built, tmp_path):
    """--eagle-weights (default int8, as the draft's) stores the head's matrices so; --eagle-vocab K keeps
    the K tokens of its vocabulary counted most often (its token_frequencies.json), EOS among them."""
    import shutil

    from speccompile.compiler.draft_vocab import write_frequencies
    from speccompile.eagle_head import draft_to_target, load_eagle3_head

    int8 = built(True).path / "eagle.weights"
    floats = build_bundle(target, None, tmp_path / "f", eagle_dir=head_dir(), eagle_weights="float32", **OPTIONS)
    assert open_bundle(floats).model("eagle").matmul_weights == "float32"
    assert (floats / "eagle.weights").stat().st_size > 3 * int8.stat().st_size
    counted = shutil.copytree(head_dir(), tmp_path / "counted")
    head = load_eagle3_head(counted)
    vocab = head.config.vocab_size
    counts = np.random.default_rng(3).integers(1, 1000, vocab)
    write_frequencies(counted, counts, "test")
    cut = open_bundle(build_bundle(target, None, tmp_path / "c", eagle_dir=counted, eagle_vocab=12, **OPTIONS))
    assert cut.model("eagle").scored_vocab == 12
    draftable = draft_to_target(head, np.arange(head.config.draft_vocab_size))
    eos = target_config(target)["eos_token_id"]
    ranked = [i for i in sorted(draftable, key=lambda i: (-counts[i], i)) if i != eos]
    kept = sorted(ranked[: 12 - (eos in draftable)] + ([eos] if eos in draftable else []))
    step = onnx.load(str(cut.path / "eagle_step.onnx"))
    d2t = next(onnx.numpy_helper.to_array(t) for t in step.graph.initializer if t.name == "draft_to_target")
    assert d2t.tolist() == kept


def test_the_cli_builds_a_head_and_generates_with_it(target, head_dir, tmp_path):
    out = tmp_path / "bundle"
    build = CliRunner().invoke(main, ["build", "--target", str(target), "--eagle", str(head_dir(Layout.EAGLE)),
                                      "--out", str(out), "--gamma", "2", "--max-seq", "64", "--max-batch", "1"])
    assert build.exit_code == 0, build.output
    assert open_bundle(out).has_eagle
    run = CliRunner().invoke(main, ["generate", str(out), "--prompt", "def f(x):", "--max-new-tokens", "8",
                                    "--gamma", "2", "--proposer", "eagle", "--json"])
    assert run.exit_code == 0, run.output
    [result] = json.loads(run.stdout)
    assert len(result["token_ids"]) == 8 and set(result["stats"]["by_proposer"]) == {"eagle"}
    refused = CliRunner().invoke(main, ["build", "--target", str(target), "--eagle", str(target), "--out",
                                        str(tmp_path / "b2"), "--max-seq", "64"])
    assert refused.exit_code != 0 and "not an EAGLE-3 head" in refused.output

