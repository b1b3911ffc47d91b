"""The `speccompile` command line: a thin shell over `speccompile.build` and `speccompile.load`.

Commands parse their options (a request's from its spec: cli_options.py), call the Python API and
print its typed results through present.py, or as their `to_json()` with --json."""

import functools
import json
import logging
import signal
from pathlib import Path

import click

from speccompile import present
from speccompile.cli_options import generation_options, params_from_cli
from speccompile.core.params import GenerationParams
from speccompile.core.proposers import DEFAULT_PROPOSER, PROPOSERS
from speccompile.errors import SpecCompileError
from speccompile.runtime.profile import PROFILE_PARAMS


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
@click.option("--target-weights", type=click.Choice(["float32", "float16", "bfloat16", "int8", "int4", "w8a8"]),
              default=None, help="Target matmul weights: the compiled target's precision, "
              "which the output follows (int8: weight-only, per output column, a quarter of the bytes per decode "
              "step; int4: weight-only in blocks of 128 along the input, about an eighth; w8a8: int8 weights and "
              "activations rounded to int8 per token, ONNX Runtime only: cheaper verifications, coarser numbers). "
              "Default: float32; for a GGUF int8. A GGUF's Q4_0-Q8_0 and Q4_K-Q6_K blocks are kept as they are at "
              "int8 and int4 (a float precision takes their exact values).")
@click.option("--draft-weights", type=click.Choice(["int8", "int4", "w8a8", "float32", "float16", "bfloat16"]),
              default=None,
              help="Draft matmul weights: int8 or int4 weight-only (faster draft steps), float32, or float16/bfloat16 "
              "(half the disk, float32 in memory on CPU); the output is the target's whatever the draft's precision. "
              "Default: the target's for an int4 or w8a8 target, else int8.")
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
@click.option("--eagle", "eagle_dir", default=None, type=click.Path(),
              help="EAGLE-3 head directory (the EAGLE authors' or speculators' layout): it drafts from the target's "
              "own hidden states (proposer eagle), beside a draft model or without one.")
@click.option("--eagle-weights", type=click.Choice(["int8", "int4", "w8a8", "float32", "float16", "bfloat16"]),
              default=None, help="EAGLE-3 head matmul weights (as --draft-weights, and its default).")
@click.option("--eagle-vocab", type=int, default=None,
              help="The EAGLE-3 head drafts only the K most frequent of its tokens (faster head steps; outputs "
              "unchanged), by its token_frequencies.json or --draft-vocab-corpus.")
@click.option("--backend", type=click.Choice(["onnxruntime", "tensorrt", "onnx"]), default="onnxruntime",
              show_default=True,
              help="tensorrt: also build TensorRT engines from the same ONNX graphs; onnx: the graphs in standard "
              "ops, for TensorRT or another runtime later (int8/int4 weights then stored twice).")
@click.option("--plugin-lib", type=click.Path(), default=None, help="libspeccompile_plugins.so (TensorRT backend).")
@click.option("--timing-cache", type=click.Path(), default=None, help="TensorRT timing cache file to load and update.")
@click.option("--hardware-compat", is_flag=True, help="TensorRT: engines portable across Ampere+ GPUs.")
@click.option("--version-compat", is_flag=True, help="TensorRT: engines loadable by later TensorRT versions.")
@user_errors
def build(target_dir, draft_dir, out_dir, gammas, max_seq, max_batch, force, target_weights, draft_weights, draft_vocab,
          draft_vocab_corpus, single_sequence, medusa_dir, eagle_dir, eagle_weights, eagle_vocab, backend, plugin_lib,
          timing_cache, hardware_compat, version_compat):
    """Export a target/draft pair to a bundle of ONNX speculative graphs (and TensorRT engines)."""
    from speccompile.compiler.build import build_bundle
    from speccompile.compiler.tensorrt_build import TensorRTOptions

    tensorrt = TensorRTOptions(plugin_lib, timing_cache, hardware_compat, version_compat)
    build_bundle(target_dir, draft_dir, out_dir, gammas=list(gammas), max_seq=max_seq, max_batch=max_batch, force=force,
                 draft_weights=draft_weights, draft_vocab=draft_vocab, draft_vocab_corpus=draft_vocab_corpus,
                 single_sequence=single_sequence, target_weights=target_weights, medusa_dir=medusa_dir,
                 eagle_dir=eagle_dir, eagle_weights=eagle_weights, eagle_vocab=eagle_vocab, backend=backend,
                 tensorrt=tensorrt)


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
@click.option("--eagle3", type=int, default=None,
              help="Train an EAGLE-3 head on the frozen target instead of a draft, unrolled K drafts deep in training "
              "(EAGLE-3 uses 7). --layers, --hidden, --heads and --init do not apply; --intermediate is the head's "
              "MLP width (default: the target's).")
@click.option("--draft-vocab", type=int, default=None,
              help="With --eagle3: the head drafts over the corpus' K most frequent tokens (default: 32000, or the "
              "target's whole vocabulary if smaller).")
@click.option("--aux-layers", default=None,
              help="With --eagle3: the three target layers whose input the head reads, comma-separated "
              "(default: EAGLE's 2, N/2, N-3 of an N-layer target).")
@user_errors
def distill(target_dir, corpus, out_dir, medusa, eagle3, draft_vocab, aux_layers, **options):
    """Train a small draft that matches the target's next-token distribution (or, with --medusa, heads
    on the target that predict the tokens after the next; with --eagle3, an EAGLE-3 head)."""
    from speccompile.training.distill import DistillOptions
    from speccompile.training.distill import distill as run_distill

    if medusa is not None and eagle3 is not None:
        raise SpecCompileError("--medusa and --eagle3 train different proposers: give one")
    if eagle3 is None:
        for name, value in (("draft-vocab", draft_vocab), ("aux-layers", aux_layers)):
            if value is not None:
                raise SpecCompileError(f"--{name} shapes an EAGLE-3 head: it applies only with --eagle3")
    if eagle3 is not None:
        _distill_eagle3(target_dir, corpus, out_dir, eagle3, draft_vocab, aux_layers, options)
    elif medusa is None:
        run_distill(target_dir, corpus, out_dir, DistillOptions(**options))
    else:
        _distill_medusa(target_dir, corpus, out_dir, medusa, options)


DRAFT_ONLY = ("layers", "hidden", "heads", "intermediate", "init")  # distill options that shape a draft model


def _refuse_draft_options(refused: tuple[str, ...], flag: str) -> None:
    """A draft option given with --medusa or --eagle3 is refused rather than ignored: the user expected it to matter."""
    from click.core import ParameterSource

    context = click.get_current_context()
    for name in refused:
        if context.get_parameter_source(name) is not ParameterSource.DEFAULT:
            raise SpecCompileError(f"--{name} shapes a draft; {flag} trains heads on the target (drop --{name})")


def _distill_medusa(target_dir, corpus, out_dir, heads: int, options: dict) -> None:
    from speccompile.training.medusa import MedusaOptions, train_medusa

    _refuse_draft_options(DRAFT_ONLY, "--medusa")
    shared = {name: value for name, value in options.items() if name not in DRAFT_ONLY}
    train_medusa(target_dir, corpus, out_dir, MedusaOptions(heads=heads, **shared))


EAGLE3_REFUSED = tuple(name for name in DRAFT_ONLY if name != "intermediate")  # --intermediate: the head's MLP


def _distill_eagle3(target_dir, corpus, out_dir, ttt_steps: int, draft_vocab, aux_layers, options: dict) -> None:
    from speccompile.training.eagle3 import Eagle3Options, train_eagle3

    _refuse_draft_options(EAGLE3_REFUSED, "--eagle3")
    shared = {name: value for name, value in options.items() if name not in EAGLE3_REFUSED}
    train_eagle3(target_dir, corpus, out_dir, Eagle3Options(ttt_steps=ttt_steps, draft_vocab=draft_vocab,
                                                            aux_layer_ids=_layer_ids(aux_layers), **shared))


def _layer_ids(text: str | None) -> tuple[int, ...] | None:
    """--aux-layers "2,16,29" -> (2, 16, 29)."""
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise SpecCompileError(f"--aux-layers takes comma-separated layer ids (like 2,16,29), got {text!r}") from None


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


TREE_HELP = ("Medusa bundles: the token tree, 'chain' (each head's top candidate), a number of nodes grown from the "
             "heads' accuracies, or 'auto' (default: the size measured fastest here).")


def constraint_options(command):
    """Structured output: one of a JSON schema file, a grammar file or a regular expression."""
    command = click.option("--regex", default=None, help="Generate text matching this regular expression.")(command)
    command = click.option("--grammar", "grammar_file", type=click.Path(exists=True, dir_okay=False), default=None,
                           help="Generate text in the grammar in this file: Lark, or llama.cpp's GBNF.")(command)
    return click.option("--json-schema", "json_schema", type=click.Path(exists=True, dir_okay=False), default=None,
                        help="Generate JSON valid against the schema in this file (structured output).")(command)


def _constraint(json_schema, grammar_file, regex) -> dict:
    """GenerationParams.of's constraint keywords for the options given (the files' text)."""
    given = {"json_schema": Path(json_schema).read_text() if json_schema else None,
             "grammar": Path(grammar_file).read_text() if grammar_file else None, "regex": regex}
    return {key: value for key, value in given.items() if value is not None}


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--prompt", "prompts", multiple=True, required=True, help="Prompt text; repeat for a batch.")
@generation_options
@click.option("--tree", default=None, help=TREE_HELP)
@constraint_options
@click.option("--json", "as_json", is_flag=True, help="Print results as a JSON list.")
@backend_option
@user_errors
def generate(bundle, prompts, tree, json_schema, grammar_file, regex, as_json, backend, **options):
    """Generate text with speculative decoding (or the target alone).

    BUNDLE defaults to the embedded demo pair. With --json-schema, --grammar or --regex the output is
    constrained, the draft's proposals and the target's choices alike (speculation stays on).
    """
    import speccompile

    params = GenerationParams.of(params_from_cli(options), **_constraint(json_schema, grammar_file, regex))
    runtime = speccompile.load(resolve_bundle(bundle), backend, shared_threads=True)  # the process is ours
    _tree_option(runtime, tree)
    handles = runtime.submit_batch(list(prompts), params, stream_text=not as_json)
    if as_json:
        click.echo(json.dumps([h.result().to_dict() for h in handles], indent=1))
        return
    rows = [prompt for prompt in prompts for _ in range(params.n)]  # each prompt's n samples, in order
    results = present.print_streams(handles, rows)
    click.echo(present.stats_lines(results), err=True)


BENCH_OWN = ("proposer", "acceptance", "mode")  # bench compares proposers and acceptance rules; it runs both modes


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--prompts", "prompts_file", type=click.Path(), default=None,
              help="JSON list of prompts, or one prompt per line.")
@generation_options(skip=BENCH_OWN)
@click.option("--repeats", type=int, default=3, show_default=True)
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
@click.option("--tree", default=None, help=TREE_HELP)
@click.option("--acceptance", "rules", type=click.Choice(["exact", "typical"]), multiple=True,
              help="Medusa bundles: compare acceptance rules (repeat: exact and typical) against the same plain "
              "runs: speedup, agreement with exact greedy output, and the target's log-likelihood of each text.")
@constraint_options
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object with the summary keys (with several --proposer or --concurrency: a "
              "JSON list, one object per proposer, or per concurrency and mode).")
@backend_option
@user_errors
def bench(bundle, prompts_file, repeats, concurrency, requests, rate, always_speculate, plot_path, proposers, tree,
          rules, json_schema, grammar_file, regex, as_json, backend, **options):
    """Speculative vs autoregressive tokens/s on the same prompts (medians over repeats): at batch 1,
    or with --concurrency, serving many requests at once (γ auto by default). Constrained (--json-schema,
    --grammar, --regex), both sides are, and the grammar engine's time per token is shown."""
    import speccompile
    from speccompile.runtime import bench as benches

    constraint = _constraint(json_schema, grammar_file, regex)
    own = {"proposer": proposers[0]} if proposers else {}
    params = GenerationParams.of(params_from_cli(options), **own, **constraint,
                                 mode="speculative" if always_speculate else None)
    runtime = speccompile.load(resolve_bundle(bundle), backend, shared_threads=True)  # the process is ours
    _tree_option(runtime, tree)
    if constraint:
        runtime.compile_constraint(**constraint)  # a bad schema: one line, before anything runs
    prompts = read_prompts(prompts_file)
    if rules:
        _echo(benches.bench_acceptance(runtime, prompts, list(rules), params, repeats), as_json,
              present.acceptance_table)
    elif concurrency is not None:
        load = {"concurrencies": _int_list(concurrency), "requests": requests, "rate": rate, "repeats": repeats}
        _bench_load(runtime, prompts, params, load, as_json, plot_path)
    elif len(proposers) > 1:
        _echo(benches.bench_proposers(runtime, prompts, list(proposers), params, repeats), as_json,
              present.proposers_table)
    else:
        result = benches.bench(runtime, prompts, params, repeats)
        click.echo(json.dumps(result.to_json()) if as_json else present.bench_table(result, grammar=bool(constraint)))


def _echo(records: list, as_json: bool, table) -> None:
    """A JSON list of the records, or their table."""
    click.echo(json.dumps([r.to_json() for r in records]) if as_json else table(records))


def _tree_option(runtime, tree: str | None) -> None:
    if tree is None or tree == "auto":
        return
    if tree != "chain":
        try:
            tree = int(tree)
        except ValueError:
            raise SpecCompileError(f"--tree must be 'auto', 'chain' or a number of nodes, not {tree!r}") from None
    runtime.set_tree(tree)


def _bench_load(runtime, prompts: list[str], params: GenerationParams, load: dict, as_json: bool, plot_path) -> None:
    """bench --concurrency: a JSON list of the rows, or their table; and the plot."""
    from speccompile.runtime.bench import bench_load, save_load_plot

    rows = bench_load(runtime, prompts, params, **load)
    _echo(rows, as_json, present.load_table)
    if as_json and plot_path is None:
        return
    try:
        path = save_load_plot(rows, plot_path or runtime.bundle.path / "profiles" / "load.png")
        click.echo(f"plot: {path}", err=as_json)  # stdout stays one JSON document
    except SpecCompileError as e:
        click.echo(f"no plot: {e}", err=True)


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
    files = checked.manifest.files
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
    from speccompile.runtime.inspect import describe

    info = describe(open_bundle(resolve_bundle(bundle)))
    click.echo(json.dumps(info.to_json(), indent=1) if as_json else present.bundle_summary(info))


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


PROFILE_OWN = ("mode", "gamma", "proposer", "p_min", "n", "acceptance")  # what each profile run sets itself


@main.command()
@click.argument("bundle", type=click.Path(), required=False)
@click.option("--prompts", "prompts_file", type=click.Path(), default=None,
              help="Prompts the runs continue (JSON list or one per line).")
@click.option("--batch-sizes", default=None,
              help="Comma-separated batch sizes (default: every one from 1 to the bundle's max batch).")
@click.option("--context-lengths", default="64,256", show_default=True,
              help="Mean context of the runs at each point: prompts of this length minus half the new tokens.")
@generation_options(skip=PROFILE_OWN, defaults={"max_new_tokens": PROFILE_PARAMS.max_new_tokens})
@click.option("--repeats", type=int, default=1, show_default=True,
              help="Passes over all prompts per mode at each batch size and context, per round.")
@click.option("--rounds", type=int, default=3, show_default=True,
              help="Sweeps over all batch sizes, contexts and modes; each number is the median over them.")
@click.option("--ops", is_flag=True, help="Also print ONNX Runtime's per-op time breakdown of each graph.")
@click.option("--plots", "plots_dir", type=click.Path(), default=None,
              help="Where to save PNG plots (default: BUNDLE/profiles).")
@backend_option
@user_errors
def profile(bundle, prompts_file, batch_sizes, context_lengths, repeats, rounds, ops, plots_dir, backend, **options):
    """Measure γ costs and speedups in loop runs on this hardware; store a γ profile in the bundle."""
    import speccompile
    from speccompile.runtime import gamma_profile
    from speccompile.runtime import profile as prof

    params = params_from_cli(options)
    runtime = speccompile.load(resolve_bundle(bundle), backend, shared_threads=True)  # the process is ours
    batches = _int_list(batch_sizes) if batch_sizes else list(range(1, runtime.max_batch + 1))
    result = prof.build_profile(runtime, read_prompts(prompts_file), batches, _int_list(context_lengths), params,
                                repeats, rounds)
    path = gamma_profile.write_profile(runtime.bundle.path, result)
    click.echo(present.profile_table(result))
    click.echo(f"profile written to {path}")
    try:
        for png in prof.save_plots(result, Path(plots_dir) if plots_dir else path.parent):
            click.echo(f"plot: {png}")
    except SpecCompileError as e:
        click.echo(f"no plots: {e}", err=True)
    if ops:
        click.echo(present.op_tables(prof.op_profiles(runtime)))


if __name__ == "__main__":
    main()
