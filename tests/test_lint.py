"""The test command lints: ruff, configured in pyproject.toml, over the package, the tests and the tools."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing():
    """ruff comes with the test extra (pip install -e '.[test]'); without it, this fails saying so."""
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "speccompile", "tests", "tools"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
