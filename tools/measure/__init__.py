"""One harness for every measurement: `python -m tools.measure SCENARIO [options]`, from the
repository root.

- `harness`: variants timed interleaved over repeats, each measured run cold; the record's stamp.
- `record`: the typed record (tables of named columns with units, the command that reproduces it,
  the machine, the date) as JSON under docs/measurements/, and its markdown tables.
- `options`: the options scenarios share (--bundle, --prompts, --max-new-tokens, --repeats, --out).
- `scenarios`: one module per scenario, registered by name in `scenarios.SCENARIOS`.
"""
