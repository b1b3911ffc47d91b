"""Timing shared by the scenarios, and the stamp that makes a scenario's tables a record.

`interleaved` runs named variants in turn, repeat after repeat (A, B, C, A, B, C, ...), so that a slow
stretch of the machine hits them all alike, and before every measured run it makes each runtime
given as `cold` forget what earlier runs taught it (`Runtime.forget`: suffix decoding's outputs, the
γ policy's acceptance), so no repeat learns from another. Scenarios that compare speculative with
plain decoding through `speccompile.runtime.bench` get the same from `bench` itself.
"""

import json
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from time import perf_counter
from typing import Generic, TypeVar

from speccompile.errors import SpecCompileError
from tools.measure.record import Machine, Measured, Record

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


@dataclass(frozen=True)
class Sample(Generic[T]):
    """One measured call: its wall time and what it returned."""

    seconds: float
    value: T


def in_fresh_process(script: str, *args) -> object:
    """Run a Python `script` with `args` in a fresh process from the repository root (where it can
    import this harness's prompts): what it printed last, read as JSON."""
    out = subprocess.run([sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    return json.loads(out.splitlines()[-1])


def timed(call: Callable[..., T], *args, **kwargs) -> Sample[T]:
    started = perf_counter()
    value = call(*args, **kwargs)
    return Sample(perf_counter() - started, value)


def forget(runtimes: Iterable) -> None:
    """Each runtime back to what a fresh load knows. A runtime of an older version, in an A/B
    comparison, may have no `forget`: it runs as it is."""
    for runtime in runtimes:
        getattr(runtime, "forget", lambda: None)()


def interleaved(variants: Mapping[str, Callable[[int], T]], repeats: int, cold: Iterable = (),
                alternate: bool = False) -> dict[str, list[Sample[T]]]:
    """Each repeat calls every variant once with the repeat's index, in order (reversed on odd repeats
    when `alternate`: two variants then take turns going first), each call preceded by `forget(cold)`.
    Returns each variant's samples, one per repeat."""
    if repeats < 1:
        raise SpecCompileError(f"--repeats must be positive, got {repeats}")
    cold = list(cold)
    samples: dict[str, list[Sample[T]]] = {name: [] for name in variants}
    for repeat in range(repeats):
        order = list(variants)[::-1] if alternate and repeat % 2 else list(variants)
        for name in order:
            forget(cold)
            samples[name].append(timed(variants[name], repeat))
    return samples


# ---- the record -----------------------------------------------------------------------------------


def command(scenario: str, argv: list[str]) -> str:
    return shlex.join(["python", "-m", "tools.measure", scenario, *argv])


def commit() -> str:
    """The repository's commit, marked when tracked files differ from it; "" outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT, capture_output=True).returncode
    except (OSError, subprocess.CalledProcessError):
        return ""
    return head + ("+changes" if changed else "")


def stamp(scenario: str, argv: list[str], measured: Measured) -> Record:
    """The scenario's tables with the command that measures them again, the machine, date and commit."""
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return Record(scenario, command(scenario, argv), Machine.here(), date, commit(), measured.tables,
                  measured.details)
