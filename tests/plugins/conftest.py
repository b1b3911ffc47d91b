import shutil

import pytest

from tests.plugins.kernels_lib import compile_kernels


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
