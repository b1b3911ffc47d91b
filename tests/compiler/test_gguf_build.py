"""`build --target model.gguf`: a GGUF file compiles to the bundle its Hugging Face checkpoint would,
and its blocks (Q4_0-Q8_0, Q4_K-Q6_K) are compiled as they are (golden: HF on the file's values)."""

import json

import numpy as np
import onnx
import pytest
import torch
import transformers
from click.testing import CliRunner

import speccompile
from speccompile.bundle import open_bundle
from speccompile.cli import main
from speccompile.compiler.build import build_bundle
from speccompile.compiler.gguf import KEPT_BLOCKS, gguf_checkpoint
from tests.gguf_files import CHAT_TEMPLATE, FAMILIES, K_QUANT_SPREAD, make_hf_checkpoint, write_gguf

PROMPTS = [[5, 17, 33, 2, 9, 100, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
MAX_NEW = 20  # past the tiny Gemma's window of 8


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """files(family, qtype) -> (HF checkpoint, GGUF written from it as llama.cpp's converter does).
    K-quants need inputs in multiples of 256: their files are of a Llama of hidden size 256."""
    made, checkpoints = {}, {}

    def get(family: str, qtype: str = "F32"):
        hidden = 256 if qtype in K_QUANT_SPREAD else 64
        assert hidden == 64 or family == "llama", "K-quant files are of the wider Llama"
        if (family, hidden) not in checkpoints:
            checkpoints[family, hidden] = make_hf_checkpoint(tmp_path_factory.mktemp(family) / "hf", family,
                                                             hidden=hidden)
        if (family, qtype) not in made:
            out = tmp_path_factory.mktemp(f"{family}-{qtype}") / f"model-{qtype}.gguf"
            made[family, qtype] = write_gguf(checkpoints[family, hidden], out, qtype, chat_template=CHAT_TEMPLATE)
        return checkpoints[family, hidden], made[family, qtype]

    return get


def greedy(model, prompt: list[int], max_new: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                             pad_token_id=2)
    return out[0, len(prompt):].tolist()


def model_of_gguf(path):
    """transformers' model of exactly the GGUF's numbers: its config, and its tensors as the file's
    dequantized values (transformers' own GGUF loading drops rope scalings and Gemma's layer types)."""
    checkpoint = gguf_checkpoint(path)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**checkpoint.config))
    model.load_state_dict({name: torch.from_numpy(t.load()) for name, t in checkpoint.tensors.items()}, strict=False)
    return model.eval()


def generated(bundle, **options) -> tuple[list, list]:
    runtime = speccompile.load(bundle)
    alone = [runtime.generate([p], max_new_tokens=MAX_NEW, **options)[0].token_ids for p in PROMPTS]
    batched = [r.token_ids for r in runtime.generate(PROMPTS, max_new_tokens=MAX_NEW, **options)]
    return alone, batched


@pytest.mark.parametrize("family", FAMILIES)
def test_float_gguf_generates_what_its_checkpoint_generates_in_hf(family, files, tmp_path):
    """Target and draft both from GGUF files: speculative greedy output, alone and batched, equals HF
    generate on the checkpoint the file was converted from."""
    hf, gguf = files(family)
    bundle = build_bundle(gguf, gguf, tmp_path / "b", gammas=[3], max_seq=64, max_batch=2, target_weights="float32",
                          draft_weights="float32")
    expected = [greedy(transformers.AutoModelForCausalLM.from_pretrained(hf).eval(), p, MAX_NEW) for p in PROMPTS]
    alone, batched = generated(bundle, gamma=3)
    assert alone == batched == expected
    model = open_bundle(bundle).model("target")
    assert model.model_type == family and model.source_format.format == "gguf"


def session_graph(bundle) -> onnx.ModelProto:
    return onnx.load(str(bundle.path / "target_session.onnx"), load_external_data=False)


def assert_logits_are_the_files(bundle, gguf, graph_file: str | None = None) -> None:
    """The target's last logits on a prompt (from its single-sequence forward graph, or `graph_file`)
    are HF's on the file's dequantized weights but for the int8 rounding of activations that
    MatMulNBits does (as llama.cpp's CPU kernels do)."""
    from tests.compiler.test_transformer_parity import empty_cache, run_file

    prompt = PROMPTS[0]
    with torch.no_grad():
        expected = model_of_gguf(gguf)(torch.tensor([prompt])).logits[0, -1].numpy()
    feeds = {"input_ids": np.array([prompt]), "past_len": np.zeros(1, np.int64), "token_count": np.array([len(prompt)])}
    out, _ = run_file(bundle, graph_file or bundle.graph("target_forward").single_sequence.file, feeds,
                      empty_cache(bundle.manifest, "target", 1))
    error = np.abs(out["logits"][0] - expected[:len(out["logits"][0])]).max() / np.abs(expected).max()
    assert error < 0.04, f"logits off by {error:.1%} of their range"


@pytest.mark.parametrize("family, qtype", [("llama", kind) for kind in KEPT_BLOCKS]
                         + [("gemma3_text", kind) for kind in ("Q8_0", "Q4_0", "Q4_1")])
def test_blocks_are_compiled_as_the_file_holds_them(family, qtype, files, tmp_path):
    """By default (int8 for a GGUF) every projection and the LM head keep the file's blocks
    (MatMulNBits: 4-bit integers for Q4_0/Q4_1/Q4_K, 8-bit for the 5-8-bit formats, in the format's
    blocks, with the file's scales; for formats with a minimum, its product with each block's sum of
    the activations added). The logits are the file's model's, and speculative output equals plain
    decoding's, alone and batched. The embedding too: gathered as the file's integers, scaled and
    offset per block."""
    kept = KEPT_BLOCKS[qtype]
    _, gguf = files(family, qtype)
    bundle = open_bundle(build_bundle(gguf, None, tmp_path / "b", gammas=[2], max_seq=64, max_batch=2))
    source = bundle.model("target").source_format
    matrices = [name for name, kind in gguf_checkpoint(gguf).formats.items() if kind == qtype]
    assert source.kept == {qtype: len(matrices)} and source.converted == {}
    session = session_graph(bundle)
    nbits = [{a.name: a.i for a in n.attribute} for n in session.graph.node if n.op_type == "MatMulNBits"]
    assert {(a["bits"], a["block_size"]) for a in nbits} == {(kept.bits, kept.block)}
    assert len(nbits) == 4 * bundle.model("target").num_layers + 1  # qkv, o, gate_up and down; the LM head
    initializers = {t.name: t.data_type for t in session.graph.initializer}
    offsets = [name for name in initializers if name.endswith("_offset") and name != "embed_offset"]
    assert len(offsets) == (len(nbits) if kept.has_minimum else 0)
    assert "embed" not in initializers and initializers.get("embed_q") == onnx.TensorProto.INT8
    assert ("embed_offset" in initializers) == kept.has_minimum
    assert_logits_are_the_files(bundle, gguf)
    # speculative is plain decoding, alone and batched (the random K-quant models have near-ties that the
    # batch graph's attention and the single-sequence one's can break apart: each is compared with itself)
    assert generated(bundle.path) == generated(bundle.path, mode="autoregressive")


def test_fused_projections_of_mixed_formats_keep_every_part(files, tmp_path):
    """q in Q4_1, k in Q4_0, v in Q8_0 (llama.cpp's mixes give v more bits): q and k multiply in one
    MatMul on 4-bit blocks (k's offsets 0), v in one of its own on 8-bit blocks; nothing is quantized
    again, even at int4, and the logits are the file's."""
    hf, _ = files("llama")
    gguf = write_gguf(hf, tmp_path / "mixed.gguf", "Q4_1", mixed={".attn_k.": "Q4_0", ".attn_v.": "Q8_0"})
    bundle = open_bundle(build_bundle(gguf, None, tmp_path / "b", gammas=[2], max_seq=64, max_batch=1,
                                      target_weights="int4"))
    source = bundle.model("target").source_format
    assert source.kept == {"Q4_1": 12, "Q4_0": 2, "Q8_0": 2} and source.converted == {}  # 5 a layer, embedding, head
    bits = [a.i for n in session_graph(bundle).graph.node if n.op_type == "MatMulNBits" for a in n.attribute
            if a.name == "bits"]
    assert bits.count(8) == 2 and bits.count(4) == 4 * 2 + 1  # each layer's v; qk, o, gate_up, down, the head
    assert_logits_are_the_files(bundle, gguf)
    alone, _ = generated(bundle.path)
    plain, _ = generated(bundle.path, mode="autoregressive")
    assert alone == plain


def test_blocks_with_minimums_export_as_graphs_tensorrt_parses(files, tmp_path):
    """The portable graphs (--backend onnx) of a Q4_1 file: blocked DequantizeLinear on int4 and the
    offsets' Reshape, ReduceSum and MatMul pass TensorRT's rules (the build checks them and would
    refuse), and their logits are the file's."""
    _, gguf = files("llama", "Q4_1")
    bundle = open_bundle(build_bundle(gguf, None, tmp_path / "b", gammas=[2], max_seq=64, max_batch=1,
                                      backend="onnx", single_sequence=False))
    graph = onnx.load(str(bundle.path / bundle.graph("target_forward").file), load_external_data=False)
    ops = {n.op_type for n in graph.graph.node}
    assert {"DequantizeLinear", "ReduceSum"} <= ops and "MatMulNBits" not in ops
    assert_logits_are_the_files(bundle, gguf, bundle.graph("target_forward").file)


def test_a_float_build_of_a_quantized_gguf_takes_the_exact_values_of_its_blocks(files, tmp_path):
    """--target-weights float32: the file's Q8_0 values, dequantized exactly: greedy output is HF's on
    them (the parity build), with nothing kept as blocks."""
    _, gguf = files("gemma3_text", "Q8_0")
    bundle = build_bundle(gguf, None, tmp_path / "b", gammas=[2], max_seq=64, max_batch=2, target_weights="float32")
    source = open_bundle(bundle).model("target").source_format
    assert source.kept == {} and source.converted == {"Q8_0": 43}
    alone, batched = generated(bundle)
    assert alone == batched == [greedy(model_of_gguf(gguf), p, MAX_NEW) for p in PROMPTS]


def test_a_format_not_kept_is_dequantized_and_compiled_at_the_requested_precision(files, tmp_path):
    _, gguf = files("llama", "Q2_K")
    bundle = build_bundle(gguf, None, tmp_path / "b", gammas=[2], max_seq=64, max_batch=1, target_weights="int8")
    model = open_bundle(bundle).model("target")
    assert model.source_format.kept == {} and set(model.source_format.converted) == {"Q2_K"}
    assert model.matmul_weights == "int8"
    assert len(speccompile.load(bundle).generate([PROMPTS[0]], max_new_tokens=4)[0].token_ids) == 4


def test_int4_of_low_bit_blocks_it_does_not_keep_says_it_quantizes_twice(files, tmp_path, caplog):
    _, gguf = files("llama", "Q2_K")
    for weights in ("int8", "int4"):
        caplog.clear()
        build_bundle(gguf, None, tmp_path / weights, gammas=[2], max_seq=64, max_batch=1, target_weights=weights)
        said = [r.getMessage() for r in caplog.records if "quantized again to int4" in r.getMessage()]
        assert len(said) == (weights == "int4") and all("Q2_K" in line for line in said)
    caplog.clear()
    _, q4_k = files("llama", "Q4_K")  # kept as its blocks: nothing is quantized twice
    build_bundle(q4_k, None, tmp_path / "q4_k", gammas=[2], max_seq=64, max_batch=1, target_weights="int4")
    assert not [r for r in caplog.records if "quantized again" in r.getMessage()]


def test_the_gguf_tokenizer_chat_template_and_eos_reach_the_bundle(files, tmp_path):
    _, gguf = files("gemma3_text")
    bundle = build_bundle(gguf, None, tmp_path / "b", gammas=[2], max_seq=64, max_batch=1)
    runtime = speccompile.load(bundle)
    end_of_turn = runtime.tokenizer.encode("<end_of_turn>", special_tokens=False)
    assert len(end_of_turn) == 1 and end_of_turn[0] in open_bundle(bundle).manifest.tokenizer.eos_token_ids
    assert runtime.tokenizer.chat_template() == CHAT_TEMPLATE


def test_cli_builds_from_a_gguf_and_inspect_names_family_and_formats(files, tmp_path):
    _, gguf = files("llama", "Q8_0")
    out = tmp_path / "b"
    result = CliRunner().invoke(main, ["build", "--target", str(gguf), "--out", str(out), "--max-seq", "64",
                                       "--max-batch", "1", "--gamma", "2"])
    assert result.exit_code == 0, result.output
    shown = CliRunner().invoke(main, ["inspect", str(out)])
    assert "target: llama" in shown.output and "from GGUF: kept 16 Q8_0 as blocks, dequantized nothing" in shown.output
    assert "(int8 matmuls" in shown.output  # a GGUF's default precision
    described = json.loads(CliRunner().invoke(main, ["inspect", str(out), "--json"]).output)
    assert described["models"]["target"]["source_format"]["kept"] == {"Q8_0": 16}


def test_a_gguf_of_an_unsupported_architecture_is_one_line(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = CliRunner().invoke(main, ["build", "--target", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "b")])
    assert result.exit_code == 1
    assert result.output.strip().splitlines()[-1].startswith("Error: ")
    assert "GGUF architecture 'mamba' is not supported" in result.output


GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}{% set role = 'model' %}"
                  "{% else %}{% set role = m['role'] %}{% endif %}<start_of_turn>{{ role }}\n{{ m['content'] | trim }}"
                  "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_a_gguf_chat_template_renders_as_transformers_renders_it(files, tmp_path):
    """The file's tokenizer.chat_template, with the special tokens the file names, gives the text
    transformers' apply_chat_template gives for the tokenizer transformers loads from the file."""
    from speccompile.serve.chat import render_chat

    hf, _ = files("gemma3_text")
    gguf = write_gguf(hf, tmp_path / "chat.gguf", "Q8_0", chat_template=GEMMA_TEMPLATE)
    bundle = build_bundle(gguf, None, tmp_path / "b", gammas=[2], max_seq=64, max_batch=1)
    tokenizer = speccompile.load(bundle).tokenizer
    messages = [{"role": "user", "content": "Hi there "}, {"role": "assistant", "content": "Hello."},
                {"role": "user", "content": "What is 2 + 2?"}]
    theirs = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_chat(tokenizer.chat_template(), tokenizer.special_tokens(), messages) == expected
    assert expected.startswith("<s><start_of_turn>user\nHi there<end_of_turn>")


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_gguf_draft_pairs_with_the_hf_checkpoint_it_came_from(family, files, tmp_path):
    """The tokenizer gate sees the GGUF's converted tokenizer as the checkpoint's own (the converter's
    [PAD] placeholders and its empty subword affixes change no id), and a float32 draft that is the
    target's own file agrees with it but at near ties (these random models' top logits lie close, and
    one token at a time rounds differently from a verification's γ + 1); a wrong mapping of any
    tensor would agree on almost none."""
    hf, gguf = files(family)
    bundle = build_bundle(hf, gguf, tmp_path / "b", gammas=[3], max_seq=64, max_batch=1, draft_weights="float32")
    [result] = speccompile.load(bundle).generate([PROMPTS[0]], max_new_tokens=MAX_NEW, gamma=3)
    assert result.stats.acceptance_rate >= 0.8


def test_tensorrt_is_told_it_cannot_take_8_bit_blocks_of_a_bundle_built_for_onnx_runtime(files, tmp_path):
    from speccompile.compiler.tensorrt_build import check_tensorrt_weights
    from speccompile.errors import SpecCompileError

    for qtype in ("Q8_0", "Q4_0"):
        _, gguf = files("llama", qtype)
        bundle = build_bundle(gguf, None, tmp_path / qtype, gammas=[2], max_seq=64, max_batch=1)
        manifest = open_bundle(bundle).manifest
        if qtype == "Q4_0":  # INT4 blocks, which TensorRT reads
            check_tensorrt_weights(manifest)
            continue
        with pytest.raises(SpecCompileError, match="Q8_0 blocks are kept as int8 blocks.* --backend tensorrt"):
            check_tensorrt_weights(manifest)


def test_a_tensorrt_build_keeps_4_bit_blocks_and_compiles_the_others_at_its_precision(files, tmp_path, monkeypatch):
    """TensorRT block-dequantizes INT4 only: a build for it keeps the file's 4-bit blocks and compiles
    its 8-bit ones (Q8_0 v here) at --target-weights; what reaches the graphs is checked by TensorRT's
    own rule (check_tensorrt_sources) on the specs the export is given."""
    from speccompile.compiler import build as build_module
    from speccompile.compiler.tensorrt_build import check_tensorrt_sources

    hf, _ = files("llama")
    gguf = write_gguf(hf, tmp_path / "mixed.gguf", "Q4_1", mixed={".attn_v.": "Q8_0"})
    exported = []

    def export(target, *args, **kwargs):
        exported.append(target)
        raise KeyboardInterrupt  # stop here: the rest of a TensorRT build needs TensorRT

    monkeypatch.setattr(build_module, "require_tensorrt_build", lambda options: None)  # as if TensorRT were here
    monkeypatch.setattr(build_module, "_export_graphs", export)
    with pytest.raises(KeyboardInterrupt):
        speccompile.build(gguf, None, tmp_path / "b", gammas=[2], max_seq=64, max_batch=1, backend="tensorrt",
                          target_weights="int4")
    (target,) = exported
    assert target.source.kept == {"Q4_1": 14} and target.source.converted == {"Q8_0": 2}
    check_tensorrt_sources({"target": target.source.kept})
    assert {w.blocks.bits for w in target.weights.values() if getattr(w, "blocks", None)} == {4}
