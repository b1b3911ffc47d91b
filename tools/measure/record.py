"""The measurement record: what a scenario measured, how to measure it again, and where.

One record per run of a scenario, written as JSON (docs/measurements/SCENARIO.json by default) and
rendered from that file into markdown tables, by `python -m tools.measure table` and by the docs'
hook (docs/hooks/measurements.py) alike, so that a table in the docs and the command that made it
cannot drift apart.

This module imports only the standard library (Machine.here excepted, at call time): the docs' hook
loads it by its path, without the repository on sys.path.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path


class MissingMeasurement(LookupError):
    """A record file, or a table in it, that is not there."""


# ---- cells ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """A median over repeats, with the lowest and highest repeat beside it."""

    median: float
    low: float
    high: float
    values: tuple[float, ...] = ()

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        values = tuple(float(v) for v in values)
        if not values:
            raise ValueError("a spread of no values")
        return cls(statistics.median(values), min(values), max(values), values)

    def scaled(self, factor: float) -> Spread:
        return Spread(self.median * factor, self.low * factor, self.high * factor,
                      tuple(v * factor for v in self.values))


# A table cell: text, a number, a flag, nothing, a spread over repeats, or a short list of numbers.
Cell = str | int | float | bool | None | Spread | tuple


def _cell_to_json(cell: Cell):
    if isinstance(cell, Spread):
        return {"median": cell.median, "low": cell.low, "high": cell.high, "values": list(cell.values)}
    return list(cell) if isinstance(cell, tuple) else cell


def _cell_from_json(value) -> Cell:
    if isinstance(value, dict):
        return Spread(value["median"], value["low"], value["high"], tuple(value.get("values", ())))
    return tuple(value) if isinstance(value, list) else value


# ---- tables ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """A named column: `name` is its key in the JSON rows; the header shows `label` (default: the
    name, spaced) and the unit; floats show `digits` decimals."""

    name: str
    unit: str = ""
    digits: int = 2
    label: str = ""

    @property
    def header(self) -> str:
        text = self.label or self.name.replace("_", " ")
        return f"{text} ({self.unit})" if self.unit else text


@dataclass(frozen=True)
class Table:
    name: str
    columns: tuple[Column, ...]
    rows: tuple[tuple[Cell, ...], ...]
    title: str = ""

    @classmethod
    def of(cls, name: str, columns: Iterable[Column], rows: Iterable[Mapping[str, Cell]], title: str = "") -> Table:
        """From rows keyed by column name; every row must have exactly the columns' names."""
        columns = tuple(columns)
        names = [c.name for c in columns]
        checked = []
        for row in rows:
            if sorted(row) != sorted(names):
                raise ValueError(f"table {name}: a row has {sorted(row)}, the columns are {sorted(names)}")
            checked.append(tuple(row[n] for n in names))
        return cls(name, columns, tuple(checked), title)

    def column(self, name: str) -> list[Cell]:
        i = [c.name for c in self.columns].index(name)
        return [row[i] for row in self.rows]

    def to_json(self) -> dict:
        return {"name": self.name, "title": self.title,
                "columns": [{"name": c.name, "unit": c.unit, "digits": c.digits, "label": c.label}
                            for c in self.columns],
                "rows": [{c.name: _cell_to_json(v) for c, v in zip(self.columns, row)} for row in self.rows]}

    @classmethod
    def from_json(cls, data: dict) -> Table:
        columns = tuple(Column(**c) for c in data["columns"])
        rows = tuple(tuple(_cell_from_json(row[c.name]) for c in columns) for row in data["rows"])
        return cls(data["name"], columns, rows, data.get("title", ""))


@dataclass(frozen=True)
class Measured:
    """What a scenario's run returns: its tables, and what is behind them (JSON, never rendered)."""

    tables: tuple[Table, ...]
    details: dict = field(default_factory=dict)


# ---- where and how --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """The machine a record was measured on (the γ profiles' hardware fingerprint, and a little more)."""

    cpu: str
    cores: int
    arch: str
    isa: tuple[str, ...]
    memory_gb: float
    backend: str
    backend_version: str
    python: str

    @classmethod
    def here(cls) -> Machine:
        from speccompile.runtime.hardware import fingerprint

        fp = fingerprint()
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        return cls(fp["cpu"], fp["cores"], fp["machine"], tuple(fp["isa"]), round(memory / 2**30, 1), fp["backend"],
                   fp.get("backend_version", ""), platform.python_version())

    def describe(self) -> str:
        isa = f" ({', '.join(self.isa)})" if self.isa else ""
        return (f"{self.cpu}, {self.cores} cores{isa}, {self.memory_gb:g} GiB, "
                f"{self.backend} {self.backend_version}, Python {self.python}")


@dataclass(frozen=True)
class Record:
    scenario: str
    command: str  # run from the repository root, it measures this again
    machine: Machine
    date: str
    commit: str  # the repository's commit, "+changes" when its tracked files differed from it; "" outside git
    tables: tuple[Table, ...]
    details: dict = field(default_factory=dict)

    def table(self, name: str) -> Table:
        for table in self.tables:
            if table.name == name:
                return table
        raise MissingMeasurement(f"{self.scenario} has no table {name!r}; its tables: "
                                 f"{', '.join(t.name for t in self.tables)}")

    def to_json(self) -> dict:
        return {"scenario": self.scenario, "command": self.command, "machine": asdict(self.machine), "date": self.date,
                "commit": self.commit, "tables": [t.to_json() for t in self.tables], "details": self.details}

    @classmethod
    def from_json(cls, data: dict) -> Record:
        machine = Machine(**{**data["machine"], "isa": tuple(data["machine"]["isa"])})
        return cls(data["scenario"], data["command"], machine, data["date"], data["commit"],
                   tuple(Table.from_json(t) for t in data["tables"]), data.get("details", {}))

    def write(self, path: Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1, ensure_ascii=False) + "\n")
        return path

    @classmethod
    def read(cls, path: Path) -> Record:
        return cls.from_json(json.loads(Path(path).read_text()))


# ---- markdown -------------------------------------------------------------------------------------


def _text(cell: Cell, column: Column) -> str:
    if isinstance(cell, bool):
        return "yes" if cell else "no"
    if cell is None:
        return "–"
    if isinstance(cell, float):
        return f"{cell:.{column.digits}f}"
    if isinstance(cell, Spread):
        median = _text(cell.median, column)
        if cell.low == cell.high:
            return median
        return f"{median} ({_text(cell.low, column)}–{_text(cell.high, column)})"
    if isinstance(cell, tuple):
        return ", ".join(_text(c, column) for c in cell)
    return str(cell).replace("|", "\\|").replace("\n", " ")


def _numeric(table: Table, i: int) -> bool:
    cells = [row[i] for row in table.rows if row[i] is not None]
    return bool(cells) and all(isinstance(c, (int, float, Spread)) and not isinstance(c, bool) for c in cells)


def markdown_table(table: Table) -> str:
    """The table in markdown: numbers right-aligned; a spread as its median and (lowest–highest)."""
    align = ["---:" if _numeric(table, i) else "---" for i in range(len(table.columns))]
    lines = ["| " + " | ".join(c.header for c in table.columns) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(_text(v, c) for c, v in zip(table.columns, row)) + " |" for row in table.rows]
    return "\n".join(lines)


def provenance(record: Record) -> str:
    """One line: the command that measured it, the machine, the date and the commit."""
    commit = f", commit {record.commit}" if record.commit else ""
    return (f"Measured with `{record.command}` on {record.machine.describe()}; {record.date}{commit}.")


def markdown(record: Record, table: str | None = None) -> str:
    """One table of the record (by name) or all of them, each under its title when there are several,
    then the provenance line."""
    tables = [record.table(table)] if table else list(record.tables)
    parts = []
    for t in tables:
        if len(tables) > 1 and t.title:
            parts.append(f"**{t.title}**")
        parts.append(markdown_table(t))
    return "\n\n".join(parts + [provenance(record)])


# ---- markers in pages -----------------------------------------------------------------------------

MARKER = re.compile(r"^<!-- measurement: ([\w.-]+)(?:/([\w.-]+))? -->[ \t]*$", re.MULTILINE)


def rendered(reference: str, directory: Path) -> str:
    """`NAME` or `NAME/TABLE` as markdown, from directory/NAME.json."""
    name, _, table = reference.partition("/")
    path = Path(directory) / f"{name}.json"
    if not path.is_file():
        raise MissingMeasurement(f"no measurement {path}: run python -m tools.measure {name}")
    return markdown(Record.read(path), table or None)


def replace_markers(page: str, directory: Path) -> str:
    """Every `<!-- measurement: NAME[/TABLE] -->` line of a page, replaced by its table(s) and how they
    were measured."""
    return MARKER.sub(lambda m: rendered(m.group(1) + (f"/{m.group(2)}" if m.group(2) else ""), directory), page)
