"""MkDocs hook: a page's `<!-- measurement: NAME -->` line (or `NAME/TABLE`, one table of several)
becomes the table(s) of docs/measurements/NAME.json, followed by a line saying how they were
measured: the command and the machine. The JSON files are written by `python -m tools.measure`, and
the tables rendered by its record module, the same code as `python -m tools.measure table NAME`.

A marker whose file is missing renders as a note with the command that makes it, and logs a warning
(an error under `mkdocs build --strict`).
"""

import importlib.util
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
log = logging.getLogger("mkdocs.hooks.measurements")


def _record_module():
    """tools/measure/record.py, loaded by its path: MkDocs runs hooks without the repository on
    sys.path, and the module needs nothing but the standard library."""
    name = "speccompile_measurement_record"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / "measure" / "record.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # before running it: its dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


record = _record_module()


def _rendered(match, directory: Path, page_name: str) -> str:
    reference = match.group(1) + (f"/{match.group(2)}" if match.group(2) else "")
    try:
        return record.rendered(reference, directory)
    except record.MissingMeasurement as missing:
        log.warning(f"{page_name}: {missing}")
        return f"*Not measured yet: `python -m tools.measure {match.group(1)}` makes this table.*"


def on_page_markdown(markdown: str, page=None, config=None, files=None, **kwargs) -> str:
    docs = Path(config["docs_dir"]) if config is not None else ROOT / "docs"
    where = getattr(getattr(page, "file", None), "src_path", "a page")
    return record.MARKER.sub(lambda m: _rendered(m, docs / "measurements", where), markdown)
