import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.plugins.kernels_lib import PLUGINS, compile_kernels


@pytest.fixture(scope="session")
def kernels_library(tmp_path_factory):
    """kernels_library(arch) -> path of the kernels built by nvcc for `arch`, compiled once per session."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH: the CUDA kernels cannot be compiled")
    built = {}

    def get(arch: str = "sm_80"):
        if arch not in built:
            out = tmp_path_factory.mktemp(f"kernels-{arch}") / "libspeccompile_kernels.so"
            built[arch] = compile_kernels(out, arch)
        return built[arch]

    return get


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


@pytest.fixture(scope="session")
def include_flags() -> list[str]:
    """g++ flags that find TensorRT's headers ($TensorRT_ROOT/include), CUDA's and the plugin sources'."""
    root = os.environ.get("TensorRT_ROOT")
    if not root or not (Path(root) / "include" / "NvInfer.h").is_file():
        pytest.skip("TensorRT_ROOT is unset or has no include/NvInfer.h: the plugin sources are not compiled here")
    cuda = _cuda_include()
    if cuda is None:
        pytest.skip("no CUDA headers (cuda_runtime_api.h) found next to nvcc")
    if shutil.which("g++") is None:
        pytest.skip("g++ is not on PATH")
    return [f"-I{Path(root) / 'include'}", f"-I{cuda}", f"-I{PLUGINS / 'tensorrt'}", f"-I{PLUGINS / 'kernels'}"]
