"""The TensorRT path: what runs anywhere (profiles, clear errors, inspect), and, where TensorRT and a
GPU exist, engines built from the bundle that generate exactly what ONNX Runtime generates."""

import importlib.util
import json

import pytest
from click.testing import CliRunner

from speccompile.bundle import open_bundle
from speccompile.cli import main
from speccompile.compiler.tensorrt_build import optimization_profiles

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


def test_optimization_profiles_cover_prefill_decode_and_fixed_gamma(bundles):
    manifest = open_bundle(bundles("llama", "random")).manifest
    prefill, decode = optimization_profiles(manifest.graphs["target_forward"], max_batch=4, max_seq=96)
    ids = {name: (lo, opt, hi) for name, lo, opt, hi in prefill}["input_ids"]
    assert ids == ([1, 1], [1, 24], [4, 96])
    assert {name: (lo, hi) for name, lo, _, hi in decode}["input_ids"] == ([1, 1], [4, 2])
    [verify] = optimization_profiles(manifest.graphs["target_verify_g4"], max_batch=4, max_seq=96)
    shapes = {name: (lo, hi) for name, lo, _, hi in verify}
    assert shapes["input_ids"] == ([1, 5], [4, 5])
    assert shapes["draft_len"] == ([1], [4])
    assert shapes["past_key.0"] == ([1, 2, 96, 16], [4, 2, 96, 16])
    for name, entry in manifest.graphs.items():  # every step graph, sampling too, takes prefill and decode
        assert len(optimization_profiles(entry, max_batch=4, max_seq=96)) == (1 if entry.id.gamma else 2), name


def test_tree_graphs_take_any_tree_up_to_the_largest_a_runtime_sizes(bundles):
    manifest = open_bundle(bundles("llama", "medusa")).manifest
    [profile] = optimization_profiles(manifest.graphs["target_verify_tree"], max_batch=4, max_seq=96)
    shapes = {name: (lo, hi) for name, lo, _, hi in profile}
    assert shapes["input_ids"] == ([1, 1], [4, 64]) and shapes["tree_mask"] == ([1, 1], [64, 64])
    assert shapes["tree_parents"] == ([1], [64]) and shapes["draft_len"] == ([1], [4])


@pytest.mark.skipif(HAS_TENSORRT, reason="checks the message shown where TensorRT is absent")
def test_build_without_tensorrt_is_one_clear_error_and_writes_nothing(tmp_path, checkpoints):
    result = CliRunner().invoke(main, ["build", "--target", str(checkpoints("llama")),
                                       "--draft", str(checkpoints("llama")), "--out", str(tmp_path / "b"),
                                       "--backend", "tensorrt"])
    assert result.exit_code == 1
    assert "the TensorRT backend needs the tensorrt Python package" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "b").exists()


@pytest.mark.skipif(HAS_TENSORRT, reason="checks the message shown where TensorRT is absent")
def test_the_python_build_without_tensorrt_is_one_clear_error_before_reading_or_writing_anything(
        tmp_path, checkpoints, monkeypatch):
    import speccompile
    from speccompile.compiler import build as build_module
    from speccompile.errors import SpecCompileError

    def unread(path):
        raise AssertionError(f"{path} was read before TensorRT was looked for")

    monkeypatch.setattr(build_module, "load_checkpoint", unread)
    with pytest.raises(SpecCompileError, match="the TensorRT backend needs the tensorrt Python package") as refused:
        speccompile.build(checkpoints("llama"), checkpoints("llama"), tmp_path / "b", backend="tensorrt")
    assert "\n" not in str(refused.value)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def engines_built(monkeypatch):
    """TensorRT as if it were here: the engines each build asks for, as (bundle, options)."""
    from speccompile.compiler import build as build_module

    built = []
    monkeypatch.setattr(build_module, "require_tensorrt_build", lambda options: (None, options.plugin_lib))
    monkeypatch.setattr(build_module, "build_tensorrt_engines", lambda out, options: built.append((out, options)))
    return built


def test_the_python_build_makes_engines_of_the_bundle_it_wrote(tmp_path, checkpoints, engines_built):
    import speccompile

    options = speccompile.TensorRTOptions(plugin_lib=tmp_path / "plugins.so", hardware_compat=True)
    out = speccompile.build(checkpoints("llama"), checkpoints("llama"), tmp_path / "b", gammas=[2], max_seq=64,
                            max_batch=1, single_sequence=False, backend="tensorrt", tensorrt=options)
    assert engines_built == [(out, options)] and (out / "manifest.json").is_file()


def test_the_build_command_passes_its_tensorrt_options_to_the_python_build(tmp_path, checkpoints, engines_built):
    from speccompile.compiler.tensorrt_build import TensorRTOptions

    result = CliRunner().invoke(main, ["build", "--target", str(checkpoints("llama")), "--draft",
                                       str(checkpoints("llama")), "--out", str(tmp_path / "b"), "--gamma", "2",
                                       "--max-seq", "64", "--no-single-sequence", "--backend", "tensorrt",
                                       "--timing-cache", str(tmp_path / "cache"), "--version-compat"])
    assert result.exit_code == 0, result.output
    assert engines_built == [(tmp_path / "b", TensorRTOptions(timing_cache=str(tmp_path / "cache"),
                                                             version_compat=True))]


@pytest.mark.parametrize("options, refused", [
    ({"backend": "tensorrt-llm"}, "backend must be one of onnxruntime, tensorrt, onnx, not 'tensorrt-llm'"),
    ({"tensorrt": {"hardware_compat": True}}, "--hardware-compat and --version-compat make TensorRT engines"),
])
def test_build_options_for_no_backend_are_refused_before_any_work(tmp_path, checkpoints, monkeypatch, options,
                                                                   refused):
    import speccompile
    from speccompile.compiler import build as build_module
    from speccompile.errors import SpecCompileError

    monkeypatch.setattr(build_module, "load_checkpoint", lambda path: pytest.fail("a checkpoint was read"))
    if "tensorrt" in options:
        options = {"tensorrt": speccompile.TensorRTOptions(**options["tensorrt"])}
    with pytest.raises(SpecCompileError, match=refused):
        speccompile.build(checkpoints("llama"), checkpoints("llama"), tmp_path / "b", **options)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(HAS_TENSORRT, reason="checks the message shown where TensorRT is absent")
def test_tensorrt_runtime_without_tensorrt_is_a_clear_error(bundles):
    import speccompile
    from speccompile.errors import SpecCompileError

    with pytest.raises(SpecCompileError, match="tensorrt Python package"):
        speccompile.load(bundles("llama", "random"), backend="tensorrt")


def test_inspect_lists_graphs_shapes_and_op_counts(bundles):
    result = CliRunner().invoke(main, ["inspect", str(bundles("qwen2", "random"))])
    assert result.exit_code == 0, result.output
    [verify_line] = [line for line in result.stdout.splitlines() if line.startswith("  target_verify_g4: ")]
    assert "[TensorRT: plugin needed]" not in verify_line
    assert "past_len int64['batch']" in result.stdout and "accepted int64['batch']" in result.stdout
    info = json.loads(CliRunner().invoke(main, ["inspect", str(bundles("qwen2", "random")), "--json"]).stdout)
    assert info["graphs"]["target_verify_sample_g4"]["op_counts"]["SpecAccept"] == 1
    assert info["graphs"]["target_verify_g4"]["single_sequence_nodes"] < info["graphs"]["target_verify_g4"]["nodes"]
    assert info["graphs"]["draft_forward"]["single_sequence_nodes"] is None  # head size 8: no fused variant
    assert "batch-1 variant" in result.stdout.split("target_verify_g4: ")[1].splitlines()[0]
    assert info["engines"] == {}


@pytest.mark.tensorrt
@pytest.mark.skipif(not HAS_TENSORRT, reason="tensorrt is not installed (needs NVIDIA TensorRT and a GPU)")
def test_tensorrt_engines_generate_what_onnxruntime_generates(tmp_path, bundles):  # pragma: no cover - needs TensorRT
    import shutil

    import speccompile
    from speccompile.compiler.tensorrt_build import build_tensorrt_engines

    bundle = shutil.copytree(bundles("llama", "random"), tmp_path / "b")
    build_tensorrt_engines(bundle)
    prompts = [[5, 17, 33], [8, 9, 10, 11, 12]]
    ort = speccompile.load(bundle).generate(prompts, max_new_tokens=16, gamma=4)
    trt = speccompile.load(bundle, backend="tensorrt").generate(prompts, max_new_tokens=16, gamma=4)
    assert [r.token_ids for r in trt] == [r.token_ids for r in ort]
