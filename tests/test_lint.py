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


def functions_longer_than(path: Path, limit: int) -> list[str]:
    import ast

    tree = ast.parse(path.read_text())
    return [f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_the_server_s_functions_are_short_and_the_runtime_reads_in_one_sitting():
    """Routes are functions of a body and the server, none a page long; the runtime's class is the
    request API over its parts (params, requests, output, edge, backends), not their insides."""
    serve = sorted((ROOT / "speccompile" / "serve").glob("*.py"))
    long = [f for path in serve for f in functions_longer_than(path, 60)]
    assert not long, long
    assert len((ROOT / "speccompile" / "runtime" / "runtime.py").read_text().splitlines()) <= 300
