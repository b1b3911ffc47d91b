"""The target's aux_hidden output, for an EAGLE-3 head (build_bundle(eagle_aux_layers=...)).

Oracle: HF's `hidden_states[i]` (output_hidden_states=True: the residual stream entering layer i) at
every position a prefill or a verification scores; and, without the option, the graphs and manifest
the build made before it: the same nodes, outputs and JSON, with no trace of aux_hidden.
"""

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
import transformers

from speccompile.bundle import AUX_HIDDEN, MANIFEST, GraphId, Manifest, open_bundle, output_array
from speccompile.compiler.build import build_bundle
from speccompile.compiler.checkpoint import load_checkpoint
from speccompile.compiler.session_graph import KINDS, build_session_graph
from speccompile.compiler.transformer import build_forward_graph, build_verify_graph
from speccompile.errors import SpecCompileError
from tests.compiler.test_session_graph import run_session
from tests.compiler.test_transformer_parity import empty_cache, run_with_cache
from tests.conftest import FAMILIES

AUX = (1, 0, 1)  # the tiny targets have two layers: out of order and repeated, so that the listed order shows
GAMMA = 3
PROMPTS = [[5, 17, 33, 2, 9, 100, 7], [8, 9, 10, 11]]
DRAFTS = [[42, 7, 300, 12], [3, 4, 5, 6]]  # [last, d_1..d_γ] per row, verified after the prompts
RTOL = 1e-4  # of the largest magnitude HF's states reach


@pytest.fixture(scope="module")
def eagle_bundles(checkpoints, tmp_path_factory):
    """eagle_bundles(family, aux) -> the opened draft-free bundle of the family's tiny target, built
    with eagle_aux_layers=aux (None: without the option)."""
    made = {}

    def get(family: str, aux=AUX):
        if (family, aux) not in made:
            out = tmp_path_factory.mktemp(f"eagle-{family}-{aux is not None}") / "bundle"
            made[family, aux] = open_bundle(build_bundle(checkpoints(family), None, out, gammas=[GAMMA], max_seq=64,
                                                         max_batch=2, eagle_aux_layers=aux))
        return made[family, aux]

    return get


def hf_states(model, ids: list[int]) -> np.ndarray:
    """HF's hidden_states[i] for each i of AUX, side by side: [T, len(AUX) * H]."""
    with torch.no_grad():
        states = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return np.concatenate([states[i][0].numpy() for i in AUX], axis=-1)


def assert_close(ours: np.ndarray, hf: np.ndarray):
    assert ours.shape == hf.shape
    error = np.abs(ours - hf).max() / np.abs(hf).max()
    assert error <= RTOL, f"aux_hidden off by {error:.2e} of its range"


def run(session, feeds: dict, cache: dict) -> dict:
    """run_with_cache, with zeros for the inputs the feeds leave out (sampling controls, draft
    probabilities, noise): aux_hidden is made before anything reads them."""
    batch = len(feeds["past_len"])
    types = {"tensor(bool)": bool, "tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(uint8)": np.uint8}
    for value in session.get_inputs():
        if value.name not in feeds and not value.name.startswith("past_"):
            shape = [batch if dim == "batch" else dim if isinstance(dim, int) else 1 for dim in value.shape]
            feeds[value.name] = np.zeros(shape, types[value.type])
    return run_with_cache(session, feeds, cache)


def padded(rows: list[list[int]]) -> np.ndarray:
    return np.array([row + [0] * (max(map(len, rows)) - len(row)) for row in rows], np.int64)


# ---------------------------------------------------------------------------------------------
# the values: HF's hidden states at every scored position


def graph_files(bundle, names) -> list[tuple[str, int]]:
    """(file, batch) of each named graph and of its batch-1 variant where it has one."""
    files = []
    for name in names:
        entry = bundle.graph(name)
        files.append((entry.file, 2))
        if entry.single_sequence:
            files.append((entry.single_sequence.file, 1))
    return files


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_and_verification_output_hfs_hidden_states_at_every_position(family, checkpoints, eagle_bundles):
    bundle = eagle_bundles(family)
    target = bundle.model("target")
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints(family)).eval()
    prompt_states = [hf_states(hf, prompt) for prompt in PROMPTS]
    verified_states = [hf_states(hf, prompt + drafts)[len(prompt):] for prompt, drafts in zip(PROMPTS, DRAFTS)]
    for file, batch in graph_files(bundle, ["target_forward", "target_sample"]):
        session, cache = ort.InferenceSession(str(bundle.path / file)), empty_cache(bundle.manifest, "target", batch)
        lengths = np.array([len(p) for p in PROMPTS[:batch]], np.int64)
        feeds = {"input_ids": padded(PROMPTS[:batch]), "past_len": np.zeros(batch, np.int64), "token_count": lengths}
        aux = run(session, feeds, cache)[AUX_HIDDEN]
        assert aux.shape == output_array(AUX_HIDDEN, batch, bundle.vocab_size, positions=feeds["input_ids"].shape[1],
                                         hidden=target.aux_hidden_width)[0]
        for row in range(batch):  # the positions of padding are not the prompt's
            assert_close(aux[row, : lengths[row]], prompt_states[row])
        for verify_file, _ in graph_files(bundle, [f"target_verify_g{GAMMA}", f"target_verify_sample_g{GAMMA}"]):
            if (verify_file.endswith("_b1.onnx")) != (batch == 1):
                continue
            verify = ort.InferenceSession(str(bundle.path / verify_file))
            feeds = {"input_ids": np.array(DRAFTS[:batch], np.int64), "past_len": lengths,
                     "draft_len": np.full(batch, GAMMA, np.int64)}
            aux = run(verify, feeds, {k: v.copy() for k, v in cache.items()})[AUX_HIDDEN]
            for row in range(batch):
                assert_close(aux[row], verified_states[row])


@pytest.mark.parametrize("family", ["llama", "gemma3", "gpt2"])
def test_the_session_graph_outputs_them_as_the_graphs_of_each_kind_do(family, checkpoints, eagle_bundles):
    bundle = eagle_bundles(family)
    sess = ort.InferenceSession(str(bundle.path / bundle.model("target").session.file))
    hf = transformers.AutoModelForCausalLM.from_pretrained(checkpoints(family)).eval()
    cache = empty_cache(bundle.manifest, "target", 2)
    lengths = np.array([len(p) for p in PROMPTS], np.int64)
    out = run_session(sess, bundle, "target", "forward", False, {"input_ids": padded(PROMPTS),
                      "past_len": np.zeros(2, np.int64), "token_count": lengths}, cache)
    for row, prompt in enumerate(PROMPTS):
        assert_close(out[AUX_HIDDEN][row, : len(prompt)], hf_states(hf, prompt))
    out = run_session(sess, bundle, "target", "verify", False, {"input_ids": np.array(DRAFTS, np.int64),
                      "past_len": lengths, "draft_len": np.full(2, GAMMA, np.int64)}, cache)
    for row, (prompt, drafts) in enumerate(zip(PROMPTS, DRAFTS)):
        assert_close(out[AUX_HIDDEN][row], hf_states(hf, prompt + drafts)[len(prompt):])


# ---------------------------------------------------------------------------------------------
# the graphs: one node and one output more with aux layers, nothing at all without


def builders(spec, aux: tuple[int, ...]) -> dict:
    """Every graph builder that takes aux layers, in each of its forms."""
    made, vocab = {}, spec.hp["vocab_size"]
    for single in (False, True):
        for sample in (False, True):
            made["forward", single, sample] = build_forward_graph(spec, "g", 64, vocab, sample=sample,
                                                                  single_sequence=single, aux_layers=aux)
            made["verify", single, sample] = build_verify_graph(spec, "g", GAMMA, 64, vocab, sample=sample,
                                                                single_sequence=single, aux_layers=aux)
    made["session"] = build_session_graph(spec, "g", 64, vocab, list(KINDS)[:5], aux_layers=aux)
    return made


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_aux_layers_add_one_node_and_one_output_and_change_nothing_else(family, checkpoints):
    spec = load_checkpoint(checkpoints(family))
    plain, with_aux = builders(spec, ()), builders(spec, AUX)
    for form, g in with_aux.items():
        nodes = [n.SerializeToString() for n in g.graph_nodes() if AUX_HIDDEN not in n.output]
        assert nodes == [n.SerializeToString() for n in plain[form].graph_nodes()], form
        assert len(nodes) == len(g.nodes) - 1
        outputs = [o for o in g.outputs if o.name != AUX_HIDDEN]
        assert outputs == plain[form].outputs and len(outputs) == len(g.outputs) - 1, form
        assert (g.inputs, list(g.weights), g.constants) == (plain[form].inputs, list(plain[form].weights),
                                                            plain[form].constants), form
        assert not any(AUX_HIDDEN in n.output for n in plain[form].graph_nodes())


# ---------------------------------------------------------------------------------------------
# the build and the manifest


def manifest_json(bundle) -> dict:
    return json.loads((bundle.path / MANIFEST).read_text())


def test_a_bundle_without_the_option_has_the_graphs_and_manifest_it_had(eagle_bundles):
    off, on = eagle_bundles("llama", None), eagle_bundles("llama")
    data = manifest_json(off)
    assert "eagle_aux_layers" not in data["models"]["target"] and AUX_HIDDEN not in json.dumps(data)
    assert json.dumps(Manifest.from_json(data).to_json(), indent=1) == (off.path / MANIFEST).read_text()
    assert manifest_json(on)["models"]["target"]["eagle_aux_layers"] == list(AUX)
    assert set(off.manifest.graphs) == set(on.manifest.graphs)
    for name, entry in off.manifest.graphs.items():
        aux = on.manifest.graphs[name]
        expected = entry.outputs + tuple(o for o in aux.outputs if o.name == AUX_HIDDEN)
        assert sorted(aux.outputs, key=str) == sorted(expected, key=str) and aux.inputs == entry.inputs, name
        assert off.manifest.read_back(entry.id) == entry.id.outputs
        has_aux = name in {"target_forward", "target_sample", f"target_verify_g{GAMMA}",
                           f"target_verify_sample_g{GAMMA}"}
        assert (AUX_HIDDEN in on.manifest.read_back(entry.id)) == has_aux == (len(aux.outputs) > len(entry.outputs))
        if not has_aux:  # the score graph: the very same file
            assert off.manifest.files[entry.file] == on.manifest.files[aux.file]
    assert on.manifest.read_back(GraphId.step("target", False)) == (*GraphId.step("target", False).outputs, AUX_HIDDEN)


def test_a_draft_bundle_gives_the_draft_no_aux_hidden(checkpoints, tmp_path):
    bundle = open_bundle(build_bundle(checkpoints("llama"), checkpoints("llama", "draft"), tmp_path / "b",
                                      gammas=[2], max_seq=64, max_batch=1, eagle_aux_layers=(0, 1, 1)))
    assert bundle.model("draft").eagle_aux_layers == () and bundle.model("target").eagle_aux_layers == (0, 1, 1)
    for name, entry in bundle.manifest.graphs.items():
        assert (AUX_HIDDEN in {o.name for o in entry.outputs}) == (entry.id.model == "target" and "score" not in name)
    assert "eagle_aux_layers" not in manifest_json(bundle)["models"]["draft"]


@pytest.mark.parametrize("layers", [(0, 1), (0, 1, 1, 0), (0, 1, 2), (-1, 0, 1), (0, 1.0, 1), (True, 0, 1)])
def test_the_build_refuses_layers_that_are_not_three_of_the_targets_in_one_line(layers, checkpoints, tmp_path):
    with pytest.raises(SpecCompileError) as refused:
        build_bundle(checkpoints("llama"), None, tmp_path / "b", gammas=[2], max_seq=64, eagle_aux_layers=layers)
    message = str(refused.value)
    assert "\n" not in message and "3 layer ids of the target's 2 (0..1)" in message and str(list(layers)) in message
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("change", ["out of range", "empty", "not integers", "on the draft", "output missing",
                                    "output unannounced", "wrong width"])
def test_the_manifest_refuses_aux_layers_that_do_not_match_its_graphs(change, eagle_bundles):
    data = manifest_json(eagle_bundles("llama"))
    target, forward = data["models"]["target"], data["graphs"]["target_forward"]
    aux_output = next(o for o in forward["outputs"] if o["name"] == AUX_HIDDEN)
    if change == "out of range":
        target["eagle_aux_layers"] = [0, 1, 2]
    elif change == "empty":
        target["eagle_aux_layers"] = []
    elif change == "not integers":
        target["eagle_aux_layers"] = [0, "1", 1]
    elif change == "on the draft":
        data["models"]["draft"] = dict(target)
    elif change == "output missing":
        forward["outputs"].remove(aux_output)
    elif change == "output unannounced":
        del target["eagle_aux_layers"]
    else:
        aux_output["shape"][-1] += 1
    with pytest.raises(SpecCompileError) as refused:
        Manifest.from_json(data)
    assert "\n" not in str(refused.value)


def test_the_manifest_with_aux_layers_reads_back_as_written(eagle_bundles):
    bundle = eagle_bundles("llama")
    assert Manifest.from_json(manifest_json(bundle)) == bundle.manifest
    assert json.dumps(bundle.manifest.to_json(), indent=1) == (bundle.path / MANIFEST).read_text()
    assert bundle.model("target").aux_hidden_width == len(AUX) * bundle.model("target").hidden_size
