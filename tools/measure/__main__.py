"""python -m tools.measure SCENARIO [options]    measure; write docs/measurements/SCENARIO.json (or --out)
python -m tools.measure table NAME[/TABLE]      print a record's table(s) as the docs render them
python -m tools.measure list                    the scenarios, and what each measures

Run from the repository root. `python -m tools.measure SCENARIO --help` shows a scenario's options.
"""

import argparse
import logging
import sys
from pathlib import Path

from speccompile.errors import SpecCompileError
from tools.measure import options
from tools.measure.harness import stamp
from tools.measure.record import MissingMeasurement, markdown, rendered
from tools.measure.scenarios import SCENARIOS, scenario, summary


def measure(name: str, argv: list[str]) -> None:
    module = scenario(name)
    args = options.parser(name, module).parse_args(argv)
    record = stamp(name, argv, module.run(args))
    path = record.write(options.out_path(name, args))
    print(markdown(record))
    print(f"\n(written to {path})")


def table(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.measure table",
                                     description="A record's table(s) in markdown, as the docs render them.")
    parser.add_argument("reference", metavar="NAME[/TABLE]", help="docs/measurements/NAME.json, one table or all")
    parser.add_argument("--dir", type=Path, default=options.MEASUREMENTS, help="where the records are")
    args = parser.parse_args(argv)
    try:
        print(rendered(args.reference, args.dir))
    except MissingMeasurement as missing:
        raise SpecCompileError(str(missing)) from None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if not argv or argv[0] in ("-h", "--help"):
            print(__doc__)
        elif argv[0] == "list":
            for name in SCENARIOS:
                print(f"{name:16} {summary(name)}")
        elif argv[0] == "table":
            table(argv[1:])
        else:
            measure(argv[0], argv[1:])
    except SpecCompileError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
