"""Every scenario, by name: a module with a docstring (what it measures and how), `COMMON` (the
common options it takes), optionally `add_options(parser)`, and `run(args) -> Measured`. Modules
are imported only when their scenario runs: some need torch, onnx or an older speccompile."""

import importlib

from speccompile.errors import SpecCompileError

SCENARIOS = {name: f"tools.measure.scenarios.{name}" for name in (
    "ab_generate", "agreement", "burst", "demo", "eagle", "first_requests", "grammar_engines", "llama_cpp", "load",
    "matmul_kernels", "medusa", "never_slower", "overhead", "overhead_ab", "precisions", "prefill_stall", "proposers",
    "real_size", "sampling_rules", "stop_strings", "suffix")}


def summary(name: str) -> str:
    """The first paragraph of the scenario's docstring, on one line: what it measures."""
    return " ".join(scenario(name).__doc__.strip().split("\n\n")[0].split())


def scenario(name: str):
    """The scenario's module; an unknown name is a user error that lists the known ones."""
    if name not in SCENARIOS:
        raise SpecCompileError(f"unknown scenario {name!r}; the scenarios: {', '.join(SCENARIOS)}")
    return importlib.import_module(SCENARIOS[name])
