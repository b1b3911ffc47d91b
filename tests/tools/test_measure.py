"""The measurement harness (tools/measure): interleaved cold repeats, the record's JSON round trip,
its tables in the docs (the MkDocs hook) and on the command line, and the scenarios' registry."""

import importlib.util
import json
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest

from tools.measure import options
from tools.measure.__main__ import main
from tools.measure.harness import interleaved, stamp
from tools.measure.record import Column, Measured, Record, Spread, Table, rendered
from tools.measure.scenarios import SCENARIOS, scenario

ROOT = Path(__file__).resolve().parents[2]


class FakeRuntime:
    def __init__(self, log: list):
        self.log = log

    def forget(self):
        self.log.append("forget")


def test_variants_take_turns_and_every_measured_run_starts_cold():
    log = []
    variants = {name: (lambda repeat, name=name: log.append((name, repeat)) or repeat) for name in ("a", "b")}
    samples = interleaved(variants, repeats=2, cold=[FakeRuntime(log)], alternate=True)
    assert log == ["forget", ("a", 0), "forget", ("b", 0), "forget", ("b", 1), "forget", ("a", 1)]
    assert [s.value for s in samples["a"]] == [0, 1] and all(s.seconds >= 0 for s in samples["b"])


def test_interleaved_refuses_no_repeats():
    from speccompile.errors import SpecCompileError

    with pytest.raises(SpecCompileError, match="--repeats must be positive"):
        interleaved({"a": lambda _: None}, repeats=0)


def _measured() -> Measured:
    columns = (Column("variant"), Column("tokens_per_s", "tok/s", 1), Column("speedup", "×", 2),
               Column("by_position", digits=2), Column("plain", label="decoded plainly"), Column("nodes"))
    rows = [{"variant": "draft | model", "tokens_per_s": Spread.of([510.25, 498.5, 530.0]), "speedup": 1.5312,
             "by_position": (0.81, 0.64), "plain": False, "nodes": None},
            {"variant": "medusa tree 8", "tokens_per_s": Spread.of([400.0]), "speedup": 1.2, "by_position": (),
             "plain": True, "nodes": 8}]
    steps = Table.of("steps", (Column("context", "tokens"), Column("ms", "ms", 2)), [{"context": 64, "ms": 2.5}],
                     "step times")
    return Measured((Table.of("variants", columns, rows, "the variants"), steps), {"prompts": 12, "tree": [1, 2]})


def test_a_stamped_record_round_trips_through_its_json_file(tmp_path):
    record = stamp("medusa", ["--repeats", "3", "--sizes", "4,8"], _measured())
    assert record.command == "python -m tools.measure medusa --repeats 3 --sizes 4,8"
    assert record.machine.cores >= 1 and record.machine.backend == "onnxruntime" and record.date
    path = record.write(tmp_path / "medusa.json")
    assert json.loads(path.read_text())["tables"][0]["rows"][0]["tokens_per_s"]["median"] == 510.25
    assert Record.read(path) == record


def test_a_row_must_have_exactly_the_tables_columns():
    with pytest.raises(ValueError, match="a row has"):
        Table.of("t", (Column("a"), Column("b")), [{"a": 1}])


@pytest.fixture
def measurements(tmp_path) -> Path:
    stamp("medusa", ["--repeats", "3"], _measured()).write(tmp_path / "measurements" / "medusa.json")
    return tmp_path


def _hook():
    spec = importlib.util.spec_from_file_location("measurements_hook", ROOT / "docs" / "hooks" / "measurements.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def test_the_hook_renders_a_marker_as_its_tables_and_how_they_were_measured(measurements):
    page = "# Medusa\n\nBefore.\n\n<!-- measurement: medusa -->\n\nAfter.\n"
    out = _hook().on_page_markdown(page, page=None, config={"docs_dir": str(measurements)}, files=None)
    assert "<!-- measurement" not in out and out.startswith("# Medusa\n\nBefore.\n\n") and out.endswith("\n\nAfter.\n")
    assert "| variant | tokens per s (tok/s) | speedup (×) | by position | decoded plainly | nodes |" in out
    assert "| --- | ---: | ---: | --- | --- | ---: |" in out
    assert "| draft \\| model | 510.2 (498.5–530.0) | 1.53 | 0.81, 0.64 | no | – |" in out
    assert "| medusa tree 8 | 400.0 | 1.20 |  | yes | 8 |" in out
    assert "**the variants**" in out and "**step times**" in out
    assert "Measured with `python -m tools.measure medusa --repeats 3` on " in out


def test_a_marker_may_name_one_table_and_a_missing_record_says_how_to_make_it(measurements, caplog):
    hook = _hook()
    config = {"docs_dir": str(measurements)}
    one = hook.on_page_markdown("<!-- measurement: medusa/steps -->", config=config)
    assert one.startswith("| context (tokens) | ms (ms) |\n| ---: | ---: |\n| 64 | 2.50 |\n\nMeasured with")
    assert "variant" not in one
    with caplog.at_level(logging.WARNING):
        missing = hook.on_page_markdown("<!-- measurement: load -->", config=config)
    assert "`python -m tools.measure load`" in missing and "no measurement" in caplog.text


def test_the_table_command_prints_what_the_docs_show(measurements, capsys):
    assert main(["table", "medusa/variants", "--dir", str(measurements / "measurements")]) == 0
    assert capsys.readouterr().out.strip() == rendered("medusa/variants", measurements / "measurements")


def test_a_scenario_run_writes_its_record_and_prints_its_table(tmp_path, monkeypatch, capsys):
    fake = types.ModuleType("fake_scenario", "A fake scenario.")
    fake.COMMON = options.Common(repeats=2)
    fake.run = lambda args: Measured((Table.of("t", (Column("repeats"),), [{"repeats": args.repeats}]),))
    monkeypatch.setitem(sys.modules, "fake_scenario", fake)
    monkeypatch.setitem(SCENARIOS, "fake", "fake_scenario")
    assert main(["fake", "--repeats", "5", "--out", str(tmp_path / "fake.json")]) == 0
    record = Record.read(tmp_path / "fake.json")
    assert record.tables[0].rows == ((5,),) and record.command.endswith("fake --repeats 5 --out " + str(tmp_path /
                                                                                                        "fake.json"))
    assert "| 5 |" in capsys.readouterr().out


def test_an_unknown_scenario_fails_with_one_clear_line():
    result = subprocess.run([sys.executable, "-m", "tools.measure", "no_such_scenario"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: unknown scenario 'no_such_scenario'; the scenarios: ab_generate,")


def test_prompts_are_a_count_or_a_file():
    assert options.prompts_option("12") == options.Prompts(count=12)
    assert options.prompts_option("mine.json") == options.Prompts(file=Path("mine.json"))
    assert options.Prompts(count=2).pick(lambda n: ["a", "b", "c"][:n]) == ["a", "b"]


def test_every_scenario_module_is_registered():
    modules = {p.stem for p in (ROOT / "tools" / "measure" / "scenarios").glob("*.py")} - {"__init__"}
    assert modules == set(SCENARIOS)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_scenario_imports_and_has_its_entry_and_options(name):
    module = scenario(name)
    assert callable(module.run) and isinstance(module.COMMON, options.Common)
    assert module.__doc__ and f"python -m tools.measure {name}" in module.__doc__
    parser = options.parser(name, module)
    assert parser.get_default("out") is None


def test_llama_cpp_timings_are_read_from_its_own_log_lines():
    """The llama_cpp scenario's parsers, on lines in llama.cpp's formats (llama-context.cpp's perf
    print; speculative-simple's summary): whole requests, prefill included."""
    from tools.measure.scenarios.llama_cpp import parse_plain, parse_speculative

    plain = ("llama_perf_sampler_print:    sampling time =       5.10 ms /    80 runs   (    0.06 ms per token)\n"
             "llama_perf_context_print:        load time =     412.00 ms\n"
             "llama_perf_context_print: prompt eval time =     250.00 ms /    17 tokens (   14.71 ms per token,"
             "    68.00 tokens per second)\n"
             "llama_perf_context_print:        eval time =    3150.00 ms /    63 runs   (   50.00 ms per token,"
             "    20.00 tokens per second)\n")
    assert parse_plain(plain) == {"tokens": 64, "seconds": 3.4, "prompt_tokens": 17, "prefill_ms": 250.0,
                                  "per_token_ms": 50.0}
    speculative = ("encoded   17 tokens in    0.300 seconds, speed:   56.667 t/s\n"
                   "decoded   66 tokens in    2.700 seconds, speed:   24.444 t/s\n\n"
                   "n_draft   = 4\nn_predict = 66\nn_drafted = 60\nn_accept  = 51\naccept    = 85.000%\n")
    assert parse_speculative(speculative) == {"tokens": 66, "seconds": 3.0, "drafted": 60, "accepted": 51}
