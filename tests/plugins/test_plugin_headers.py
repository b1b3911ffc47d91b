"""Every TensorRT plugin source compiles against TensorRT's public headers ($TensorRT_ROOT/include).

TensorRT's libraries cannot run here, but its headers can check what the plugin sources declare and
override (IPluginV3 and its capability interfaces): a signature that drifts from the headers fails
here rather than on the first machine with a GPU. .ci/run points TensorRT_ROOT at a copy of the
headers where one is present.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
SOURCES = sorted((PLUGINS / "tensorrt").glob("*.cpp"))


def _cuda_include() -> Path | None:
    """CUDA's headers, from nvcc's install (nvcc may be a wrapper script on PATH)."""
    for candidate in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if candidate and (Path(candidate) / "include" / "cuda_runtime_api.h").is_file():
            return Path(candidate) / "include"
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    out = subprocess.run([nvcc, "--version"], check=False, capture_output=True, text=True).stdout
    for install in sorted(Path("/usr/local").glob("cuda-*"), reverse=True):
        if (install / "include" / "cuda_runtime_api.h").is_file() and install.name.split("-")[1][:2] in out:
            return install / "include"
    include = Path(nvcc).resolve().parents[1] / "include"
    return include if (include / "cuda_runtime_api.h").is_file() else None


@pytest.fixture(scope="module")
def include_flags() -> list[str]:
    root = os.environ.get("TensorRT_ROOT")
    if not root or not (Path(root) / "include" / "NvInfer.h").is_file():
        pytest.skip("TensorRT_ROOT is unset or has no include/NvInfer.h: the plugin sources are not compiled here")
    cuda = _cuda_include()
    if cuda is None:
        pytest.skip("no CUDA headers (cuda_runtime_api.h) found next to nvcc")
    if shutil.which("g++") is None:
        pytest.skip("g++ is not on PATH")
    return [f"-I{Path(root) / 'include'}", f"-I{cuda}", f"-I{PLUGINS / 'tensorrt'}", f"-I{PLUGINS / 'kernels'}"]


def test_there_are_plugin_sources():
    assert {s.name for s in SOURCES} >= {"spec_accept_plugin.cpp", "spec_sampling_plugins.cpp"}


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_plugin_source_compiles_against_the_tensorrt_headers(source, include_flags):
    result = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", *include_flags, str(source)],
                            check=False, capture_output=True, text=True)
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 0, "\n".join(errors[:20]) or result.stderr[-2000:]
