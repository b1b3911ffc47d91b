"""The backend is a choice everywhere, spelled one way: a bundle with TensorRT engines runs them where
TensorRT is installed, and says in one line that it runs its ONNX graphs where not."""

import importlib.util
import logging
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

import speccompile
from speccompile.cli import main
from speccompile.errors import SpecCompileError
from speccompile.runtime.runtime import resolve_backend

tensorrt_missing = importlib.util.find_spec("tensorrt") is None


def test_auto_runs_the_onnx_graphs_of_a_bundle_without_engines(bundles):
    runtime = speccompile.load(bundles("llama"))
    assert runtime.backend == "onnxruntime" and runtime.speculative_config()["backend"] == "onnxruntime"
    runtime.close()


@pytest.mark.skipif(not tensorrt_missing, reason="TensorRT is installed here")
def test_engines_without_tensorrt_say_so_in_one_line_and_run_on_onnx_runtime(caplog):
    bundle = SimpleNamespace(manifest=SimpleNamespace(engines={"target_forward": {}}), path="bundle/")
    with caplog.at_level(logging.WARNING, logger="speccompile"):
        assert resolve_backend(bundle, "auto") == "onnxruntime"
    [line] = [r.getMessage() for r in caplog.records]
    assert "has TensorRT engines, which cannot run here" in line and "ONNX Runtime" in line


@pytest.mark.skipif(not tensorrt_missing, reason="TensorRT is installed here")
def test_asking_for_tensorrt_where_it_is_missing_is_one_clear_error(bundles):
    with pytest.raises(SpecCompileError, match="tensorrt"):
        speccompile.load(bundles("llama"), backend="tensorrt")
    with pytest.raises(SpecCompileError, match="backend must be one of auto, onnxruntime, tensorrt"):
        speccompile.load(bundles("llama"), backend="onnx-runtime")
    result = CliRunner().invoke(main, ["generate", str(bundles("llama")), "--prompt", "x", "--backend", "tensorrt"])
    assert result.exit_code == 1 and len(result.output.strip().splitlines()) == 1, result.output
