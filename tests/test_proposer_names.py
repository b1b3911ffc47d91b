"""Proposers are objects: no module compares a proposer's name, but the registry that makes them
(core/proposers/__init__.py) and the edges that parse or print them (cli.py, present.py, serve/). "auto" is left
out of the check: it is also γ's AUTO, which modules compare by design."""

import ast
from pathlib import Path

from speccompile.core.proposers import KINDS

PACKAGE = Path(__file__).resolve().parents[1] / "speccompile"
# bundle.py: "draft" is a model's role there
ALLOWED = {"core/proposers/__init__.py", "cli.py", "present.py", "bundle.py"}
NAMES = set(KINDS) - {"auto"}


def comparisons_of_names(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            if any(isinstance(v, ast.Constant) and v.value in NAMES for v in values):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_compares_proposer_names_outside_the_registry_and_the_edges():
    offenders = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative in ALLOWED or relative.startswith("serve/"):
            continue
        if found := comparisons_of_names(path.read_text()):
            offenders[relative] = found
    assert offenders == {}


def test_the_check_sees_a_comparison():
    found = comparisons_of_names('if request.proposer == "ngram":\n    pass\n')
    assert found == ["line 1: request.proposer == 'ngram'"]
    assert comparisons_of_names('ok = proposer in ("draft", "medusa")\n')
