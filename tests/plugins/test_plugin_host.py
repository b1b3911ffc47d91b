"""The SpecAccept plugin's logic on the host, every mode: plugin_host_check.cpp links the plugin sources
with stub kernels and checks mode parsing, arity, formats, shapes, serialization and the arguments
enqueue() hands each kernel.

Only TensorRT's headers are needed: with SPECCOMPILE_NO_STATIC_REGISTRATION the plugin library calls
nothing in libnvinfer, so this runs wherever the header compile test does, GPU or not.
"""

import subprocess
from pathlib import Path

from tests.plugins.kernels_lib import PLUGINS

HOST_CHECK = Path(__file__).with_name("plugin_host_check.cpp")


def test_plugin_logic_holds_in_every_mode(include_flags, tmp_path):
    binary = tmp_path / "plugin_host_check"
    sources = [HOST_CHECK, *sorted((PLUGINS / "tensorrt").glob("*.cpp"))]  # getCreators needs every creator
    build = subprocess.run(["g++", "-std=c++17", "-DSPECCOMPILE_NO_STATIC_REGISTRATION", *include_flags, "-o",
                            str(binary), *map(str, sources)], check=False, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(binary)], check=False, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout
    assert "all checks hold" in run.stdout
