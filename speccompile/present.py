"""What the command line shows: the runtime's typed results as text (tables, stats lines, streamed text).

Every function here takes a record (GenerationStats, bench's BenchResult / LoadRow / AcceptanceRow,
profile's GammaProfile and GraphOps) and returns the lines to print; none parses options or writes
except `print_streams`, which prints continuations as their text comes. `--json` output is each
record's own `to_json()`, not made here.
"""

import sys

from speccompile.runtime.bench import BENCH_KEYS, AcceptanceRow, BenchResult, Drafts, LoadRow

# ---- generate ----------------------------------------------------------------------------------


def print_streams(handles: list, prompts: list[str]) -> list:
    """Print each prompt and then its continuation as its output processor delivers it (runtime
    submit_batch's handles, made with stream_text): the text no stop string can cut any more, then
    the rest of its result's text. The requests run at once; a later prompt's text waits for the
    prompts before it, then prints what it has so far and streams on. Several prompts are headed
    `--- prompt i/n`. Returns the results, in order."""
    results = []
    for row, (handle, prompt) in enumerate(zip(handles, prompts)):
        sys.stdout.write((f"--- prompt {row + 1}/{len(prompts)}\n" if len(prompts) > 1 else "") + prompt)
        printed = 0
        for delta in handle.deltas():
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            printed += len(delta.text)
        results.append(handle.result())
        sys.stdout.write(results[-1].text[printed:] + "\n")
        sys.stdout.flush()
    return results


def stats_lines(results) -> str:
    """One stats line per result; each labelled with its prompt when there are several."""
    return "\n".join(stats_line(r.stats, f"prompt {i + 1}/{len(results)}" if len(results) > 1 else "")
                     for i, r in enumerate(results))


def stats_line(stats, label: str = "") -> str:
    """One request's GenerationStats in a line; `label` names the prompt when there are several."""
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
    return f"auto ({gamma_counts(stats.gammas_used)})" if stats.gamma == "auto" else str(stats.gamma)


def gamma_counts(gammas_used: dict) -> str:
    return ", ".join(f"γ={g} ×{n}" for g, n in sorted(gammas_used.items()))


def _number(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


# ---- bench -------------------------------------------------------------------------------------

BENCH_COSTS = ("target_step_ms", "draft_step_ms", "verify_ms", "overhead_ms_per_iteration",
               "draft_to_target_step_ratio", "acceptance_by_position")
GRAMMAR_COSTS = ("grammar_ms_per_token_autoregressive", "grammar_ms_per_token_speculative")


def bench_table(result: BenchResult, grammar: bool = False) -> str:
    """Every summary key and the costs behind the prediction, one `key  value` line each (with
    `grammar`: the grammar engine's time per token too)."""
    rows = [(key, getattr(result, key)) for key in BENCH_KEYS]
    rows += [(key, getattr(result.costs, key)) for key in BENCH_COSTS + (GRAMMAR_COSTS if grammar else ())]
    width = max(len(key) for key, _ in rows)
    return "\n".join(f"{key:<{width}}  {_bench_value(value)}" for key, value in rows)


def _bench_value(value) -> str:
    if isinstance(value, dict) and all(isinstance(v, Drafts) for v in value.values()):  # by_proposer
        return ", ".join(f"{name} {d.draft_tokens} drafts ({d.acceptance_rate:.2f} kept)" for name, d in value.items())
    if isinstance(value, dict):  # gammas_used: γ -> iterations
        return gamma_counts(value)
    if isinstance(value, tuple):
        return ", ".join(f"{v:.3f}" for v in value)
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def proposers_table(results: list[BenchResult]) -> str:
    """bench with several proposers: the plain rate, then one line per proposer."""
    lines = [f"autoregressive: {results[0].ar_tokens_per_s:.1f} tok/s",
             f"{'proposer':<9} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'accept len':>10}  drafts by proposer"]
    for r in results:
        split = ", ".join(f"{name} {d.draft_tokens} ({d.acceptance_rate:.2f} kept)"
                          for name, d in r.by_proposer.items())
        lines.append(f"{r.proposer:<9} {r.spec_tokens_per_s:>8.1f} {r.speedup:>7.2f}x {r.acceptance_rate:>7.2f} "
                     f"{r.mean_acceptance_length:>10.2f}  {split}")
    return "\n".join(lines)


def acceptance_table(rows: list[AcceptanceRow]) -> str:
    """bench --acceptance: each rule's speed and how far its text is from exact greedy decoding."""
    lines = [f"autoregressive: {rows[0].ar_tokens_per_s:.1f} tok/s, exact output's perplexity "
             f"{rows[0].exact_perplexity:.2f}",
             f"{'acceptance':<10} {'tok/s':>8} {'speedup':>8} {'accept len':>10} {'agreement':>9} "
             f"{'identical':>9} {'perplexity':>10}"]
    for r in rows:
        lines.append(f"{r.acceptance:<10} {r.spec_tokens_per_s:>8.1f} {r.speedup:>7.2f}x "
                     f"{r.mean_acceptance_length:>10.2f} {r.token_agreement:>9.3f} {r.identical_outputs:>9.2f} "
                     f"{r.perplexity:>10.2f}")
    return "\n".join(lines)


def load_table(rows: list[LoadRow]) -> str:
    """One line per concurrency and mode; a speculative line also shows its rate over autoregressive's
    at the same concurrency, and the drafts per request-iteration that it used."""
    ar_rate = {r.concurrency: r.tokens_per_s for r in rows if r.mode == "autoregressive"}
    lines = [f"{'conc':>4} {'mode':<14} {'tok/s':>7} {'vs AR':>6} {'lat p50':>8} {'lat p99':>8} {'ttft p50':>8} "
             f"{'ttft p99':>8} {'itl p50':>7} {'accept':>6} {'mean γ':>6}  (times in ms)"]
    for row in rows:
        spec = row.mode == "speculative"
        ratio = f"{row.tokens_per_s / ar_rate[row.concurrency]:.2f}x" if spec else ""
        times = (f"{row.p50_latency_ms:>8.1f} {row.p99_latency_ms:>8.1f} {row.p50_ttft_ms:>8.1f} "
                 f"{row.p99_ttft_ms:>8.1f} {row.p50_itl_ms:>7.1f}")
        used = f"  {gamma_counts(row.details.gammas_used)}" if spec else ""
        lines.append(f"{row.concurrency:>4} {row.mode:<14} {row.tokens_per_s:>7.1f} {ratio:>6} {times} "
                     f"{row.acceptance_rate:>6.2f} {row.mean_gamma:>6.2f}{used}")
    return "\n".join(lines)


# ---- profile -----------------------------------------------------------------------------------


def profile_table(profile) -> str:
    """Per batch size, context and γ: ms per iteration (target: a plain decoding step; draft: the
    iteration's γ draft steps; loop: its own work), the γ policy's predicted speedup, the measured
    one (steady state), end to end (prefill included, as bench), tokens per iteration (expected from
    the acceptance at that γ over whole runs / measured in steady state), and γ*; then the largest
    gap between predicted and measured, and what prompt lookup and the thresholds measured."""
    lines = ["ms per iteration; speedup over plain decoding: the γ policy's prediction, measured in steady state "
             "and end to end",
             f"{'batch':>5} {'context':>7} {'γ':>3} {'target ms':>10} {'draft ms':>9} {'verify ms':>10} {'loop ms':>8} "
             f"{'predicted':>10} {'measured':>9} {'end to end':>11} {'tokens/it':>10}"]
    for point in profile.points:
        lines += _profile_rows(point)
    gaps, cost_gaps = _gaps(profile)
    lines += [_largest_gap("predicted vs measured", max(gaps)),
              _largest_gap("with the measured tokens per iteration (the costs alone)", max(cost_gaps))]
    return "\n".join(lines + _first_point_lines(profile))


def _gaps(profile) -> tuple[list, list]:
    """(|predicted / measured - 1|, batch, context, γ) for every point and γ: as predicted, and with the
    measured tokens per iteration in place of the acceptance's (the cost model's speedup is
    proportional to them, so what is left of the gap is the costs')."""
    gaps, cost_gaps = [], []
    for point in profile.points:
        for g, measured in point.measured_speedup.items():
            predicted = point.predicted_speedup[g]
            costs_only = predicted * point.tokens_per_iteration[g] / (1 + sum(point.acceptance_by_gamma[g]))
            gaps.append((abs(predicted / measured - 1), point.batch, point.context, g))
            cost_gaps.append((abs(costs_only / measured - 1), point.batch, point.context, g))
    return gaps, cost_gaps


def _first_point_lines(profile) -> list[str]:
    """What the profile measured at its first point only: prompt lookup alone, and the thresholds."""
    first = min(profile.points, key=lambda p: (p.batch, p.context))
    lines = []
    if profile.lookup_speedup:
        kept = ", ".join(f"{n}-token match {rate:.2f}" for n, rate in sorted(profile.lookup_priors.items()))
        lines.append(f"prompt lookup alone at batch {first.batch}, context {first.context}, γ={max(profile.gammas)}: "
                     f"{profile.lookup_speedup:.2f}x; drafts kept after a {kept or '(no match often enough)'}")
    if profile.p_min_speedups:
        rates = ", ".join(f"{p:g}: {v:.2f}x" for p, v in sorted(profile.p_min_speedups.items()))
        lines.append(f"confidence threshold at batch {first.batch}, context {first.context}, γ={first.best_gamma} "
                     f"(rate over p_min 0): {rates}; default p_min {profile.p_min:g}")
    return lines


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


def op_tables(graphs) -> str:
    """profile --ops: each graph's top op types by share of its kernels' time."""
    lines = []
    for graph in graphs:
        lines.append(f"\n{graph.graph}: top ops by share (batch {graph.batch}, context {graph.context})")
        lines += [f"  {op.op:<22} {op.ms:8.3f} ms  {op.share:6.1%}" for op in graph.ops]
    return "\n".join(lines)


# ---- inspect -----------------------------------------------------------------------------------


def bundle_summary(info) -> str:
    """inspect: a bundle's models, memory, graphs and engines (runtime/inspect.BundleInfo)."""
    lines = [f"bundle {info.path}  ({info.size_mb} MB, format {info.format_version})",
             f"γ {info.gammas}  max_seq {info.max_seq}  max_batch {info.max_batch}  vocab {info.vocab_size}"]
    for role, model in info.models.items():
        lines.append(f"{role}: {model.model_type}, {model.num_params / 1e6:.2f}M params, "
                     f"{model.num_layers} layers, hidden {model.hidden_size}, {model.num_heads} heads / "
                     f"{model.num_kv_heads} KV heads{_source(model.source_format)}")
    for role, mem in info.memory.items():
        folded = ", float32 in memory" if mem.matmul_weights in ("float16", "bfloat16") else ""
        lines.append(f"{role} memory: weights {mem.weights_bytes / 1e6:.1f} MB "
                     f"({mem.matmul_weights} matmuls{folded}), {mem.weight_copies} copy at run time; "
                     f"KV cache {mem.kv_cache_bytes_per_sequence / 1e6:.1f} MB per sequence, "
                     f"{mem.kv_cache_bytes_at_max_batch / 1e6:.1f} MB at max_batch")
    lines.append("graphs (the KV cache inputs/outputs past_*/present_* are omitted):")
    for name, graph in info.graphs.items():
        lines += _graph_lines(name, graph)
    return "\n".join(lines + _engine_lines(info.engines))


def _source(source) -> str:
    """", from GGUF: kept 12 Q8_0; dequantized 30 Q4_K" for a GGUF source; nothing for safetensors."""
    if source is None or source.format != "gguf":
        return ""
    kept = ", ".join(f"{n} {kind}" for kind, n in sorted(source.kept.items())) or "nothing"
    converted = ", ".join(f"{n} {kind}" for kind, n in sorted(source.converted.items())) or "nothing"
    return f"; from GGUF: kept {kept} as blocks, dequantized {converted}"


def _graph_lines(name: str, graph) -> list[str]:
    top = ", ".join(f"{op} {n}" for op, n in sorted(graph.op_counts.items(), key=lambda kv: -kv[1])[:6])
    plugin = "  [TensorRT: plugin needed]" if graph.tensorrt_needs_plugin else ""
    variant = graph.single_sequence_nodes
    single = "" if variant is None else f"; batch-1 variant {variant} nodes"
    return [f"  {name}: {graph.nodes} nodes ({top}){plugin}{single}",
            "    in:  " + "; ".join(f"{k} {v[0]}{v[1]}" for k, v in graph.inputs.items()),
            "    out: " + "; ".join(f"{k} {v[0]}{v[1]}" for k, v in graph.outputs.items())]


def _engine_lines(engines: dict) -> list[str]:
    if not engines:
        return ["TensorRT engines: none (build with --backend tensorrt on an NVIDIA machine)"]
    return ["TensorRT engines:"] + [f"  {name}: {e.file} (TensorRT {e.tensorrt_version}, {e.gpu}, "
                                    f"sm {e.compute_capability})" for name, e in engines.items()]
