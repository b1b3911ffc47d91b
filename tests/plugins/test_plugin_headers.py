"""Every TensorRT plugin source compiles against TensorRT's public headers ($TensorRT_ROOT/include).

TensorRT's libraries cannot run here, but its headers can check what the plugin sources declare and
override (IPluginV3 and its capability interfaces): a signature that drifts from the headers fails
here rather than on the first machine with a GPU. .ci/run points TensorRT_ROOT at a copy of the
headers where one is present.
"""

import subprocess
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
SOURCES = sorted((PLUGINS / "tensorrt").glob("*.cpp"))


def test_there_are_plugin_sources():
    assert {s.name for s in SOURCES} >= {"spec_accept_plugin.cpp", "spec_sampling_plugins.cpp"}


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_plugin_source_compiles_against_the_tensorrt_headers(source, include_flags):
    result = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", *include_flags, str(source)],
                            check=False, capture_output=True, text=True)
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert result.returncode == 0, "\n".join(errors[:20]) or result.stderr[-2000:]
