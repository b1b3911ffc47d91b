"""The options scenarios share, defined once: each scenario says which it takes, with its defaults."""

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MEASUREMENTS = Path(__file__).resolve().parents[2] / "docs" / "measurements"


@dataclass(frozen=True)
class Common:
    """Which common options a scenario takes (None, False: not taken) and their defaults."""

    bundle: bool = False  # --bundle DIR, default the demo bundle
    prompts: int | None = None  # --prompts N|FILE, default N of the scenario's own prompts
    max_new_tokens: int | None = None
    repeats: int | None = None


@dataclass(frozen=True)
class Prompts:
    """--prompts: N of a scenario's own prompts, or a file of prompts to run instead (a JSON list of
    strings, or one prompt a line)."""

    count: int | None = None
    file: Path | None = None

    def pick(self, own: Callable[[int], list[str]]) -> list[str]:
        if self.file is not None:
            from speccompile.runtime.bench import read_prompts

            return read_prompts(self.file)
        return own(self.count)


def prompts_option(text: str) -> Prompts:
    if text.isdigit():
        return Prompts(count=positive(text))
    return Prompts(file=Path(text))


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def parser(name: str, scenario) -> argparse.ArgumentParser:
    """The scenario's command line: the common options it takes, --out, then its own (add_options)."""
    parser = argparse.ArgumentParser(prog=f"python -m tools.measure {name}", description=scenario.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common = scenario.COMMON
    if common.bundle:
        parser.add_argument("--bundle", type=Path, help="a bundle directory (default: the demo bundle, built once)")
    if common.prompts is not None:
        parser.add_argument("--prompts", type=prompts_option, default=Prompts(common.prompts), metavar="N|FILE",
                            help=f"N of the scenario's own prompts (default {common.prompts}), or a prompts file")
    if common.max_new_tokens is not None:
        parser.add_argument("--max-new-tokens", type=positive, default=common.max_new_tokens)
    if common.repeats is not None:
        parser.add_argument("--repeats", type=positive, default=common.repeats)
    parser.add_argument("--out", type=Path, help=f"the record's JSON file (default: docs/measurements/{name}.json)")
    if hasattr(scenario, "add_options"):
        scenario.add_options(parser)
    return parser


def bundle(args) -> Path:
    """--bundle, or the demo bundle (built into the cache on first use)."""
    if args.bundle is not None:
        return args.bundle
    from speccompile.demo import demo_bundle

    return demo_bundle()


def out_path(name: str, args) -> Path:
    return args.out or MEASUREMENTS / f"{name}.json"
