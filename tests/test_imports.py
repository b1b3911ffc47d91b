"""The package's dependencies point one way, and no import (lazy ones inside functions included) closes a cycle.

    app       speccompile (the API), cli, demo    may import anything below
    training  training                            compiler, core, base   (drafts are trained for the compiler)
    backends  compiler, runtime, serve            core, base             (neither imports the other)
    core      core                                base
    base      errors, bundle, corpus, progress,   errors only            (shared by every layer)
              tensorrt_setup, medusa_heads, eagle_head,
              user_cache

Read from the source (AST), so an import that only runs on one machine (TensorRT) or in one branch counts.
"""

import ast
from pathlib import Path

import speccompile

PACKAGE = Path(speccompile.__file__).parent
BASE = {"errors", "bundle", "corpus", "progress", "tensorrt_setup", "medusa_heads", "eagle_head", "user_cache"}
# what each part (the first name below `speccompile`) may import besides itself
ALLOWED = {
    "app": {"app", "training", "compiler", "runtime", "serve", "core", "base"},
    "training": {"compiler", "core", "base"},
    "compiler": {"core", "base"},
    "runtime": {"core", "base"},
    "serve": {"runtime", "core", "base"},
    "core": {"base"},
    "base": set(),  # errors only
}
# Within the runtime, bench and profile drive a Runtime (generate, its engines); runtime.py calling
# into them makes a loop that no import cycle shows, so it counts as a wrong-way edge here.
DRIVERS = {"speccompile.runtime.bench", "speccompile.runtime.profile"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imported(module: str, node: ast.AST) -> list[str]:
    """The package's modules an import statement names (`from x import y` names x.y when y is a module)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: resolve against the importing module's package
            package = module.split(".")[: len(module.split(".")) - node.level + (MODULES[module].stem == "__init__")]
            base = ".".join(package + ([base] if base else []))
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    else:
        return []
    return [name for name in names if name in MODULES]


def edges() -> set[tuple[str, str]]:
    found = set()
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            found |= {(module, name) for name in imported(module, node) if name != module}
    return found


def layer(module: str) -> str:
    name = module.split(".")[1] if "." in module else ""
    if name in BASE:
        return "base"
    return name if name in ALLOWED else "app"


def is_wrong_way(source: str, target: str) -> bool:
    if target == "speccompile.errors":
        return False  # anyone may import it; it imports nothing of ours
    source_layer, target_layer = layer(source), layer(target)
    if source_layer == "base" or (source_layer != target_layer and target_layer not in ALLOWED[source_layer]):
        return True
    return source_layer == "runtime" and target in DRIVERS and source not in DRIVERS


def cycles(graph: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    successors: dict[str, list[str]] = {}
    for source, target in sorted(graph):
        successors.setdefault(source, []).append(target)
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in successors.get(node, []):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(MODULES):
        if node not in index:
            visit(node)
    return found


def test_the_walk_sees_lazy_and_relative_imports():
    """The checks below are only as good as the edge list: it must hold imports made inside functions."""
    graph = edges()
    assert ("speccompile.cli", "speccompile.compiler.build") in graph  # imported inside the build command
    assert ("speccompile.compiler.build", "speccompile.bundle") in graph  # a module-level import


def test_no_import_cycle_between_modules():
    assert cycles(edges()) == []


def test_dependencies_point_one_way():
    wrong = sorted(edge for edge in edges() if is_wrong_way(*edge))
    listed = "\n".join(f"{source} -> {target}" for source, target in wrong)
    assert wrong == [], f"imports against the layers in this file's docstring:\n{listed}"


def test_a_wrong_way_edge_is_caught():
    assert is_wrong_way("speccompile.compiler.build", "speccompile.runtime.hardware")
    assert is_wrong_way("speccompile.runtime.bench", "speccompile.demo")
    assert is_wrong_way("speccompile.core.speculative", "speccompile.runtime.runtime")
    assert is_wrong_way("speccompile.bundle", "speccompile.compiler.build")
    assert is_wrong_way("speccompile.runtime.runtime", "speccompile.runtime.profile")
    assert not is_wrong_way("speccompile.training.distill", "speccompile.compiler.architectures")
    assert not is_wrong_way("speccompile.runtime.profile", "speccompile.runtime.bench")


def test_a_cycle_is_caught():
    bench, profile, runtime = "speccompile.runtime.bench", "speccompile.runtime.profile", "speccompile.runtime.runtime"
    assert cycles({(profile, bench), (bench, runtime), (runtime, profile)}) == [[bench, profile, runtime]]
    assert cycles({(profile, bench), (bench, runtime)}) == []
