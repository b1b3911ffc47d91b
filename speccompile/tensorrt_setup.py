"""TensorRT on this machine: its Python packages, our SpecAccept plugin library, and the GPU.

Both sides need these: the compiler builds engines with them and the runtime loads engines with
them, so they live here rather than in either. Nothing here imports TensorRT until asked.
"""

import os
import subprocess
from pathlib import Path

from speccompile.errors import SpecCompileError

PLUGIN_ENV = "SPECCOMPILE_PLUGIN_LIB"
DEFAULT_PLUGIN = Path(__file__).resolve().parents[1] / "build" / "plugins" / "libspeccompile_plugins.so"


def require_tensorrt():
    """Import tensorrt and polygraphy, or fail with one line naming what is missing."""
    missing = []
    try:
        import tensorrt
    except ImportError:
        missing.append("the tensorrt Python package (NVIDIA TensorRT 10.x/11.x with its native libraries)")
        tensorrt = None
    try:
        import polygraphy  # noqa: F401
    except ImportError:
        missing.append("polygraphy")
    if missing:
        raise SpecCompileError("the TensorRT backend needs " + " and ".join(missing)
                               + ": pip install 'speccompile[tensorrt]' on an NVIDIA machine")
    return tensorrt


def plugin_library(path=None) -> Path:
    path = Path(path or os.environ.get(PLUGIN_ENV) or DEFAULT_PLUGIN)
    if not path.is_file():
        raise SpecCompileError(f"SpecAccept plugin library not found at {path}: build plugins/ with CMake "
                               f"(see plugins/README.md) or set {PLUGIN_ENV}")
    return path


def gpu() -> dict:
    """Name and compute capability of GPU 0, from nvidia-smi ("unknown" where there is none)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.splitlines()[0]
        name, capability = (x.strip() for x in out.split(","))
        return {"gpu": name, "compute_capability": capability}
    except (OSError, subprocess.SubprocessError, IndexError, ValueError):
        return {"gpu": "unknown", "compute_capability": "unknown"}
