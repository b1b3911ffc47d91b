"""The backend is a choice everywhere, spelled one way: a bundle with TensorRT engines runs them where
TensorRT is installed, and says in one line that it runs its ONNX graphs where not."""

import importlib.util
import logging
import os
from pathlib import Path
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


def test_loading_for_onnx_runtime_asks_the_kernel_to_read_the_weights_ahead(bundles, monkeypatch):
    """On a cold start the weights come off the disk while the runtime's modules import; a bundle
    whose TensorRT engines run reads no weights files, so none is asked for."""
    path = bundles("llama")
    asked = []
    monkeypatch.setattr("os.posix_fadvise", lambda fd, offset, length, advice: asked.append(
        (Path(os.readlink(f"/proc/self/fd/{fd}")).name, offset, length, advice)))
    speccompile.load(path).close()
    assert sorted(asked) == [("draft.weights", 0, 0, os.POSIX_FADV_WILLNEED),
                             ("target.weights", 0, 0, os.POSIX_FADV_WILLNEED)]
    asked.clear()
    with pytest.raises(SpecCompileError):
        speccompile.load(path, backend="tensorrt")  # TensorRT missing here, or no engines in this bundle
    assert asked == []


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
