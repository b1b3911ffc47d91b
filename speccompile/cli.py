"""The `speccompile` command line: a thin shell over `speccompile.build` and `speccompile.load`."""

import functools
import json
import logging
import signal
import sys
from pathlib import Path

import click

from speccompile.core.proposers import DEFAULT_PROPOSER, PROPOSERS
from speccompile.core.request import SAMPLING_RULES
from speccompile.errors import SpecCompileError


def user_errors(command):
    """Turn SpecCompileError into one line on stderr and exit code 1 (no traceback)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except SpecCompileError as e:
            raise click.ClickException(str(e)) from None

    return wrapper


class _StderrLines(logging.Handler):
    """What the library logs, one plain line each on stderr; warnings and errors say what they are.
    Through click.echo, which writes to the stderr of the moment (a test runner swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        click.echo(level + record.getMessage(), err=True)


def _show_logs() -> None:
    """The library's INFO lines (build phases, distillation steps) are the CLI's progress display."""
    logger = logging.getLogger("speccompile")
    logger.setLevel(logging.INFO)
    if not any(isinstance(handler, _StderrLines) for handler in logger.handlers):  # once per process
        logger.addHandler(_StderrLines())


def backend_option(command):
    from speccompile.runtime.runtime import BACKENDS

    return click.option("--backend", type=click.Choice(BACKENDS), default="auto", show_default=True,
                        help="What runs the bundle: its TensorRT engines (tensorrt), its ONNX graphs (onnxruntime), "
                        "or auto: the engines where the bundle has them and TensorRT is installed.")(command)


@click.group()
@click.version_option(package_name="speccompile")
def main():
    """Compile draft/target model pairs into speculative-decoding bundles, and run them."""
    _show_logs()


@main.command()
@click.option("--target", "target_dir", required=True, type=click.Path(),
              help="Target: an HF checkpoint directory or a .gguf file.")
@click.option("--draft", "draft_dir", default=None, type=click.Path(),
              help="Draft: an HF checkpoint directory or a .gguf file (without one, a draft-free bundle: "
                   "prompt lookup proposes).")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Bundle directory to write.")
@click.option("--gamma", "gammas", type=int, multiple=True, default=(4,), show_default=True,
              help="Draft tokens per verification; repeat to compile several.")
@click.option("--max-seq", type=int, default=1024, show_default=True, help="KV-cache capacity (prompt + generated).")
@click.option("--max-batch", type=int, default=8, show_default=True, help="Largest batch the bundle serves.")
@click.option("--force", is_flag=True, help="Replace an existing bundle directory.")
@click.option("--target-weights", type=click.Choice(["float32", "float16", "bfloat16", "int8", "int4"]),
              default=None, help="Target matmul weights: the compiled target's precision, "
              "which the output follows (int8: weight-only, per output column, a quarter of the bytes per decode "
              "step; int4: weight-only in blocks of 128 along the input, about an eighth). Default: float32; for a "
              "GGUF int8, its Q8_0/Q4_0 blocks kept as they are (a float precision takes their exact values).")
@click.option("--draft-weights", type=click.Choice(["int8", "int4", "float32", "float16", "bfloat16"]), default="int8",
              show_default=True,
              help="Draft matmul weights: int8 or int4 weight-only (faster draft steps), float32, or float16/bfloat16 "
              "(half the disk, float32 in memory on CPU); the output is the target's whatever the draft's precision.")
@click.option("--draft-vocab", type=int, default=None,
              help="Draft LM head scores only the K most frequent tokens (faster draft steps; outputs unchanged).")
@click.option("--draft-vocab-corpus", default=None,
              help="Count token frequencies for --draft-vocab on this corpus "
              "(default: the draft's token_frequencies.json).")
@click.option("--single-sequence/--no-single-sequence", default=True, show_default=True,
              help="Also write batch-1 ONNX Runtime variants of every graph "
              "(fused attention that reads the KV cache in place).")
@click.option("--medusa", "medusa_dir", default=None, type=click.Path(),
              help="Medusa heads directory (speccompile distill --medusa K): the heads propose a token tree that "
              "the target verifies in one pass, instead of a draft model.")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "onnx"]), default="onnxruntime",
              show_default=True,
              help="tensorrt: also build TensorRT engines from the same ONNX graphs (onnx: onnxruntime's old name).")
@click.option("--plugin-lib", type=click.Path(), default=None, help="libspeccompile_plugins.so (TensorRT backend).")
@click.option("--timing-cache", type=click.Path(), default=None, help="TensorRT timing cache file to load and update.")
@click.option("--hardware-compat", is_flag=True, help="TensorRT: engines portable across Ampere+ GPUs.")
@click.option("--version-compat", is_flag=True, help="TensorRT: engines loadable by later TensorRT versions.")
@user_errors
def build(target_dir, draft_dir, out_dir, gammas, max_seq, max_batch, force, target_weights, draft_weights, draft_vocab,
          draft_vocab_corpus, single_sequence, medusa_dir, backend, plugin_lib, timing_cache, hardware_compat,
          version_compat):
    """Export a target/draft pair to a bundle of ONNX speculative graphs (and TensorRT engines)."""
    from speccompile.compiler.build import build_bundle

    if backend == "tensorrt":  # fail before the ONNX export if the TensorRT side cannot run here
        from speccompile.tensorrt_setup import plugin_library, require_tensorrt

        require_tensorrt()
        plugin_library(plugin_lib)
    build_bundle(target_dir, draft_dir, out_dir, gammas=list(gammas), max_seq=max_seq, max_batch=max_batch, force=force,
                 draft_weights=draft_weights, draft_vocab=draft_vocab, draft_vocab_corpus=draft_vocab_corpus,
                 single_sequence=single_sequence, target_weights=target_weights, medusa_dir=medusa_dir)
    if backend == "tensorrt":
        from speccompile.compiler.tensorrt_build import build_tensorrt_engines

        build_tensorrt_engines(out_dir, plugin_lib, timing_cache, hardware_compat, version_compat)


@main.command()
@click.option("--target", "target_dir", required=True, type=click.Path(), help="Target HF checkpoint directory.")
@click.option("--corpus", required=True,
              help="Text file or directory of text files ('stdlib': this Python's standard library).")
@click.option("--out", "out_dir", required=True, type=click.Path(),
              help="Draft checkpoint directory (resumed if it holds a checkpoint).")
@click.option("--layers", type=int, default=2, show_default=True)
@click.option("--hidden", type=int, default=128, show_default=True)
@click.option("--heads", type=int, default=None, help="Attention heads (default: hidden // 64).")
@click.option("--intermediate", type=int, default=None, help="MLP width (default: 3x hidden, 4x for GPT-2).")
@click.option("--steps", type=int, default=300, show_default=True)
@click.option("--batch", type=int, default=8, show_default=True)
@click.option("--seq-len", type=int, default=128, show_default=True)
@click.option("--lr", type=float, default=2e-3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--generated-fraction", type=float, default=0.25, show_default=True,
              help="Share of batches whose second half the target generates.")
@click.option("--checkpoint-every", type=int, default=50, show_default=True)
@click.option("--init", type=click.Path(), default=None,
              help="Start from an existing draft checkpoint (e.g. to keep distilling it).")
@click.option("--medusa", type=int, default=None,
              help="Train K Medusa heads on the frozen target instead of a draft (--layers, --hidden, --heads, "
              "--intermediate and --init do not apply).")
@user_errors
def distill(target_dir, corpus, out_dir, medusa, **options):
    """Train a small draft that matches the target's next-token distribution (or, with --medusa, heads
    on the target that predict the tokens after the next)."""
    from speccompile.training.distill import DistillOptions
    from speccompile.training.distill import distill as run_distill

    if medusa is None:
        run_distill(target_dir, corpus, out_dir, DistillOptions(**options))
    else:
        _distill_medusa(target_dir, corpus, out_dir, medusa, options)


DRAFT_ONLY = ("layers", "hidden", "heads", "intermediate", "init")  # distill options that shape a draft model


def _distill_medusa(target_dir, corpus, out_dir, heads: int, options: dict) -> None:
    """A draft option given with --medusa is refused rather than ignored: the user expected it to matter."""
    from click.core import ParameterSource

    from speccompile.training.medusa import MedusaOptions, train_medusa

    context = click.get_current_context()
    for name in DRAFT_ONLY:
        if context.get_parameter_source(name) is not ParameterSource.DEFAULT:
            raise SpecCompileError(f"--{name} shapes a draft; --medusa trains heads on the target (drop --{name})")
    shared = {name: value for name, value in options.items() if name not in DRAFT_ONLY}
    train_medusa(target_dir, corpus, out_dir, MedusaOptions(heads=heads, **shared))


def read_prompts(prompts_file) -> list[str]:
    """The --prompts file's prompts, or the demo's when none is given (their domain is the demo pair's)."""
    from speccompile.demo import DEMO_PROMPTS
    from speccompile.runtime.bench import read_prompts as read_file

    return read_file(prompts_file or DEMO_PROMPTS)


def resolve_bundle(bundle):
    """The bundle argument, or the embedded demo bundle (built once into the cache) when omitted."""
    if bundle is not None:
        return bundle
    from speccompile.demo import demo_bundle

    return demo_bundle()


SAMPLING_RULE_HELP = ("How sampled tokens are verified: coupled (the target draws each position by Gumbel-max "
                      "with the request's own noise for it, so a seed gives the same tokens at any γ, proposer or "
                      "load; the default with --seed) or rejection (Leviathan et al.'s: more drafts kept, but its "
                      "tokens depend on γ and the drafts; the default without).")
TREE_HELP = ("Medusa bundles: the token tree, 'chain' (each head's top candidate), a number of nodes grown from the "
             "heads' accuracies, or 'auto' (default: the size measured fastest here).")
ACCEPTANCE_HELP = ("Medusa bundles: 'typical' accepts plausible tokens the target would not have chosen greedily "
                   "(Medusa-2's typical acceptance): faster, approximate, labelled in the stats.")


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--prompt", "prompts", multiple=True, required=True, help="Prompt text; repeat for a batch.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--mode", type=click.Choice(["speculative", "autoregressive"]), default=None,
              help="Run as asked. Default: speculative, or plain decoding where --gamma auto predicts that "
              "speculation does not pay.")
@click.option("--gamma", "--num-speculative-tokens", "gamma", default=None,
              help="Draft tokens per iteration, or 'auto' (the default: the policy's γ each iteration, or plain "
              "decoding where speculation does not pay).")
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 is greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely tokens (0: off).")
@click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass (1: off).")
@click.option("--seed", type=int, default=None, help="Random seed: the same seed gives the same tokens.")
@click.option("--proposer", type=click.Choice(PROPOSERS), default=DEFAULT_PROPOSER, show_default=True,
              help="Who drafts: the draft model, prompt lookup in the request's own text (ngram), suffix decoding "
              "over its text and earlier outputs (suffix), the Medusa heads (medusa), or per iteration the one "
              "predicted fastest (auto).")
@click.option("--sampling-rule", type=click.Choice(SAMPLING_RULES), default=None, help=SAMPLING_RULE_HELP)
@click.option("--p-min", type=float, default=None,
              help="The draft model stops drafting at a token it gives less probability than this (0: never; "
              "default: the γ profile's measured threshold, else 0).")
@click.option("--tree", default=None, help=TREE_HELP)
@click.option("--acceptance", type=click.Choice(["exact", "typical"]), default="exact", show_default=True,
              help=ACCEPTANCE_HELP)
@click.option("--ignore-eos", is_flag=True, help="Go on past the model's end-of-sequence token.")
@click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Generate JSON valid against the schema in this file (structured output).")
@click.option("--grammar", "grammar_file", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Generate text in the grammar in this file: Lark, or llama.cpp's GBNF.")
@click.option("--regex", default=None, help="Generate text matching this regular expression.")
@click.option("--json", "as_json", is_flag=True, help="Print results as a JSON list.")
@backend_option
@user_errors
def generate(bundle, prompts, max_new_tokens, mode, gamma, temperature, top_k, top_p, seed, proposer, sampling_rule,
             p_min, tree, acceptance, ignore_eos, json_schema, grammar_file, regex, as_json, backend):
    """Generate text with speculative decoding (or the target alone).

    BUNDLE defaults to the embedded demo pair. With --json-schema, --grammar or --regex the output is
    constrained, the draft's proposals and the target's choices alike (speculation stays on).
    """
    import speccompile

    runtime = speccompile.load(resolve_bundle(bundle), backend, shared_threads=True)  # the process is ours
    _tree_option(runtime, tree)
    gamma = _gamma_option(gamma)
    stream = None if as_json else _Streamer(runtime.tokenizer, list(prompts), max_new_tokens)
    results = runtime.generate(list(prompts), max_new_tokens=max_new_tokens, mode=mode, gamma=gamma,
                               temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, on_tokens=stream,
                               proposer=proposer, p_min=p_min, acceptance=acceptance, sampling_rule=sampling_rule,
                               ignore_eos=ignore_eos, regex=regex,
                               json_schema=Path(json_schema).read_text() if json_schema else None,
                               grammar=Path(grammar_file).read_text() if grammar_file else None)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in results], indent=1))
        return
    stream.finish()
    for row, result in enumerate(results):
        label = f"prompt {row + 1}/{len(results)}" if len(results) > 1 else ""
        click.echo(_stats_line(result.stats, label), err=True)


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--prompts", "prompts_file", type=click.Path(), default=None,
              help="JSON list of prompts, or one prompt per line.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--gamma", "--num-speculative-tokens", "gamma", default=None,
              help="Draft tokens per iteration, or 'auto' (the default).")
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--concurrency", default=None,
              help="Serve a stream of requests under load at each of these client counts (e.g. 1,2,4,8), "
              "speculative and autoregressive, instead of the batch-1 comparison.")
@click.option("--requests", type=int, default=16, show_default=True,
              help="With --concurrency: requests per run; their lengths vary around --max-new-tokens (±50%).")
@click.option("--rate", type=float, default=None,
              help="With --concurrency: Poisson arrivals at this many requests/s, at most CONCURRENCY in flight "
              "(default: closed-loop clients, each sending its next request when the last one finished).")
@click.option("--always-speculate", is_flag=True,
              help="With γ auto: never let the policy decode plainly where speculation does not pay (the "
              "default lets it, as a default request does).")
@click.option("--plot", "plot_path", type=click.Path(), default=None,
              help="With --concurrency: PNG of tokens/s and p99 latency vs concurrency "
              "(default: BUNDLE/profiles/load.png; with --json, only when given).")
@click.option("--proposer", "proposers", type=click.Choice(PROPOSERS), multiple=True,
              help="Who drafts (default: auto); repeat to compare proposers against the same plain runs.")
@click.option("--p-min", type=float, default=None,
              help="Confidence threshold of the draft model's drafts (see generate --p-min).")
@click.option("--sampling-rule", type=click.Choice(SAMPLING_RULES), default=None, help=SAMPLING_RULE_HELP)
@click.option("--tree", default=None, help=TREE_HELP)
@click.option("--acceptance", "rules", type=click.Choice(["exact", "typical"]), multiple=True,
              help="Medusa bundles: compare acceptance rules (repeat: exact and typical) against the same plain "
              "runs: speedup, agreement with exact greedy output, and the target's log-likelihood of each text.")
@click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Constrain every request, speculative and autoregressive, to JSON valid against this schema.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object with the summary keys (with several --proposer or --concurrency: a "
              "JSON list, one object per proposer, or per concurrency and mode).")
@backend_option
@user_errors
def bench(bundle, prompts_file, max_new_tokens, repeats, gamma, temperature, concurrency, requests, rate,
          always_speculate, proposers, p_min, sampling_rule, tree, rules, plot_path, json_schema, as_json, backend):
    """Speculative vs autoregressive tokens/s on the same prompts (medians over repeats): at batch 1,
    or with --concurrency, serving many requests at once (γ auto by default)."""
    import speccompile
    from speccompile.runtime.bench import bench as run_bench

    runtime = speccompile.load(resolve_bundle(bundle), backend, shared_threads=True)  # the process is ours
    _tree_option(runtime, tree)
    constrained = {"json_schema": Path(json_schema).read_text()} if json_schema else {}
    if constrained:
        runtime.compile_constraint(**constrained)  # a bad schema: one line, before anything runs
    if rules:
        _bench_acceptance(runtime, read_prompts(prompts_file), list(rules), max_new_tokens, repeats, as_json)
        return
    if concurrency is not None:
        load = {"concurrencies": _int_list(concurrency), "requests": requests, "rate": rate,
                "max_new_tokens": max_new_tokens, "repeats": repeats, "gamma": _gamma_option(gamma),
                "always_speculate": always_speculate,
                "sampling": ({"temperature": temperature, "sampling_rule": sampling_rule} if temperature else {})
                | _p_min_option(p_min) | constrained,
                "proposer": proposers[0] if proposers else DEFAULT_PROPOSER}
        _bench_load(runtime, read_prompts(prompts_file), load, as_json, plot_path)
        return
    sampling = ({"temperature": temperature, "seed": 0, "sampling_rule": sampling_rule} if temperature else {}) \
        | _p_min_option(p_min) | constrained
    if len(proposers) > 1:
        _bench_proposers(runtime, read_prompts(prompts_file), list(proposers), max_new_tokens, repeats,
                         _gamma_option(gamma), sampling, as_json, always_speculate)
        return
    summary, details = run_bench(runtime, read_prompts(prompts_file), max_new_tokens, repeats, _gamma_option(gamma),
                                 sampling, proposer=proposers[0] if proposers else DEFAULT_PROPOSER,
                                 always_speculate=always_speculate)
    if as_json:
        click.echo(json.dumps(summary))
        return
    costs = ("target_step_ms", "draft_step_ms", "verify_ms", "overhead_ms_per_iteration", "draft_to_target_step_ratio",
             "acceptance_by_position") + (("grammar_ms_per_token_autoregressive", "grammar_ms_per_token_speculative")
                                         if constrained else ())
    rows = [(k, summary[k]) for k in summary] + [(k, details[k]) for k in costs]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        click.echo(f"{key:<{width}}  {_bench_value(value)}")


def _tree_option(runtime, tree: str | None) -> None:
    if tree is None or tree == "auto":
        return
    if tree != "chain":
        try:
            tree = int(tree)
        except ValueError:
            raise SpecCompileError(f"--tree must be 'auto', 'chain' or a number of nodes, not {tree!r}") from None
    runtime.set_tree(tree)


def _bench_acceptance(runtime, prompts, rules, max_new_tokens, repeats, as_json) -> None:
    from speccompile.runtime.bench import bench_acceptance

    rows = bench_acceptance(runtime, prompts, rules, max_new_tokens, repeats)
    if as_json:
        click.echo(json.dumps(rows))
        return
    click.echo(f"autoregressive: {rows[0]['ar_tokens_per_s']:.1f} tok/s, exact output's perplexity "
               f"{rows[0]['exact_perplexity']:.2f}")
    click.echo(f"{'acceptance':<10} {'tok/s':>8} {'speedup':>8} {'accept len':>10} {'agreement':>9} "
               f"{'identical':>9} {'perplexity':>10}")
    for r in rows:
        click.echo(f"{r['acceptance']:<10} {r['spec_tokens_per_s']:>8.1f} {r['speedup']:>7.2f}x "
                   f"{r['mean_acceptance_length']:>10.2f} {r['token_agreement']:>9.3f} {r['identical_outputs']:>9.2f} "
                   f"{r['perplexity']:>10.2f}")


def _p_min_option(p_min: float | None) -> dict:
    """bench's generate arguments for --p-min: none when not given (the runtime's default)."""
    return {} if p_min is None else {"p_min": p_min}


def _bench_proposers(runtime, prompts, proposers, max_new_tokens, repeats, gamma, sampling, as_json,
                     always_speculate) -> None:
    """bench with several --proposer: a JSON list of their summaries, or a table."""
    from speccompile.runtime.bench import bench_proposers

    results = bench_proposers(runtime, prompts, proposers, max_new_tokens, repeats, gamma, sampling, always_speculate)
    if as_json:
        click.echo(json.dumps([summary for summary, _ in results]))
        return
    click.echo(f"autoregressive: {results[0][0]['ar_tokens_per_s']:.1f} tok/s")
    click.echo(f"{'proposer':<9} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'accept len':>10}  drafts by proposer")
    for summary, _ in results:
        split = ", ".join(f"{name} {p['draft_tokens']} ({p['acceptance_rate']:.2f} kept)"
                          for name, p in summary["by_proposer"].items())
        click.echo(f"{summary['proposer']:<9} {summary['spec_tokens_per_s']:>8.1f} {summary['speedup']:>7.2f}x "
                   f"{summary['acceptance_rate']:>7.2f} {summary['mean_acceptance_length']:>10.2f}  {split}")


def _bench_load(runtime, prompts: list[str], options: dict, as_json: bool, plot_path) -> None:
    """bench --concurrency: a JSON list of the rows, or their table; and the plot."""
    from speccompile.runtime.bench import bench_load, save_load_plot

    rows, details = bench_load(runtime, prompts, **options)
    click.echo(json.dumps(rows) if as_json else _load_table(rows, details))
    if as_json and plot_path is None:
        return
    try:
        path = save_load_plot(rows, plot_path or runtime.bundle.path / "profiles" / "load.png")
        click.echo(f"plot: {path}", err=as_json)  # stdout stays one JSON document
    except SpecCompileError as e:
        click.echo(f"no plot: {e}", err=True)


def _load_table(rows: list[dict], details: list[dict]) -> str:
    """One line per concurrency and mode; a speculative line also shows its rate over autoregressive's
    at the same concurrency, and the drafts per request-iteration that it used."""
    ar_rate = {r["concurrency"]: r["tokens_per_s"] for r in rows if r["mode"] == "autoregressive"}
    times = ("p50_latency_ms", "p99_latency_ms", "p50_ttft_ms", "p99_ttft_ms", "p50_itl_ms")
    head = (f"{'conc':>4} {'mode':<14} {'tok/s':>7} {'vs AR':>6} {'lat p50':>8} {'lat p99':>8} {'ttft p50':>8} "
            f"{'ttft p99':>8} {'itl p50':>7} {'accept':>6} {'mean γ':>6}  (times in ms)")
    lines = [head]
    for row, detail in zip(rows, details):
        spec = row["mode"] == "speculative"
        ratio = f"{row['tokens_per_s'] / ar_rate[row['concurrency']]:.2f}x" if spec else ""
        lat = " ".join(f"{row[k]:>{7 if k == 'p50_itl_ms' else 8}.1f}" for k in times)
        used = f"  {_gamma_counts(detail['gammas_used'])}" if spec else ""
        lines.append(f"{row['concurrency']:>4} {row['mode']:<14} {row['tokens_per_s']:>7.1f} {ratio:>6} {lat} "
                     f"{row['acceptance_rate']:>6.2f} {row['mean_gamma']:>6.2f}{used}")
    return "\n".join(lines)


def _bench_value(value) -> str:
    if isinstance(value, dict) and all(isinstance(v, dict) for v in value.values()):  # by_proposer
        return ", ".join(f"{name} {p['draft_tokens']} drafts ({p['acceptance_rate']:.2f} kept)"
                         for name, p in value.items())
    if isinstance(value, dict):  # gammas_used: γ -> iterations
        return _gamma_counts(value)
    if isinstance(value, list):
        return ", ".join(f"{v:.3f}" for v in value)
    return f"{value:.3f}" if isinstance(value, float) else str(value)


DRAIN_S = 30  # serve: how long a shutdown waits for requests in flight
IDLE_S = 5  # serve: a connection without a request in progress is closed after this long (uvicorn's default)


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback unless told).")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--api-key", default=None, help="Require Authorization: Bearer KEY on /v1/ routes.")
@click.option("--served-model-name", "--model-name", "model_name", default=None,
              help="The model id clients ask for (default: the bundle directory's name; speccompile-demo).")
@click.option("--max-num-seqs", "--max-batch", "max_batch", type=int, default=None,
              help="Requests decoding at once, at most the bundle's (default: the bundle's).")
@click.option("--num-speculative-tokens", "--gamma", "gamma", default=None,
              help="γ of a request that does not ask (num_speculative_tokens): a compiled one or 'auto' "
              "(default: auto).")
@click.option("--proposer", type=click.Choice(PROPOSERS), default=None,
              help=f"Who drafts for a request that does not ask (its `proposer`; default: {DEFAULT_PROPOSER}).")
@click.option("--p-min", type=float, default=None,
              help="The draft model's confidence threshold for a request that does not ask (see generate --p-min).")
@click.option("--chat-template", type=click.Path(), default=None,
              help="A Jinja chat template file, used instead of the checkpoint's (or where it has none).")
@click.option("--log-level", "--uvicorn-log-level", "log_level", type=click.Choice(LOG_LEVELS), default="info",
              show_default=True, help="The server's log level; at info and below each request is logged.")
@click.option("--disable-access-log", "--disable-uvicorn-access-log", "no_access_log", is_flag=True,
              help="Do not log each request.")
@click.option("--ray", "on_ray", is_flag=True, help="Serve on Ray Serve (the ray extra), with --replicas replicas.")
@click.option("--replicas", type=int, default=2, show_default=True, help="With --ray: replicas of the server.")
@backend_option
@user_errors
def serve(bundle, host, port, api_key, model_name, max_batch, gamma, proposer, p_min, chat_template, log_level,
          no_access_log, on_ray, replicas, backend):
    """Serve a bundle over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions,
    /v1/models, /tokenize, /detokenize, /version, /health, /metrics)."""
    try:
        import uvicorn

        from speccompile.serve.app import create_app
        from speccompile.serve.chat import read_template
        from speccompile.serve.limits import http_protocol
    except ImportError as e:
        raise SpecCompileError(f"serve needs the serve extra ({e.name} is missing): "
                               "pip install 'speccompile[serve]'") from None
    from pathlib import Path

    import speccompile

    template = read_template(chat_template) if chat_template else None
    path = resolve_bundle(bundle)
    runtime = speccompile.load(path, backend, shared_threads=True, max_batch=max_batch)  # the process is ours
    gamma = _gamma_option(gamma)
    runtime.check_gamma(gamma)  # bad defaults fail here, not in every request
    if proposer is not None:
        runtime.proposers.check(proposer)
    if p_min is not None and not 0 <= p_min <= 1:
        raise SpecCompileError(f"--p-min must be a probability in [0, 1], got {p_min}")
    name = model_name or (Path(path).name if bundle else "speccompile-demo")
    options = {"api_key": api_key, "gamma": gamma, "proposer": proposer, "p_min": p_min, "chat_template": template}
    if on_ray:
        runtime.close()  # each replica opens its own
        _serve_on_ray(str(path), name, host, port, max_batch, replicas, options)
        return
    runtime.warm_up(batched=True)  # requests arrive together: the batched graphs, opened before the first
    app = create_app(runtime, name, **options)
    logging.getLogger("speccompile").setLevel(log_level.upper() if log_level != "trace" else "DEBUG")
    # uvicorn drains on SIGTERM or SIGINT (at most DRAIN_S for requests in flight), then raises the
    # signal again for the handler it found: this one, so that the process ends here, cleanly
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    uvicorn.run(app, host=host, port=port, log_level=log_level, access_log=not no_access_log,
                timeout_graceful_shutdown=DRAIN_S, http=http_protocol(), timeout_keep_alive=IDLE_S)
    runtime.close()  # what the drain left is cancelled


def _serve_on_ray(bundle: str, name: str, host: str, port: int, max_batch, replicas: int, options: dict) -> None:
    """serve --ray: a local Ray instance (or the cluster RAY_ADDRESS names) runs `replicas` servers
    behind Ray Serve's HTTP proxy on host:port, until interrupted."""
    try:
        import ray
        from ray import serve as ray_serve

        from speccompile.serve.ray_app import application
    except ImportError as e:
        raise SpecCompileError(f"serve --ray needs the ray extra ({e.name} is missing): "
                               "pip install 'speccompile[ray]'") from None
    if replicas < 1:
        raise SpecCompileError(f"--replicas must be positive, got {replicas}")
    ray.init(include_dashboard=False)
    ray_serve.start(http_options={"host": host, "port": port})
    try:
        ray_serve.run(application(bundle, replicas, name, max_batch=max_batch, **options), blocking=True)
    finally:
        ray_serve.shutdown()
        ray.shutdown()


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@user_errors
def verify(bundle):
    """Hash every file of a bundle against its manifest (opening a bundle checks only what changed since)."""
    import time

    from speccompile.bundle import verify_bundle

    started = time.perf_counter()
    checked = verify_bundle(resolve_bundle(bundle))
    files = checked.manifest["files"]
    size = sum((checked.path / name).stat().st_size for name in files) / 1e6
    click.echo(f"{checked.path}: {len(files)} files, {size:.1f} MB match their sha256 "
               f"({time.perf_counter() - started:.1f} s)")


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--json", "as_json", is_flag=True, help="Print the inspection as JSON.")
@user_errors
def inspect(bundle, as_json):
    """Graphs, engines, shapes and op counts of a bundle."""
    from speccompile.bundle import open_bundle
    from speccompile.runtime.inspect import describe, render

    info = describe(open_bundle(resolve_bundle(bundle)))
    click.echo(json.dumps(info, indent=1) if as_json else render(info))


def _gamma_option(value):
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise SpecCompileError(f"--gamma must be an integer or 'auto', got {value!r}") from None


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SpecCompileError(f"expected comma-separated integers, got {text!r}") from None


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--prompts", "prompts_file", type=click.Path(), default=None,
              help="Prompts the runs continue (JSON list or one per line).")
@click.option("--batch-sizes", default=None,
              help="Comma-separated batch sizes (default: every one from 1 to the bundle's max batch).")
@click.option("--context-lengths", default="64,256", show_default=True,
              help="Mean context of the runs at each point: prompts of this length minus half the new tokens.")
@click.option("--max-new-tokens", type=int, default=48, show_default=True, help="Tokens per request in each run.")
@click.option("--repeats", type=int, default=1, show_default=True,
              help="Passes over all prompts per mode at each batch size and context, per round.")
@click.option("--rounds", type=int, default=3, show_default=True,
              help="Sweeps over all batch sizes, contexts and modes; each number is the median over them.")
@click.option("--ops", is_flag=True, help="Also print ONNX Runtime's per-op time breakdown of each graph.")
@click.option("--plots", "plots_dir", type=click.Path(), default=None,
              help="Where to save PNG plots (default: BUNDLE/profiles).")
@backend_option
@user_errors
def profile(bundle, prompts_file, batch_sizes, context_lengths, max_new_tokens, repeats, rounds, ops, plots_dir,
            backend):
    """Measure γ costs and speedups in loop runs on this hardware; store a γ profile in the bundle."""
    from pathlib import Path

    import speccompile
    from speccompile.runtime import gamma_profile
    from speccompile.runtime import profile as prof

    runtime = speccompile.load(resolve_bundle(bundle), backend, shared_threads=True)  # the process is ours
    batches = _int_list(batch_sizes) if batch_sizes else list(range(1, runtime.max_batch + 1))
    result = prof.build_profile(runtime, read_prompts(prompts_file), batches, _int_list(context_lengths), repeats,
                                rounds, max_new_tokens)
    path = gamma_profile.write_profile(runtime.bundle.path, result)
    click.echo(_profile_table(result))
    click.echo(f"profile written to {path}")
    try:
        for png in prof.save_plots(result, Path(plots_dir) if plots_dir else path.parent):
            click.echo(f"plot: {png}")
    except SpecCompileError as e:
        click.echo(f"no plots: {e}", err=True)
    if ops:
        from speccompile.bundle import GraphId

        graphs = (GraphId.step("target", sample=False), GraphId.verification(max(runtime.gammas), sample=False))
        if runtime.draft is not None:
            graphs += (GraphId.step("draft", sample=False),)
        for graph in (g.name for g in graphs):
            click.echo(f"\n{graph}: top ops by share (batch 1, context 32)")
            for op, ms, share in prof.op_profile(runtime.bundle, graph, prof.graph_feeds(runtime.bundle, graph)):
                click.echo(f"  {op:<22} {ms:8.3f} ms  {share:6.1%}")


def _profile_table(profile) -> str:
    """Per batch size, context and γ: ms per iteration (target: a plain decoding step; draft: the
    iteration's γ draft steps; loop: its own work), the γ policy's predicted speedup, the measured
    one (steady state), end to end (prefill included, as bench), tokens per iteration (expected from
    the acceptance at that γ over whole runs / measured in steady state), and γ*; then the largest
    gap between predicted and measured."""
    lines = ["ms per iteration; speedup over plain decoding: the γ policy's prediction, measured in steady state "
             "and end to end",
             f"{'batch':>5} {'context':>7} {'γ':>3} {'target ms':>10} {'draft ms':>9} {'verify ms':>10} {'loop ms':>8} "
             f"{'predicted':>10} {'measured':>9} {'end to end':>11} {'tokens/it':>10}"]
    gaps, cost_gaps = [], []
    for point in profile.points:
        lines += _profile_rows(point)
        for g, measured in point.measured_speedup.items():
            predicted = point.predicted_speedup[g]
            # the cost model's speedup is proportional to tokens per iteration: with the measured
            # one instead of the acceptance's, what is left of the gap is the costs'
            costs_only = predicted * point.tokens_per_iteration[g] / (1 + sum(point.acceptance_by_gamma[g]))
            gaps.append((abs(predicted / measured - 1), point.batch, point.context, g))
            cost_gaps.append((abs(costs_only / measured - 1), point.batch, point.context, g))
    lines += [_largest_gap("predicted vs measured", max(gaps)),
              _largest_gap("with the measured tokens per iteration (the costs alone)", max(cost_gaps))]
    if profile.lookup_speedup:
        first = min(profile.points, key=lambda p: (p.batch, p.context))
        kept = ", ".join(f"{n}-token match {rate:.2f}" for n, rate in sorted(profile.lookup_priors.items()))
        lines.append(f"prompt lookup alone at batch {first.batch}, context {first.context}, γ={max(profile.gammas)}: "
                     f"{profile.lookup_speedup:.2f}x; drafts kept after a {kept or '(no match often enough)'}")
    if profile.p_min_speedups:
        first = min(profile.points, key=lambda p: (p.batch, p.context))
        rates = ", ".join(f"{p:g}: {v:.2f}x" for p, v in sorted(profile.p_min_speedups.items()))
        lines.append(f"confidence threshold at batch {first.batch}, context {first.context}, γ={first.best_gamma} "
                     f"(rate over p_min 0): {rates}; default p_min {profile.p_min:g}")
    return "\n".join(lines)


def _largest_gap(label: str, gap: tuple) -> str:
    size, batch, context, gamma = gap
    return f"{label}: within {size:.1%} everywhere (the largest gap: batch {batch}, context {context}, γ={gamma})"


def _profile_rows(point) -> list[str]:
    star = {point.best_gamma: " <- γ*"}
    head = f"{point.batch:>5} {point.context:>7}"
    rows = [f"{head} {0:>3} {point.target_step_ms:>10.3f} {'':>9} {'':>10} {'':>8} {1.0:>9.2f}x{star.get(0, '')}"]
    for gamma in sorted(point.measured_speedup):
        tokens = f"{1 + sum(point.acceptance_by_gamma[gamma]):.2f}/{point.tokens_per_iteration[gamma]:.2f}"
        rows.append(f"{head} {gamma:>3} {'':>10} {point.draft_ms[gamma]:>9.3f} {point.verify_ms[gamma]:>10.3f} "
                    f"{point.overhead_ms:>8.3f} {point.predicted_speedup[gamma]:>9.2f}x "
                    f"{point.measured_speedup[gamma]:>8.2f}x {point.end_to_end_speedup[gamma]:>10.2f}x "
                    f"{tokens:>10}{star.get(gamma, '')}")
    return rows


class _Streamer:
    """Prints each prompt and then its continuation as tokens are accepted, one prompt after another.

    A batch runs in lockstep: while one prompt streams, the later ones are held back, and each
    prints what it has so far once the prompts before it are done (at EOS or max_new_tokens), then
    streams on. Several prompts are headed `--- prompt i/n`. Each continuation is decoded
    incrementally after the prompt's own tokens (Tokenizer.stream), so a decoder that drops the
    leading space of a text's first word (SentencePiece's) does not glue it to the prompt, and a
    step costs its own tokens, not the whole text again.
    """

    def __init__(self, tokenizer, prompts: list[str], max_new_tokens: int):
        self.tokenizer, self.prompts, self.max_new_tokens = tokenizer, prompts, max_new_tokens
        self.prompt_ids = [tokenizer.encode(p) for p in prompts]
        self.streams = [tokenizer.stream(ids) for ids in self.prompt_ids]
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.held: list[list[str]] = [[] for _ in prompts]  # decoded, not yet printed (a later prompt waits)
        self.current, self.printed = 0, None  # printed: characters of the current prompt's text (None: not begun)

    def __call__(self, row: int, token_ids: list[int]) -> None:
        self.tokens[row].extend(token_ids)
        self.held[row].append(self.streams[row].add(token_ids))
        while self.current < len(self.prompts):
            done = self._done(self.current)
            self._print_current(final=done)
            if not done:
                return
            self._next()

    def finish(self) -> None:
        """generate returned: every prompt is done; print whatever is still held back."""
        while self.current < len(self.prompts):
            self._print_current(final=True)
            self._next()

    def _done(self, row: int) -> bool:
        tokens = self.tokens[row]
        return len(tokens) >= self.max_new_tokens or (bool(tokens) and tokens[-1] in self.tokenizer.eos_token_ids)

    def _next(self) -> None:
        sys.stdout.write("\n")
        sys.stdout.flush()
        self.current, self.printed = self.current + 1, None

    def _print_current(self, final: bool) -> None:
        row = self.current
        if self.printed is None:  # begun only once tokens come: a refused request prints nothing
            header = f"--- prompt {row + 1}/{len(self.prompts)}\n" if len(self.prompts) > 1 else ""
            sys.stdout.write(header + self.prompts[row])
            self.printed = 0
        text = "".join(self.held[row])
        self.held[row].clear()
        if final:  # what the stream still holds (an unfinished UTF-8 character) prints as the whole text has it
            text = self.tokenizer.decode_continuation(self.prompt_ids[row], self.tokens[row])[self.printed:]
        sys.stdout.write(text)
        self.printed += len(text)
        sys.stdout.flush()


def _stats_line(stats, label: str = "") -> str:
    """One line per prompt on stderr; `label` names the prompt when there are several."""
    head = f"{label}, " if label else ""
    rate = f"{stats.new_tokens} tokens, {stats.tokens_per_s:.1f} tok/s"
    if stats.mode == "autoregressive":
        return f"[{head}autoregressive{': γ=auto chose plain decoding' if stats.auto_chose_plain else ''}] {rate}"
    kind = f"speculative γ={_gammas_shown(stats)}"
    if "medusa" in stats.by_proposer:
        nodes = stats.tree_nodes / max(1, stats.by_proposer["medusa"][0])
        kind = f"speculative, Medusa tree of {nodes:.1f} nodes"
    if stats.acceptance == "typical":
        kind += ", TYPICAL acceptance: approximate, not the target's greedy output"
    return (
        f"[{head}{kind}] {rate}, "
        f"acceptance {stats.acceptance_rate:.2f}, mean acceptance length {stats.mean_acceptance_length:.2f} "
        f"({stats.mean_accepted_drafts:.2f} of {_number(stats.mean_gamma)} drafts kept per verification) over "
        f"{stats.iterations} verifications, draft {stats.draft_ms:.0f} ms / verify {stats.verify_ms:.0f} ms"
        + _proposers_shown(stats)
    )


def _proposers_shown(stats) -> str:
    """Who drafted, when both did: "; drafts: draft 40 (0.80 kept), ngram 12 (0.92 kept)"."""
    if len(stats.by_proposer) < 2:
        return ""
    return "; drafts: " + ", ".join(f"{name} {drafted} ({kept / drafted:.2f} kept)"
                                    for name, (_, drafted, kept) in sorted(stats.by_proposer.items()))


def _gammas_shown(stats) -> str:
    """The γ asked for; under auto, the iterations run at each γ: "auto (γ=2 ×2, γ=6 ×9)"."""
    return f"auto ({_gamma_counts(stats.gammas_used)})" if stats.gamma == "auto" else str(stats.gamma)


def _gamma_counts(gammas_used: dict) -> str:
    return ", ".join(f"γ={g} ×{n}" for g, n in sorted(gammas_used.items()))


def _number(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


if __name__ == "__main__":
    main()
