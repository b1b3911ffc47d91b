"""`bench`: speculative vs autoregressive decoding on the same prompts, same backend, one process.

Runs are interleaved (AR, speculative, AR, ...) so drift in machine load hits both equally; each
repeat covers every prompt at batch 1, and the reported rates are medians over repeats. Every request
is the caller's `GenerationParams` with its side's mode and γ. The speculative runs are what a
user's default request gets: under γ = auto (the default) the policy decodes plainly where
speculation does not pay; params with mode "speculative" forbid that. Every measured speculative run
starts from what a fresh load knows (`Runtime.forget`): no cross-request cache, no acceptance learned
from earlier runs.

`bench_load` (`bench --concurrency`): serving under load, below its own divider.
"""

import json
import logging
import math
import statistics
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from speccompile.core.cost_model import predicted_end_to_end_speedup, predicted_speedup_mixed
from speccompile.core.params import AUTO, GenerationParams, Mode
from speccompile.core.stats import pooled
from speccompile.errors import SpecCompileError

log = logging.getLogger(__name__)

WARMUP_TOKENS = 8  # per warm-up request: enough for every graph and batch shape to run once


def read_prompts(path) -> list[str]:
    """A JSON list of strings, or a text file with one prompt per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise SpecCompileError(f"prompts file not found: {path}")
    text = path.read_text()
    if path.suffix == ".json":
        prompts = json.loads(text)
        if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
            raise SpecCompileError(f"{path}: expected a JSON list of strings")
    else:
        prompts = [line for line in text.splitlines() if line.strip()]
    if not prompts:
        raise SpecCompileError(f"{path}: no prompts")
    return prompts


# ---- records -----------------------------------------------------------------------------------
# What bench measures, as frozen records; `to_json()` gives what `bench --json` prints (the *_KEYS
# lists below are those objects' keys, in order: scripts read them).


def _json_value(value):
    """A field as JSON takes it: records as their to_json(), tuples as lists, inside dicts too."""
    if hasattr(value, "to_json"):
        return value.to_json()
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    if isinstance(value, dict):
        return {k: _json_value(v) for k, v in value.items()}
    return value


def _json(record, keys=None) -> dict:
    return {key: _json_value(getattr(record, key)) for key in keys or (f.name for f in fields(record))}


@dataclass(frozen=True)
class Drafts:
    """One proposer's drafts over a run's requests (iterations: those in which it drafted)."""

    iterations: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float

    @classmethod
    def by_proposer(cls, stats) -> dict[str, "Drafts"]:
        return {name: cls(n, drafted, kept, kept / drafted) for name, (n, drafted, kept) in stats.by_proposer.items()}

    def to_json(self) -> dict:
        return _json(self)


@dataclass(frozen=True)
class BenchCosts:
    """Step costs behind the cost model, from the pooled stats of the batch-1 runs (whose clocks
    are each call's own, so their sums are wall time)."""

    iterations: int
    plain_iterations: int  # iterations in which γ auto decoded plainly
    draft_tokens: int
    accepted_tokens: int
    acceptance_by_position: tuple[float, ...]
    target_step_ms: float
    draft_step_ms: float
    verify_ms: float  # the mean over the γ used
    overhead_ms_per_iteration: float
    draft_to_target_step_ratio: float
    predicted_speedup: float
    # the cost model over whole requests, as the measured speedup is taken: the speculative runs'
    # prefills and loop overhead per iteration added to predicted_speedup's decoding, against the
    # plain runs' measured rate (cost_model.predicted_end_to_end_speedup)
    predicted_end_to_end: float
    # structured output: the grammar engine's time per generated token (inside the times above)
    grammar_ms_per_token_autoregressive: float
    grammar_ms_per_token_speculative: float

    @classmethod
    def of(cls, ar, spec, ar_rate: float) -> "BenchCosts":
        """From the pooled stats of the plain runs and the speculative ones, and the plain runs'
        measured tokens/s."""
        iterations = max(1, spec.iterations)
        plain = spec.gammas_used.get(0, 0)
        t_target = ar.decode_ms / max(1, ar.iterations)
        t_draft = spec.draft_ms / max(1, spec.draft_tokens)
        t_verify = spec.verify_ms / max(1, iterations - plain)
        t_rest = (spec.total_ms - spec.prefill_ms - spec.decode_ms - spec.draft_ms - spec.verify_ms) / iterations
        with_overhead = predicted_speedup_mixed(spec.acceptance_by_position, spec.gammas_used, t_target, t_draft,
                                                t_verify, t_rest)
        return cls(spec.iterations, plain, spec.draft_tokens, spec.accepted_tokens, tuple(spec.acceptance_by_position),
                   t_target, t_draft, t_verify, t_rest, t_draft / t_target if t_target else 0.0,
                   predicted_speedup_mixed(spec.acceptance_by_position, spec.gammas_used, t_target, t_draft, t_verify),
                   predicted_end_to_end_speedup(1e3 / ar_rate, ar.decode_ms / max(1, ar.new_tokens),
                                                spec.prefill_ms / max(1, spec.new_tokens), with_overhead),
                   ar.grammar_ms / max(1, ar.new_tokens), spec.grammar_ms / max(1, spec.new_tokens))

    def to_json(self) -> dict:
        return _json(self)


BENCH_KEYS = ["proposer", "ar_tokens_per_s", "spec_tokens_per_s", "speedup", "acceptance_rate", "mean_accepted_drafts",
              "mean_acceptance_length", "gamma", "gammas_used", "by_proposer", "predicted_speedup", "efficiency"]


@dataclass(frozen=True)
class BenchResult:
    """One proposer's speculative runs against the plain runs: rates are medians over repeats,
    acceptance pools every speculative request; `costs` are the timings behind the prediction."""

    proposer: str
    ar_tokens_per_s: float
    spec_tokens_per_s: float
    speedup: float
    acceptance_rate: float
    mean_accepted_drafts: float
    mean_acceptance_length: float
    gamma: int | str
    gammas_used: dict[int, int]  # γ -> iterations
    by_proposer: dict[str, Drafts]
    predicted_speedup: float
    efficiency: float  # measured speedup over predicted
    costs: BenchCosts

    @classmethod
    def of(cls, proposer: str, gamma, ar, ar_rate: float, spec, spec_rate: float) -> "BenchResult":
        costs = BenchCosts.of(ar, spec, ar_rate)
        speedup = spec_rate / ar_rate
        return cls(proposer, ar_rate, spec_rate, speedup, spec.acceptance_rate, spec.mean_accepted_drafts,
                   spec.mean_acceptance_length, gamma, dict(sorted(spec.gammas_used.items())), Drafts.by_proposer(spec),
                   costs.predicted_speedup, speedup / costs.predicted_speedup, costs)

    def to_json(self) -> dict:
        """BENCH_KEYS (bench --json); the costs are not part of it."""
        return _json(self, BENCH_KEYS)


ACCEPTANCE_KEYS = ["acceptance", "ar_tokens_per_s", "spec_tokens_per_s", "speedup", "acceptance_rate",
                   "mean_acceptance_length", "token_agreement", "identical_outputs", "mean_log_likelihood",
                   "perplexity", "exact_mean_log_likelihood", "exact_perplexity"]


@dataclass(frozen=True)
class AcceptanceRow:
    """One Medusa acceptance rule against exact greedy decoding (bench_acceptance)."""

    acceptance: str
    ar_tokens_per_s: float
    spec_tokens_per_s: float
    speedup: float
    acceptance_rate: float
    mean_acceptance_length: float
    token_agreement: float  # positions holding exact greedy decoding's token
    identical_outputs: float  # prompts whose whole output is exact greedy decoding's
    mean_log_likelihood: float  # the target's, per generated token
    perplexity: float
    exact_mean_log_likelihood: float
    exact_perplexity: float

    def to_json(self) -> dict:
        return _json(self)


# ---- runs --------------------------------------------------------------------------------------


def _run_all(runtime, prompts, params: GenerationParams, results_out=None):
    """Every prompt alone (batch 1), one after another: (tokens/s over the calls' own clocks, stats)."""
    results = [result for p in prompts for result in runtime.generate([p], params)]
    if results_out is not None:
        results_out[:] = results
    tokens = sum(r.stats.new_tokens for r in results)
    seconds = sum(r.stats.total_ms for r in results) / 1e3
    return tokens / seconds, [r.stats for r in results]


def _warm_up(params: GenerationParams) -> GenerationParams:
    return GenerationParams.of(params, max_new_tokens=WARMUP_TOKENS)


def _plain(params: GenerationParams) -> GenerationParams:
    return GenerationParams.of(params, mode=Mode.AUTOREGRESSIVE, gamma=None)


def _speculative(params: GenerationParams) -> GenerationParams:
    """The speculative side: what a default request gets (γ auto, which may decode plainly where
    speculation does not pay), unless the params ask for a γ or for mode "speculative" (never plain)."""
    if params.mode == Mode.AUTOREGRESSIVE:
        raise SpecCompileError("bench compares speculative runs with autoregressive ones: mode autoregressive "
                               "leaves nothing to compare")
    gamma = AUTO if params.gamma is None else params.gamma
    mode = params.mode or (None if gamma == AUTO else Mode.SPECULATIVE)
    return GenerationParams.of(params, mode=mode, gamma=gamma)


def _seeded(params: GenerationParams | None) -> GenerationParams:
    """A sampled bench without a seed is seeded 0: every repeat draws the same tokens."""
    params = params or GenerationParams()
    return GenerationParams.of(params, seed=0) if params.temperature and params.seed is None else params


# ---- exact vs approximate acceptance ----------------------------------------------------------


def bench_acceptance(runtime, prompts: list[str], rules: list[str], params: GenerationParams | None = None,
                     repeats: int = 3) -> list[AcceptanceRow]:
    """A Medusa bundle's acceptance rules against the same plain (exact greedy) runs, interleaved as
    bench_proposers does: each rule's speedup, and how far its text is from exact greedy decoding,
    position by position (token_agreement; identical_outputs: the share of prompts whose whole
    output is the same) and by the target's own mean log-likelihood per generated token (and its
    perplexity), beside the exact output's. params: the requests (max_new_tokens, ...); each rule's
    runs are the Medusa heads' at γ auto."""
    if repeats < 1:
        raise SpecCompileError(f"--repeats must be positive, got {repeats}")
    if not runtime.bundle.medusa:
        raise SpecCompileError("--acceptance compares acceptance rules of Medusa trees: the bundle needs --medusa")
    params = _seeded(params)
    plain = _plain(params)
    spec = {rule: GenerationParams.of(params, mode=Mode.SPECULATIVE, gamma=AUTO, proposer="medusa", acceptance=rule)
            for rule in rules}
    ar_rates, spec_rates = [], {rule: [] for rule in rules}
    spec_stats, outputs, exact = {rule: [] for rule in rules}, {}, []
    for warm in (plain, *spec.values()):  # warm-up: sessions, caches, the tree's size
        _run_all(runtime, prompts[:1], _warm_up(warm))
    for _ in range(repeats):
        ar_rates.append(_run_all(runtime, prompts, plain, results_out=exact)[0])
        for rule in rules:
            outputs[rule] = []
            rate, stats = _run_all(runtime, prompts, spec[rule], outputs[rule])
            spec_rates[rule].append(rate)
            spec_stats[rule] += stats
    ids = [runtime.tokenizer.encode(p) for p in prompts]
    exact_ll = log_likelihood(runtime, ids, [r.token_ids for r in exact])
    return [_acceptance_row(runtime, rule, statistics.median(ar_rates), statistics.median(spec_rates[rule]),
                            pooled(spec_stats[rule]), ids, outputs[rule], exact, exact_ll) for rule in rules]


def _acceptance_row(runtime, rule: str, ar_rate: float, spec_rate: float, spec, ids, outputs, exact,
                    exact_ll: float) -> AcceptanceRow:
    ll = log_likelihood(runtime, ids, [r.token_ids for r in outputs])
    same = [_agreement(r.token_ids, e.token_ids) for r, e in zip(outputs, exact)]
    return AcceptanceRow(rule, ar_rate, spec_rate, spec_rate / ar_rate, spec.acceptance_rate,
                         spec.mean_acceptance_length, sum(n for n, _ in same) / max(1, sum(t for _, t in same)),
                         sum(n == t for n, t in same) / len(same), ll, math.exp(-ll), exact_ll, math.exp(-exact_ll))


def _agreement(tokens: list[int], exact: list[int]) -> tuple[int, int]:
    """(positions holding the exact output's token, positions compared: the longer output's length)."""
    return sum(a == b for a, b in zip(tokens, exact)), max(len(tokens), len(exact), 1)


def log_likelihood(runtime, prompts: list[list[int]], continuations: list[list[int]]) -> float:
    """The target's mean log-probability (natural log, temperature 1) per continuation token,
    each continuation scored after its prompt, one prompt at a time on the target's slot 0. Only
    while the runtime serves nothing: it drives the target engine directly."""
    assert runtime.scheduler.idle, "scoring with requests in flight would overwrite their caches"
    target, total, count = runtime.target, 0.0, 0
    plain = {"temperature": np.ones(1, np.float32), "top_k": np.zeros(1, np.int64), "top_p": np.ones(1, np.float32)}
    for prompt, continuation in zip(prompts, continuations):
        target.cache_lengths[0] = 0
        tokens = np.array([prompt], dtype=np.int64)
        for token in continuation:
            _, probs = target.forward_sample(tokens, np.array([tokens.shape[1]]), plain, np.full(1, 0.5, np.float32))
            total += math.log(max(float(probs[0, token]), 1e-30))
            count += 1
            tokens = np.array([[token]], dtype=np.int64)
    target.cache_lengths[0] = 0
    return total / max(1, count)


# ---- speculative vs plain, at batch 1 ---------------------------------------------------------


def bench(runtime, prompts: list[str], params: GenerationParams | None = None, repeats: int = 3) -> BenchResult:
    """bench_proposers for the params' proposer alone."""
    params = params or GenerationParams()
    [result] = bench_proposers(runtime, prompts, [params.proposer], params, repeats)
    return result


def bench_proposers(runtime, prompts: list[str], proposers: list[str], params: GenerationParams | None = None,
                    repeats: int = 3) -> list[BenchResult]:
    """bench for each proposer, all against the same autoregressive runs: each repeat runs plain
    decoding and then every proposer through all prompts, so that a slow stretch of the machine hits
    them alike. One result per proposer, in order. params: every request's (its proposer replaced by
    each of `proposers`); γ None is "auto", the default, and mode "speculative" keeps γ auto from
    decoding plainly.

    Every speculative run starts cold (Runtime.forget): what finished requests answered (suffix
    decoding's cross-request tree) and what the γ policy learned are forgotten before it, so no
    measured run drafts from the outputs of the same prompts in the plain runs, the warm-ups, other
    proposers' runs or earlier repeats, nor starts from their acceptance. Within a run, a prompt
    may draft from the answers to the prompts before it, as in any stream of requests."""
    if repeats < 1:
        raise SpecCompileError(f"--repeats must be positive, got {repeats}")
    params = _seeded(params)
    plain, spec = _plain(params), {p: _speculative(GenerationParams.of(params, proposer=p)) for p in proposers}
    for warm in (plain, *spec.values()):  # warm-up: sessions, caches
        _run_all(runtime, prompts[:1], _warm_up(warm))
    ar_rates, ar_stats = [], []
    spec_rates, spec_stats = {p: [] for p in proposers}, {p: [] for p in proposers}
    for _ in range(repeats):
        rate, stats = _run_all(runtime, prompts, plain)
        ar_rates.append(rate)
        ar_stats += stats
        for proposer in proposers:
            runtime.forget()
            rate, stats = _run_all(runtime, prompts, spec[proposer])
            spec_rates[proposer].append(rate)
            spec_stats[proposer] += stats
    ar, ar_rate = pooled(ar_stats), statistics.median(ar_rates)
    return [BenchResult.of(proposer, spec[proposer].gamma, ar, ar_rate, pooled(spec_stats[proposer]),
                           statistics.median(spec_rates[proposer])) for proposer in proposers]


# ---- serving under load -----------------------------------------------------------------------
# `bench_load` replays one stream of requests through `runtime.submit` at each concurrency, the
# autoregressive and speculative runs interleaved (AR, spec, AR, spec, ...) on the same requests
# and the same backend.
#
# The stream: prompts in shuffled cycles over the list, output lengths drawn uniformly from
# [max_new_tokens / 2, 3 max_new_tokens / 2], both fixed by a seed, so that every run serves the
# same requests. Clients are closed-loop by default: C client threads, each sending its next request
# when its previous one has finished. With a rate, requests arrive as a Poisson process (open loop)
# and C caps the requests in flight: C clients take the arrivals in order, and a request that
# arrives while all C are busy waits for one. Its latency and time to first token count from its
# arrival, as its user would see them, so an overloaded server shows in the latencies.
#
# Speculative serving is the engine's: under γ "auto" its policy picks γ each iteration for the
# current load, plain decoding included where it predicts that speculation does not pay (params
# with mode "speculative" forbid that); a fixed γ drafts that many tokens on every iteration.
#
# Each row: tokens_per_s is all tokens generated in a run over the run's wall time (first request
# sent to last one finished), the median over repeats; latency (sent to last token), TTFT (sent to
# first token) and ITL are percentiles over every request of every repeat, timed by the client when
# tokens reach it (on_tokens); acceptance_rate and mean_gamma pool the speculative requests' stats
# (mean_gamma: drafts per request-iteration, 0 for plain iterations). ITL is per token: a delivery of
# n tokens after a wait of t ms counts n gaps of t/n ms, so that a speculative iteration that brings
# several tokens at once compares with plain decoding's one token per step.

LOAD_KEYS = ["concurrency", "mode", "tokens_per_s", "p50_latency_ms", "p99_latency_ms", "p50_ttft_ms", "p99_ttft_ms",
             "p50_itl_ms", "acceptance_rate", "mean_gamma"]
LOAD_MODES = ("autoregressive", "speculative")  # the order in which each repeat runs them


@dataclass(frozen=True)
class LoadDetails:
    """Where a row's time went. Per-iteration costs are each request's share of the iterations it ran
    in (requests decoding together share an iteration); other_ms is the rest of a request's time
    between its first and last token: other requests' prefill chunks and the loop's own work."""

    concurrency: int
    mode: str
    tokens: tuple[int, ...]  # per run
    wall_s: tuple[float, ...]  # per run
    gammas_used: dict[int, int]  # drafts -> request-iterations
    tokens_per_iteration: float
    draft_ms_per_iteration: float
    verify_ms_per_iteration: float
    decode_ms_per_iteration: float
    other_ms_per_iteration: float
    prefill_ms_per_request: float

    def to_json(self) -> dict:
        return _json(self)


@dataclass(frozen=True)
class LoadRow:
    """One concurrency and mode (see the notes above); `details`: where its time went."""

    concurrency: int
    mode: str
    tokens_per_s: float
    p50_latency_ms: float
    p99_latency_ms: float
    p50_ttft_ms: float
    p99_ttft_ms: float
    p50_itl_ms: float
    acceptance_rate: float
    mean_gamma: float
    details: LoadDetails

    def to_json(self) -> dict:
        """LOAD_KEYS (bench --concurrency --json); the details are not part of it."""
        return _json(self, LOAD_KEYS)


@dataclass(frozen=True)
class LoadRequest:
    prompt: str
    max_new_tokens: int
    arrival_s: float | None = None  # open loop: seconds after the run starts; None: sent when a client is free
    seed: int = 0  # its random stream, when sampling


def request_stream(prompts: list[str], count: int, max_new_tokens: int, rate: float | None = None,
                   seed: int = 0) -> list[LoadRequest]:
    """`count` requests, the same for the same arguments (see the notes above)."""
    rng = np.random.default_rng(seed)
    cycles = -(-count // len(prompts))
    order = np.concatenate([rng.permutation(len(prompts)) for _ in range(cycles)])[:count]
    lengths = rng.integers(max(1, max_new_tokens // 2), max(1, max_new_tokens * 3 // 2) + 1, size=count)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=count)) if rate else [None] * count
    seeds = rng.integers(2**31, size=count)
    return [LoadRequest(prompts[p], int(n), None if a is None else float(a), int(s))
            for p, n, a, s in zip(order, lengths, arrivals, seeds)]


def bench_load(runtime, prompts: list[str], params: GenerationParams | None = None, concurrencies=(1, 2, 4, 8),
               requests: int = 16, rate: float | None = None, repeats: int = 3, seed: int = 0) -> list[LoadRow]:
    """Throughput and latency of serving at each concurrency, autoregressive and speculative: one
    row per concurrency and mode. params: every request's (its max_new_tokens the middle of the
    stream's lengths; γ None is "auto"); a sampled request draws from its own seed in the stream."""
    params = params or GenerationParams()
    _check_load(concurrencies, requests, rate, repeats, params.max_new_tokens)
    stream = request_stream(prompts, requests, params.max_new_tokens, rate, seed)
    sides = {"autoregressive": _plain(params), "speculative": _speculative(params)}
    rows = []
    for concurrency in concurrencies:
        runs = _runs_at(runtime, stream, concurrency, repeats, sides)
        rows += [_load_row(concurrency, mode, runs[mode]) for mode in LOAD_MODES]
    return rows


def _check_load(concurrencies, requests: int, rate: float | None, repeats: int, max_new_tokens: int | None) -> None:
    if not concurrencies or any(c < 1 for c in concurrencies):
        raise SpecCompileError(f"concurrencies must be positive, got {list(concurrencies)}")
    if requests < 1 or repeats < 1:
        raise SpecCompileError(f"requests and repeats must be positive, got {requests} and {repeats}")
    if rate is not None and rate <= 0:
        raise SpecCompileError(f"rate must be positive (requests/s), got {rate}")
    if max_new_tokens is None:
        raise SpecCompileError("bench under load needs max_new_tokens: its requests' lengths vary around it")


def _runs_at(runtime, stream: list[LoadRequest], concurrency: int, repeats: int,
             sides: dict[str, GenerationParams]) -> dict:
    """One warm-up round per mode (short requests, one per client: sessions and first runs at this
    load are not timed), then the timed runs, modes
    interleaved, each from what a fresh load knows. {mode: [(wall seconds, [_Served])] per repeat}."""
    warmup = [LoadRequest(r.prompt, min(WARMUP_TOKENS, r.max_new_tokens), None, r.seed)
              for r in (stream[i % len(stream)] for i in range(concurrency))]
    for mode in LOAD_MODES:
        _serve(runtime, warmup, concurrency, sides[mode])
    runs = {mode: [] for mode in LOAD_MODES}
    for repeat in range(repeats):
        for mode in LOAD_MODES:
            runtime.forget()  # cold: no run drafts from answers an earlier one gave, nor starts from its acceptance
            wall, served = _serve(runtime, stream, concurrency, sides[mode])
            runs[mode].append((wall, served))
            log.info(f"concurrency {concurrency}, {mode} run {repeat + 1}/{repeats}: {_tokens(served)} tokens "
                     f"in {wall:.2f} s ({_tokens(served) / wall:.1f} tokens/s)")
    return runs


@dataclass
class _Served:
    """What a client saw of one request: when it was sent (open loop: when it arrived), when each
    list of tokens reached it and how many there were, and its result."""

    sent: float
    deliveries: list[tuple[float, int]] = field(default_factory=list)
    result: object = None

    def on_tokens(self, tokens: list[int]) -> None:  # when they reached the client
        self.deliveries.append((time.perf_counter(), len(tokens)))

    @property
    def latency_ms(self) -> float:
        return (self.deliveries[-1][0] - self.sent) * 1e3

    @property
    def ttft_ms(self) -> float:
        return (self.deliveries[0][0] - self.sent) * 1e3

    def token_gaps_ms(self) -> list[float]:
        """One inter-token gap per token after the first delivery (see the notes above)."""
        gaps = []
        for (before, _), (at, count) in zip(self.deliveries, self.deliveries[1:]):
            gaps += [(at - before) * 1e3 / count] * count
        return gaps


def _serve(runtime, stream: list[LoadRequest], concurrency: int,
           params: GenerationParams) -> tuple[float, list[_Served]]:
    """Replay the stream through `concurrency` client threads. Returns (seconds from the start until
    the last client is done, what each request saw, in stream order). A failed request stops the
    clients and is raised here."""
    served: list[_Served | None] = [None] * len(stream)
    pending, lock, errors = iter(range(len(stream))), threading.Lock(), []
    start = time.perf_counter()

    def client():
        try:
            while (index := _take(pending, lock)) is not None:
                served[index] = _send(runtime, stream[index], start, params)
        except Exception as error:  # noqa: BLE001 (raised again on the caller's thread, below)
            with lock:
                errors.append(error)
                for _ in pending:  # the other clients stop after their current request
                    pass

    threads = [threading.Thread(target=client, name=f"bench-client-{n}") for n in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    return wall, served


def _take(pending, lock: threading.Lock) -> int | None:
    with lock:
        return next(pending, None)


def _send(runtime, request: LoadRequest, start: float, params: GenerationParams) -> _Served:
    """Send one request (open loop: not before it arrives) and wait for its result. Sampled, it
    draws from its own seed, the same in every run."""
    if request.arrival_s is None:
        sent = time.perf_counter()
    else:
        sent = start + request.arrival_s
        time.sleep(max(0.0, sent - time.perf_counter()))
    served = _Served(sent)
    seed = request.seed if params.temperature else params.seed
    params = GenerationParams.of(params, max_new_tokens=request.max_new_tokens, seed=seed)
    handle = runtime.submit(request.prompt, params, on_tokens=served.on_tokens)
    served.result = handle.result()
    return served


def _tokens(served: list[_Served]) -> int:
    return sum(len(s.result.token_ids) for s in served)


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else 0.0


def _load_row(concurrency: int, mode: str, runs: list) -> LoadRow:
    served = [s for _, run in runs for s in run]
    stats = pooled([s.result.stats for s in served])
    latency, ttft = [s.latency_ms for s in served], [s.ttft_ms for s in served]
    itl = [gap for s in served for gap in s.token_gaps_ms()]
    return LoadRow(concurrency, mode, statistics.median(_tokens(run) / wall for wall, run in runs),
                   _percentile(latency, 50), _percentile(latency, 99), _percentile(ttft, 50), _percentile(ttft, 99),
                   _percentile(itl, 50), stats.acceptance_rate, stats.mean_gamma,
                   _load_details(concurrency, mode, runs, served, stats))


def _load_details(concurrency: int, mode: str, runs: list, served: list[_Served], stats) -> LoadDetails:
    iterations = max(1, stats.iterations)
    after_first = sum(s.result.stats.total_ms - s.result.stats.ttft_ms for s in served)
    phases = stats.draft_ms + stats.verify_ms + stats.decode_ms
    return LoadDetails(concurrency, mode, tuple(_tokens(run) for _, run in runs), tuple(wall for wall, _ in runs),
                       dict(sorted(stats.gammas_used.items())), stats.new_tokens / iterations,
                       stats.draft_ms / iterations, stats.verify_ms / iterations, stats.decode_ms / iterations,
                       (after_first - phases) / iterations, stats.prefill_ms / len(served))


def save_load_plot(rows: list[LoadRow], path) -> Path:
    """tokens/s and p99 latency vs concurrency, one line per mode (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecCompileError("the plot needs matplotlib: pip install 'speccompile[profile]'") from None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = (("tokens_per_s", "tokens/s (all requests)"), ("p99_latency_ms", "p99 latency (ms)"))
    for ax, (key, label) in zip(axes, panels):
        for mode in LOAD_MODES:
            mine = [r for r in rows if r.mode == mode]
            ax.plot([r.concurrency for r in mine], [getattr(r, key) for r in mine], marker="o", label=mode)
        ax.set(xlabel="concurrency (clients)", ylabel=label, xticks=sorted({r.concurrency for r in rows}))
        ax.legend(fontsize="small")
    fig.suptitle("serving under load: speculative vs autoregressive")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
