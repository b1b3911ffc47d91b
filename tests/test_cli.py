"""Bad input: one clear line, exit code 1, no traceback, nothing half-written."""

import json
import shutil
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from speccompile.cli import main
from speccompile.core.params import GenerationParams
from speccompile.core.request import Request
from speccompile.present import print_streams, stats_line
from speccompile.runtime.output import Delta, OutputProcessor
from tests.tiny_models import make_checkpoint, make_tokenizer


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.output


def assert_user_error(args, *fragments):
    code, output = run(*args)
    assert code == 1, output
    assert "Traceback" not in output
    lines = [line for line in output.splitlines() if line.strip() and not line.startswith("[")]
    assert len(lines) == 1 and lines[0].startswith("Error: "), output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def build_args(target, draft, out, *extra):
    return ["build", "--target", target, "--draft", draft, "--out", out, *extra]


def no_partial_output(parent, name):
    return not any(p.name.startswith(f".{name}.") or p.name == name for p in parent.iterdir())


# -- build -------------------------------------------------------------------------------------


def test_missing_checkpoint_directory(tmp_path, checkpoints):
    assert_user_error(build_args(tmp_path / "nope", checkpoints("llama"), tmp_path / "out"), "not found")
    assert no_partial_output(tmp_path, "out")


def test_corrupt_safetensors(tmp_path, checkpoints):
    bad = shutil.copytree(checkpoints("llama"), tmp_path / "bad")
    weights = bad / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])
    assert_user_error(build_args(bad, checkpoints("llama"), tmp_path / "out"), "model.safetensors")
    assert no_partial_output(tmp_path, "out")


def test_pickle_only_checkpoint_is_refused(tmp_path, checkpoints):
    bad = shutil.copytree(checkpoints("llama"), tmp_path / "bad")
    (bad / "model.safetensors").rename(bad / "pytorch_model.bin")
    assert_user_error(build_args(bad, checkpoints("llama"), tmp_path / "out"), "pickle")


def test_unsupported_model_type(tmp_path, checkpoints):
    bad = shutil.copytree(checkpoints("llama"), tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    assert_user_error(build_args(checkpoints("llama"), bad, tmp_path / "out"), "unsupported model_type 'mamba'",
                      "llama")
    assert no_partial_output(tmp_path, "out")


def test_vocabulary_mismatch_says_what_differs(tmp_path, checkpoints):
    other = make_checkpoint(tmp_path / "other", "llama", size="draft",
                            tokenizer=make_tokenizer(extra_tokens=("<tool>",)))
    assert_user_error(build_args(checkpoints("llama"), other, tmp_path / "out"), "tokenizers differ", "'<tool>'")
    assert no_partial_output(tmp_path, "out")


def test_a_sliding_window_shorter_than_max_seq_builds(tmp_path, tokenizer):
    """Windows are masked in the graphs (tests/runtime/test_generate.py generates past them against
    HF), so a --max-seq beyond the window is no longer refused."""
    mistral = make_checkpoint(tmp_path / "m", "mistral", tokenizer=tokenizer, sliding_window=32)
    code, output = run(*build_args(mistral, mistral, tmp_path / "out", "--max-seq", 64, "--gamma", 2))
    assert code == 0, output


def test_existing_output_needs_force(tmp_path, bundles, checkpoints):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert_user_error(build_args(checkpoints("llama"), checkpoints("llama"), out), "--force")
    assert (out / "keep.txt").exists()


# -- generate ----------------------------------------------------------------------------------


@pytest.fixture
def bundle_copy(tmp_path, bundles):
    return shutil.copytree(bundles("llama", "random"), tmp_path / "bundle")


def test_sha256_mismatch(bundle_copy):
    weights = bundle_copy / "draft.weights"
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert_user_error(["generate", bundle_copy, "--prompt", "x"], "draft.weights", "sha256")


def test_unknown_format_version(bundle_copy):
    manifest = json.loads((bundle_copy / "manifest.json").read_text())
    (bundle_copy / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    assert_user_error(["generate", bundle_copy, "--prompt", "x"], "format version 99")


def test_not_a_bundle(tmp_path):
    assert_user_error(["generate", tmp_path, "--prompt", "x"], "not a speccompile bundle")


def test_gamma_not_compiled(bundles):
    assert_user_error(["generate", bundles("llama", "random"), "--prompt", "x", "--gamma", 3], "γ=3", "at (1, 4, or")


def test_prompt_longer_than_max_seq(bundles):
    assert_user_error(["generate", bundles("llama", "random"), "--prompt", "def f(x): return x " * 40],
                      "max sequence length 96")


def test_prompts_beyond_max_batch_wait_their_turn(bundles):
    """More prompts than the bundle's max batch: the engine queues them, every one is answered."""
    result = CliRunner().invoke(main, ["generate", str(bundles("llama", "random")), "--max-new-tokens", "3", "--json"]
                                + ["--prompt", "x"] * 5)
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)) == 5


@pytest.mark.parametrize("n", [0, -3])
def test_non_positive_max_new_tokens(bundles, n):
    assert_user_error(["generate", bundles("llama", "random"), "--prompt", "x", "--max-new-tokens", n],
                      "max_new_tokens")


@pytest.mark.parametrize("flag, value, fragment",
                         [("--temperature", -1, "temperature"), ("--top-p", 0, "top_p"), ("--top-k", -2, "top_k")])
def test_bad_sampling_controls(bundles, flag, value, fragment):
    assert_user_error(["generate", bundles("llama", "random"), "--prompt", "x", flag, value], fragment)


def test_sampling_flags_are_reproducible_from_the_seed(bundles):
    args = ["generate", bundles("llama", "random"), "--prompt", "import os", "--max-new-tokens", 8, "--json",
            "--temperature", 0.9, "--top-k", 40, "--top-p", 0.95]
    first, again, other = (json.loads(CliRunner().invoke(main, [str(a) for a in args + ["--seed", s]]).stdout)
                           for s in (1, 1, 2))
    assert first[0]["token_ids"] == again[0]["token_ids"] != other[0]["token_ids"]


# -- happy paths -------------------------------------------------------------------------------


def test_generate_json_output(bundles):
    code, output = run("generate", bundles("llama", "copy"), "--prompt", "import os", "--prompt", "def",
                       "--max-new-tokens", 6, "--gamma", 4, "--json")
    assert code == 0, output
    results = json.loads(output)
    assert [r["prompt"] for r in results] == ["import os", "def"]
    for r in results:
        assert set(r) == {"prompt", "text", "token_ids", "finish_reason", "stats"}
        assert r["stats"]["acceptance_rate"] == 1.0 and len(r["token_ids"]) <= 6
        assert r["stats"]["mean_acceptance_length"] == 1 + r["stats"]["mean_gamma"]
        assert "decode_ms" not in r["stats"] and r["stats"]["verify_ms"] > 0  # speculative phases only
    code, output = run("generate", bundles("llama", "copy"), "--prompt", "def", "--max-new-tokens", 6, "--json",
                       "--mode", "autoregressive")
    stats = json.loads(output)[0]["stats"]
    assert stats["decode_ms"] > 0 and "verify_ms" not in stats and stats["gamma"] == 0


def test_generate_streams_text_and_prints_stats(bundles):
    args = ["generate", str(bundles("llama", "copy")), "--prompt", "import os", "--max-new-tokens", "6", "--gamma", "4"]
    [expected] = json.loads(CliRunner().invoke(main, args + ["--json"]).stdout)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == "import os" + expected["text"] + "\n"
    assert result.stderr.startswith("[speculative γ=4] ") and "acceptance 1.00" in result.stderr
    assert "mean acceptance length 5.00 (4.00 of 4 drafts kept per verification)" in result.stderr


def test_several_prompts_each_print_their_text_and_a_labelled_stats_line(bundles):
    args = ["generate", str(bundles("llama", "random")), "--prompt", "import os", "--prompt", "def",
            "--max-new-tokens", "6", "--gamma", "1"]
    expected = json.loads(CliRunner().invoke(main, args + ["--json"]).stdout)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == (f"--- prompt 1/2\nimport os{expected[0]['text']}\n"
                             f"--- prompt 2/2\ndef{expected[1]['text']}\n")
    lines = result.stderr.splitlines()[-2:]
    assert lines[0].startswith("[prompt 1/2, speculative γ=1] ")
    assert lines[1].startswith("[prompt 2/2, speculative γ=1] ")


class Handle:
    """A handle whose output processor delivered these texts, and whose result has this text."""

    def __init__(self, texts: list[str], final: str):
        self.texts, self.final = texts, final

    def deltas(self):
        yield from (Delta([1], text) for text in self.texts)

    def result(self):
        return SimpleNamespace(text=self.final)


def test_streaming_prints_prompts_one_after_another_and_ends_each_as_its_result(capsys):
    results = print_streams([Handle(["x", "y"], "xy"), Handle(["p", "q"], "pqr")], ["A:", "B:"])
    assert capsys.readouterr().out == "--- prompt 1/2\nA:xy\n--- prompt 2/2\nB:pqr\n"
    assert [r.text for r in results] == ["xy", "pqr"]


def test_streaming_prints_what_decoding_the_whole_text_gives(tmp_path, capsys):
    """Byte-level BPE splits characters across tokens; the last token here ends inside one, which
    prints as the whole decode has it (U+FFFD) once the request is done."""
    from tests.runtime.test_tokenizer import byte_level_bpe

    tokenizer = byte_level_bpe(tmp_path)
    tokens = tokenizer.encode(" = 'héllo 世界'")
    tokens = tokens[: max(k for k in range(len(tokens)) if tokenizer.decode(tokens[:k]).endswith("\ufffd"))]
    prompt = tokenizer.encode("x")
    whole = tokenizer.decode_continuation(prompt, tokens)
    assert whole.endswith("\ufffd") and "é" in whole
    request = Request(prompt, len(tokens), gamma=0, spec=GenerationParams())
    output = OutputProcessor(tokenizer, request, "x", follow_text=True)
    texts = [output.add([token]).text for token in tokens]
    request.generated += tokens
    request.finish("length")
    print_streams([Handle(texts, output.result().text)], ["x"])
    assert capsys.readouterr().out == "x" + whole + "\n"


def test_generate_streams_text_that_a_stop_string_ends_as_its_result_does(bundles):
    args = ["generate", str(bundles("llama", "random")), "--prompt", "x y x", "--max-new-tokens", "12",
            "--stop", " y", "--stop", "x x"]
    [expected] = json.loads(CliRunner().invoke(main, args + ["--json"]).stdout)
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    assert result.stdout == "x y x" + expected["text"] + "\n"


def test_stats_line_under_auto_shows_the_gammas_used_and_means():
    from speccompile.core.stats import GenerationStats

    stats = GenerationStats("speculative", "auto", new_tokens=60)
    for gamma in [2] * 2 + [6] * 9:
        stats.record_iteration(gamma, gamma)
    line = stats_line(stats, "prompt 2/3")
    assert line.startswith("[prompt 2/3, speculative γ=auto (γ=2 ×2, γ=6 ×9)] 60 tokens")
    assert "acceptance 1.00, mean acceptance length 6.27 (5.27 of 5.27 drafts kept per verification) over 11" in line


def test_top_k_at_temperature_zero_is_warned_about(bundles):
    code, output = run("generate", bundles("llama", "random"), "--prompt", "x", "--max-new-tokens", 2, "--top-k", 5)
    assert code == 0, output
    assert "warning: top_k=5 has no effect at temperature 0 (greedy decoding)" in output


def test_build_reports_phases(tmp_path, checkpoints):
    code, output = run(*build_args(checkpoints("gpt2"), checkpoints("gpt2", "draft"), tmp_path / "b", "--gamma", 2,
                                   "--max-seq", 64))
    assert code == 0, output
    assert "[1/6] load target" in output and "[6/6] write bundle" in output
    assert (tmp_path / "b" / "manifest.json").is_file()


def test_the_drafts_precision_follows_the_targets_by_default(tmp_path, checkpoints):
    """int4 for an int4 target (the bits a layer-skip draft shares with it), int8 beside any other."""
    for target_weights, expected in (("int4", "int4"), ("float32", "int8")):
        out = tmp_path / target_weights
        code, output = run(*build_args(checkpoints("llama"), checkpoints("llama", "draft"), out, "--max-seq", 64,
                                       "--target-weights", target_weights, "--no-single-sequence"))
        assert code == 0, output
        assert json.loads((out / "manifest.json").read_text())["models"]["draft"]["matmul_weights"] == expected


def test_build_draft_weights_option(tmp_path, checkpoints):
    code, output = run(*build_args(checkpoints("llama"), checkpoints("llama", "draft"), tmp_path / "b", "--max-seq", 64,
                                   "--draft-weights", "float32"))
    assert code == 0, output
    manifest = json.loads((tmp_path / "b" / "manifest.json").read_text())
    assert manifest["models"]["draft"]["matmul_weights"] == "float32"


def test_build_draft_vocab_counts_a_corpus(tmp_path, checkpoints):
    corpus = tmp_path / "corpus.py"
    corpus.write_text("def parse_args(argv):\n    return argv[1:]\n" * 50)
    code, output = run(*build_args(checkpoints("llama"), checkpoints("llama", "draft"), tmp_path / "b", "--max-seq", 64,
                                   "--draft-vocab", 24, "--draft-vocab-corpus", corpus))
    assert code == 0, output
    assert "draft vocabulary: 24 of" in output
    assert json.loads((tmp_path / "b" / "manifest.json").read_text())["models"]["draft"]["scored_vocab"] == 24


def test_build_draft_vocab_corpus_without_draft_vocab_is_refused(tmp_path, checkpoints):
    corpus = tmp_path / "corpus.py"
    corpus.write_text("import os\n")
    assert_user_error(build_args(checkpoints("llama"), checkpoints("llama", "draft"), tmp_path / "b",
                                 "--draft-vocab-corpus", corpus), "--draft-vocab-corpus",
                      "--draft-vocab K (or --eagle-vocab K)")
    assert no_partial_output(tmp_path, "b")


def test_build_draft_vocab_without_frequencies_is_one_line(tmp_path, checkpoints):
    code, output = run(*build_args(checkpoints("llama"), checkpoints("llama", "draft"), tmp_path / "b",
                                   "--draft-vocab", 24, "--max-seq", 64))
    assert code == 1 and "Traceback" not in output
    assert "token_frequencies.json" in output


def test_generate_with_a_json_schema_file_validates_and_a_bad_one_is_one_line(bundles, tmp_path):
    import jsonschema

    schema = {"type": "object", "properties": {"size": {"enum": ["S", "M", "L"]},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["size", "n"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    code, output = run("generate", bundles("llama", "random"), "--prompt", "x y", "--max-new-tokens", 40,
                       "--gamma", 4, "--json-schema", tmp_path / "schema.json", "--json")
    assert code == 0, output
    [result] = json.loads(output)
    jsonschema.validate(json.loads(result["text"]), schema)
    assert result["stats"]["draft_tokens"] > 0  # speculation stayed on
    (tmp_path / "bad.json").write_text('{"type": "nope"}')
    code, output = run("generate", bundles("llama", "random"), "--prompt", "x", "--json-schema", tmp_path / "bad.json")
    assert code != 0 and output.strip().count("\n") == 0 and "json_schema does not compile" in output
    (tmp_path / "digits.gbnf").write_text('root ::= [0-9] [0-9] ";"')
    code, output = run("generate", bundles("llama", "random"), "--prompt", "x", "--grammar", tmp_path / "digits.gbnf",
                       "--json")
    text = json.loads(output)[0]["text"]
    assert code == 0 and len(text) == 3 and text[:2].isdigit() and text[2] == ";"


def test_bench_with_a_json_schema_constrains_both_sides_and_reports_the_grammar_s_cost(bundles, tmp_path):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"]}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    code, output = run("bench", bundles("llama", "random"), "--max-new-tokens", 16, "--repeats", 1, "--json-schema",
                       tmp_path / "schema.json")
    assert code == 0, output
    costs = dict(line.split(None, 1) for line in output.splitlines() if line.startswith("grammar_ms_per_token"))
    assert all(float(costs[f"grammar_ms_per_token_{mode}"]) > 0 for mode in ("autoregressive", "speculative"))
    (tmp_path / "bad.json").write_text('{"type": 3}')
    code, output = run("bench", bundles("llama", "random"), "--json-schema", tmp_path / "bad.json")
    assert code == 1 and "does not compile" in output and "Traceback" not in output


# -- the request's options on the command line -----------------------------------------------------

# a value other than the record's default for every field the command line takes (a new one needs one here)
NON_DEFAULT = {"max_new_tokens": 5, "temperature": 0.5, "top_k": 7, "top_p": 0.9, "min_p": 0.05, "seed": 11,
               "stop": ("\n\n", "END"), "stop_token_ids": (3, 4), "ignore_eos": True, "min_tokens": 2,
               "presence_penalty": 0.5, "frequency_penalty": 0.25, "repetition_penalty": 1.1, "logprobs": 2,
               "prompt_logprobs": 1, "gamma": 4, "mode": "speculative", "proposer": "ngram", "p_min": 0.2,
               "sampling_rule": "rejection", "acceptance": "typical", "n": 2}


@pytest.fixture
def asked(monkeypatch):
    """The params of every Runtime.submit_batch call that passes a record (the CLI's generate, and
    Runtime.generate's for bench and profile; load's own warm-up request passes keywords), which
    queues nothing."""
    from speccompile.runtime.runtime import Runtime

    calls = []

    def submit_batch(self, prompts, params=None, **options):
        if params is not None:
            calls.append(params)
        return []

    monkeypatch.setattr(Runtime, "submit_batch", submit_batch)
    return calls


def test_every_request_option_with_a_flag_reaches_the_runtime(bundles, asked):
    from speccompile.core.params import GenerationParams, options_with_flags

    flags = {spec.name: meta.flag for spec, meta in options_with_flags()}
    assert flags.keys() == NON_DEFAULT.keys()
    assert all(getattr(GenerationParams(), name) != value for name, value in NON_DEFAULT.items())
    args = ["generate", bundles("llama", "random"), "--prompt", "x", "--json"]
    for name, value in NON_DEFAULT.items():
        for one in value if isinstance(value, tuple) else (value,):
            args += [flags[name]] if one is True else [flags[name], one]
    code, output = run(*args)
    assert code == 0, output
    [params] = asked
    assert {name: getattr(params, name) for name in NON_DEFAULT} == NON_DEFAULT


def test_options_not_given_leave_the_record_s_defaults_and_gamma_keeps_its_alias(bundles, asked):
    from speccompile.core.params import GenerationParams

    for extra in ([], ["--num-speculative-tokens", "auto"], ["--gamma", "0"]):
        code, output = run("generate", bundles("llama", "random"), "--prompt", "x", "--json", *extra)
        assert code == 0, output
    assert asked == [GenerationParams(), GenerationParams(gamma="auto"), GenerationParams(gamma=0)]


def test_bench_and_profile_pass_the_request_s_options_to_the_api(bundles, monkeypatch):
    from speccompile.errors import SpecCompileError
    from speccompile.runtime import bench, profile

    asked = []

    def capture(runtime, prompts, *args):
        asked.append(next(a for a in args if hasattr(a, "max_new_tokens")))
        raise SpecCompileError("captured")

    monkeypatch.setattr(bench, "bench", capture)
    monkeypatch.setattr(profile, "build_profile", capture)
    common = [bundles("llama", "random"), "--temperature", 0.7, "--seed", 3, "--stop", "END"]
    assert run("bench", *common, "--gamma", 4, "--proposer", "ngram", "--always-speculate")[0] == 1
    assert run("profile", *common)[0] == 1
    sampled = {"temperature": 0.7, "seed": 3, "stop": ("END",)}
    assert [{name: getattr(params, name) for name in sampled} for params in asked] == [sampled] * 2
    assert (asked[0].gamma, asked[0].proposer, asked[0].mode) == (4, "ngram", "speculative")
    assert asked[1].max_new_tokens == profile.PROFILE_PARAMS.max_new_tokens  # profile's own default


def test_n_samples_of_a_prompt_stream_one_after_another(bundles):
    code, output = run("generate", bundles("llama", "random"), "--prompt", "x", "--n", 2, "--temperature", 0.8,
                       "--seed", 1, "--max-new-tokens", 3)
    assert code == 0, output
    assert "--- prompt 1/2\nx" in output and "--- prompt 2/2\nx" in output
    assert "[prompt 2/2, " in output


def test_no_function_in_the_cli_is_longer_than_60_lines():
    """The command line parses options, calls the API and renders (speccompile/present.py)."""
    import ast
    from pathlib import Path

    import speccompile.cli

    tree = ast.parse(Path(speccompile.cli.__file__).read_text())
    lengths = {node.name: node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert lengths and not {name: n for name, n in lengths.items() if n > 60}


@pytest.mark.parametrize("extra, message", [
    (["--eagle3", 3, "--layers", 4], "--layers shapes a draft; --eagle3 trains heads on the target"),
    (["--eagle3", 3, "--medusa", 2], "--medusa and --eagle3 train different proposers"),
    (["--draft-vocab", 100], "--draft-vocab shapes an EAGLE-3 head: it applies only with --eagle3"),
    (["--eagle3", 3, "--aux-layers", "1,x,2"], "--aux-layers takes comma-separated layer ids"),
])
def test_distill_eagle3_refuses_what_does_not_apply_in_one_line(tmp_path, extra, message):
    code, output = run("distill", "--target", tmp_path / "missing", "--corpus", tmp_path, "--out", tmp_path / "out",
                       *extra)
    assert code == 1 and message in output and "Traceback" not in output, output
