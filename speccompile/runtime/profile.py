"""`profile`: measure what γ costs and buys on this hardware, and store a γ profile in the bundle.

What it measures: loop runs, not steps. At every batch size b and context length, the prompts go
through `Runtime.generate` b at a time, in plain decoding and at every γ the runtime verifies at, the modes
alternating prompt group by prompt group, for `rounds` rounds. Each run is read two ways:
  - its steady state, from the times at which tokens stream out (`on_tokens`): over the iterations
    in which all b requests were decoding (after the last one's first token, before the first one
    to finish got its last, which max_new_tokens cuts), wall time and tokens per iteration. The
    draft and verification shares of an iteration come from the phase clocks of the first request
    to finish (core/stats.py); the rest is the loop's own work (`overhead_ms`: emitting, rollback,
    scheduling);
  - end to end: all its tokens over the call's wall time, prefill included (what `bench` reports).
Each cost is taken relative to the same round's plain decoding iteration, and is the median of
that ratio over rounds times the median iteration (see context_costs). Every (batch size, context)
point keeps its own costs and its own acceptance by draft position (from every request of its runs
at each γ), because both move with context: steps grow with it, and a draft distilled on short
sequences drafts poorly past them (the demo draft, distilled on 128-token sequences, picks the
target's greedy token 0.75 of the time at positions under 128 and 0.35 past 192, teacher-forced in
transformers; its first draft is accepted 0.74 to 0.82 of the time at context 64, 0.26 to 0.57 at
256). The runtime's γ policy for a load and context
starts from the nearest point's costs and acceptance (`GammaProfile.prior`). The predicted speedup of each
γ is `GammaPolicy.speedup` with that point's costs and its acceptance at that γ, and γ* the best of
them: the table prints what the runtime's policy believes at that point before it has observed
anything. The measured speedup is each round's steady-state rate at γ over the same round's plain
decoding rate, median over rounds.

Why loop runs. The previous profile timed each step alone, back to back and rolled back, and
compared the speedup that predicted with one measured end to end, later: its table disagreed with
itself (issue 12: demo pair, batch 1, γ=4, predicted 3.12×, measured 1.46×, `bench --gamma 4` minutes
later 2.9×). Checked on the demo pair here (2 cores, which other processes share), batch 1, context
~64, steps alone against loop runs in the same rounds, medians of 5 (ms):

    step alone -> in the loop            γ=2            γ=4            γ=6
    target step (plain decoding)         5.53 -> 5.76 (the loop's own work per step)
    draft steps per iteration            0.92 -> 1.51   1.84 -> 2.41   2.76 -> 3.23
    verification                         5.96 -> 5.87   6.58 -> 6.99   8.24 -> 9.05
    loop's own work per iteration           -> 0.31        -> 0.28        -> 0.52
    speedup predicted from steps alone   2.11×          2.65×          2.70×
    measured, steady state               2.09×          2.49×          2.38×
    measured, end to end (64 tokens)     1.92×          2.24×          2.13×

The draft's first step of an iteration reads two tokens ([prev, last]), which one step alone does
not; a verification after the draft's steps finds the target's weights partly evicted from the
caches by the draft's session (γ=6: +10%); the loop's own work is paid every iteration. Steps
alone thus over-predict by up to 13% (γ=6), and end to end is another 10% below steady state
(prefill is the same work in both modes; each run's last iteration is cut at max_new_tokens). At
batch 4 the errors cancelled (predicted 1.27×, measured 1.29× at γ=4). None of this reaches a 2×
disagreement: that came from when things were measured. The cores are shared, and the machine's
speed moves by several times from minute to minute (a target step took 5.5 ms in one minute and
18 to 33 ms in others, load average 3 to 6 on 2 cores): step costs timed in one minute and speedups
in another may disagree without limit. Hence loop runs, modes alternating run by run, and ratios
to the same round's plain decoding.

Where the remaining gap goes (predicted vs measured, both steady state): acceptance (the prediction
uses the P_k of the runs at γ_max; a run at γ sees its own: tokens/it in the table shows both),
the per-γ spread of the loop's own work (one number per iteration in the model), and what noise
the medians leave. End to end is lower, for the reasons above, and at b > 1 also because a request
that finishes early leaves the others a smaller batch. Neither depends on the costs the policy uses.
"""

import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from speccompile.bundle import GraphId
from speccompile.core.cost_model import LoopCosts
from speccompile.core.gamma_policy import GammaPolicy, best_gamma
from speccompile.core.params import GenerationParams, Mode
from speccompile.core.stats import pooled
from speccompile.errors import SpecCompileError
from speccompile.runtime.edge import emitted_at
from speccompile.runtime.gamma_profile import GammaProfile, ProfilePoint
from speccompile.runtime.hardware import fingerprint, fingerprint_key

logger = logging.getLogger(__name__)
P_MIN_CANDIDATES = [0.0, 0.05, 0.1, 0.2, 0.3]
THRESHOLD_MARGIN = 0.03  # a threshold must beat none by this much: runs at one point drift by a few %
LOOKUP_MIN_REACHED = 20  # draft positions a matched length needs before its measured rate replaces the prior
# the runs' requests, unless the caller's differ: 48 tokens give every γ steady iterations, and many runs fit
PROFILE_PARAMS = GenerationParams(max_new_tokens=48)
WARMUP_TOKENS = 8
# ---------------------------------------------------------------------------------------------
# loop runs


@dataclass
class LoopRun:
    """Generate calls in one mode, summed: the steady state (the iterations in which every request
    was decoding), the draft and verification clocks, and the calls end to end."""

    window_ms: float  # wall time of the steady-state iterations
    iterations: int  # how many
    tokens: int  # tokens they emitted, summed over the requests
    draft_ms: float  # the first request to finish: its clocks (its iterations all ran with every request)
    verify_ms: float
    clocked_iterations: int  # its iterations
    new_tokens: int  # end to end: every token of every request
    wall_ms: float  # the calls' wall time, prefill included
    stats: list  # each request's GenerationStats

    def __add__(self, other: "LoopRun") -> "LoopRun":
        return LoopRun(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    @property
    def iteration_ms(self) -> float:
        return self.window_ms / self.iterations

    @property
    def tokens_per_iteration(self) -> float:
        return self.tokens / self.iterations

    @property
    def rate(self) -> float:
        """Steady-state tokens per ms."""
        return self.tokens / self.window_ms

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_ms * 1e3

    def per_iteration(self, clock: str) -> float:
        """ms per iteration of the "draft" or "verify" clock (0 in plain decoding)."""
        return getattr(self, f"{clock}_ms") / max(1, self.clocked_iterations)

    @property
    def overhead_ms(self) -> float:
        """The rest of a steady-state iteration: the loop's own work."""
        return self.iteration_ms - self.per_iteration("draft") - self.per_iteration("verify")


def profiled_proposer(runtime) -> str:
    """What the loop runs propose with: the draft model, whose γ the policy weighs (prompt lookup
    proposes what matches, whatever the γ); a draft-free bundle's lookup."""
    return "draft" if runtime.draft is not None else "ngram"


def run_loop(runtime, prompts: list, gamma: int, params: GenerationParams, p_min: float = 0.0,
             proposer: str | None = None) -> LoopRun:
    """Generate for all `prompts` at once, at `gamma` (0: plain decoding), each request `params`
    with this γ, proposer (default: profiled_proposer) and p_min."""
    events = []  # (time, request, tokens): when each request's tokens came out

    def on_tokens(row: int, ids: list[int]) -> None:  # the time the engine emitted them
        events.append((emitted_at(), row, len(ids)))

    params = GenerationParams.of(params, mode=Mode.SPECULATIVE if gamma else Mode.AUTOREGRESSIVE, gamma=gamma or None,
                                 proposer=proposer or profiled_proposer(runtime), p_min=p_min)
    start = time.perf_counter()
    results = runtime.generate(prompts, params, on_tokens=on_tokens)
    wall_ms = (time.perf_counter() - start) * 1e3
    first = min(results, key=lambda r: r.stats.total_ms).stats
    return LoopRun(*steady_state(events, len(prompts)), first.draft_ms, first.verify_ms, first.iterations,
                   sum(r.stats.new_tokens for r in results), wall_ms, [r.stats for r in results])


def steady_state(events: list[tuple[float, int, int]], requests: int) -> tuple[float, int, int]:
    """(ms, iterations, tokens) of the iterations in which every request was decoding, from
    (time, request, tokens) emissions; none when a request finished too soon. The first request to
    finish paces them: its emissions after every request's first (prefill) token, up to but not
    including its last (cut at max_new_tokens). The tokens counted are those of the iterations its
    emissions end (`iteration_of`: by the order of emissions, not their times, which a loaded
    machine delays by more than an iteration's length between two requests' emissions)."""
    times = {r: [t for t, row, _ in events if row == r] for r in range(requests)}
    if not all(times.values()):
        raise SpecCompileError("a profile run emitted no tokens for one of its prompts")
    pacer = min(times, key=lambda r: times[r][-1])
    iterations = iteration_of(events)
    pace = [(t, i) for (t, row, _), i in zip(events, iterations) if row == pacer]
    all_decoding = max(t[0] for t in times.values())
    start = next(k for k, (t, _) in enumerate(pace) if t >= all_decoding)
    end = len(pace) - 2  # the last whole iteration
    if end <= start:
        return 0.0, 0, 0
    low, high = pace[start][1], pace[end][1]
    return (pace[end][0] - pace[start][0]) * 1e3, end - start, sum(
        n for (_, _, n), i in zip(events, iterations) if low < i <= high)


def iteration_of(events: list[tuple[float, int, int]]) -> list[int]:
    """The iteration of each emission: one engine thread emits each decoding request's tokens once an
    iteration, in order, so a request emitting again begins the next one."""
    iteration, emitted, out = 0, set(), []
    for _, row, _ in events:
        if row in emitted:
            iteration, emitted = iteration + 1, set()
        emitted.add(row)
        out.append(iteration)
    return out


def prompt_tokens(runtime, prompts: list[str]) -> list[list[int]]:
    return [runtime.tokenizer.encode(p) for p in prompts]


def prompts_at(tokens: list[list[int]], batch: int, length: int, offset: int) -> list[list[int]]:
    """`batch` prompts of `length` tokens: prompt i ends where calibration prompt offset+i ends, and
    begins as far back in the calibration prompts before it as the length asks (cyclically). Each
    run continues a real prompt, so its acceptance is the prompts' own, at any context length."""
    stream = [t for p in tokens for t in p]
    ends = np.cumsum([len(p) for p in tokens])
    rows = []
    for i in range(batch):
        end = int(ends[(offset + i) % len(tokens)])
        rows.append([stream[(end - length + k) % len(stream)] for k in range(length)])
    return rows


# ---------------------------------------------------------------------------------------------
# the profile


def build_profile(runtime, prompts: list[str], batch_sizes: list[int], context_lengths: list[int],
                  params: GenerationParams = PROFILE_PARAMS, repeats: int = 1, rounds: int = 3) -> GammaProfile:
    """Loop runs at every batch size and context, `rounds` times, and the profile they make. At each
    point every round takes every mode through all prompts `repeats` times, b at a time, so every
    batch size sees the same text (a point measured on one group of b prompts sees those prompts'
    acceptance, and at b=2 the demo's two first prompts gave 3.5 tokens per iteration at γ=6 where
    all eight give 4.1). Greedy decoding makes the same tokens each round, so rounds differ only in
    how fast the machine was, and the medians over rounds remove that alone. A machine that slows
    down for a while spoils one round, not the profile. params: the runs' requests (max_new_tokens,
    sampling, ...); each run sets its own mode, γ, proposer and p_min."""
    if runtime.bundle.medusa:
        raise SpecCompileError("profile measures the γ of draft models and prompt lookup; a Medusa bundle sizes its "
                               "token tree by measured cost when it first runs (compare sizes with bench --tree N)")
    if params.n != 1:
        raise SpecCompileError(f"profile runs one sample of each prompt, not n={params.n}")
    points = run_points(runtime, batch_sizes, context_lengths, repeats, rounds, params.max_new_tokens)
    tokens = prompt_tokens(runtime, prompts)
    for b in batch_sizes:
        _warm_up(runtime, prompts_at(tokens, b, min(points.values()), 0), params)
    runs = {(b, c): [] for b in batch_sizes for c in points}  # one {γ: LoopRun} per round
    for r in range(rounds):
        logger.info(f"loop runs, round {r + 1}/{rounds}: batch sizes {batch_sizes}, contexts {list(points)}, "
                    f"γ 0 and {', '.join(map(str, runtime.gammas))}")
        for (b, c), samples in runs.items():
            samples.append(_run_modes(runtime, prompt_groups(tokens, b, points[c], repeats), params, rotation=r))
    measured = [point_entry(samples, b, c) for (b, c), samples in runs.items()]
    first = next(p for p in measured if p.batch == min(batch_sizes) and p.context == min(points))
    thresholds = threshold_speedups(runtime, tokens, first, points[first.context], params, rounds)
    lookup_speedup, lookup_priors = lookup_runs(runtime, tokens, first, points[first.context], params, rounds)
    fp = fingerprint(runtime.backend)
    return GammaProfile(fp, fingerprint_key(fp), datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        runtime.gammas, list(points), params.max_new_tokens,
                        mean_acceptance([p.acceptance_by_position for p in measured]), measured,
                        p_min=best_threshold(thresholds), p_min_speedups=thresholds,
                        lookup_speedup=lookup_speedup, lookup_priors=lookup_priors)


def lookup_runs(runtime, tokens, point: ProfilePoint, prompt_length: int, params: GenerationParams,
                rounds: int) -> tuple[float, dict[int, float]]:
    """Prompt lookup at the profile's first point: proposing up to the largest γ, through all prompts
    every round, alternating with plain decoding. Returns its steady rate over plain decoding's
    (median over rounds) and the rate at which its drafts were kept, per matched suffix length,
    over all rounds (lengths reached at least LOOKUP_MIN_REACHED times): what "auto" starts from."""
    groups = prompt_groups(tokens, point.batch, prompt_length)
    gamma, ratios, stats = max(runtime.gammas), [], []
    for r in range(rounds):
        summed = summed_runs(groups, rotated([0, gamma], r), lambda group, g: run_loop(
            runtime, group, g, params, proposer="ngram" if g else None))
        ratios.append(summed[gamma].rate / summed[0].rate if summed[gamma].iterations else 0.0)
        stats += summed[gamma].stats
    by_match = pooled(stats).lookup_by_match
    priors = {n: kept / reached for n, (reached, kept) in by_match.items() if reached >= LOOKUP_MIN_REACHED}
    return statistics.median(ratios), dict(sorted(priors.items()))


def threshold_speedups(runtime, tokens, point: ProfilePoint, prompt_length: int, params: GenerationParams,
                       rounds: int) -> dict[float, float]:
    """The default p_min's measurement: at the profile's first point (the smallest batch size and
    context) and its γ*, each of P_MIN_CANDIDATES through all prompts, b at a time, every round
    (candidates alternating, their order rotated); the median over rounds of each one's steady
    rate over p_min 0's in the same round. {} where γ* is 0 or there is no draft model."""
    if point.best_gamma == 0 or runtime.draft is None:
        return {}
    groups = prompt_groups(tokens, point.batch, prompt_length)
    ratios = {p: [] for p in P_MIN_CANDIDATES}
    for r in range(rounds):
        summed = summed_runs(groups, rotated(P_MIN_CANDIDATES, r),
                             lambda group, p: run_loop(runtime, group, point.best_gamma, params, p))
        for p in summed:
            ratios[p].append(summed[p].rate / summed[0.0].rate if summed[p].iterations else 0.0)
    return {p: statistics.median(values) for p, values in ratios.items()}


def best_threshold(speedups: dict[float, float]) -> float:
    """The p_min of the best rate, if it beats no threshold by more than THRESHOLD_MARGIN (noise)."""
    best = max(speedups, key=lambda p: (speedups[p], -p), default=0.0)
    return best if speedups and speedups[best] > 1 + THRESHOLD_MARGIN else 0.0


def mean_acceptance(per_point: list[list[float]]) -> list[float]:
    """The policy's prior: P_k averaged over the profile's points, each point alike (a point where
    drafts are rejected runs more iterations, and would outweigh the others in pooled counts)."""
    return [statistics.mean(p[k] for p in per_point) for k in range(len(per_point[0]))]


def run_points(runtime, batch_sizes, context_lengths, repeats, rounds, max_new_tokens) -> dict[int, int]:
    """{mean context: prompt length} of the runs, after checking every setting. A run's prompt holds
    the context less half its new tokens, so that its mean context is the one asked for; a context
    shorter than that runs from a prompt of one token, and is recorded as the mean it has."""
    for b in batch_sizes:
        if not 1 <= b <= runtime.max_batch:
            raise SpecCompileError(f"batch size {b} is outside 1..{runtime.max_batch} (the bundle's max batch)")
    if rounds < 1 or repeats < 1:
        raise SpecCompileError(f"--rounds and --repeats must be positive (got {rounds}, {repeats})")
    if max_new_tokens is None or max_new_tokens < 8:
        raise SpecCompileError(f"--max-new-tokens must be at least 8 to time whole iterations (got {max_new_tokens})")
    half = max_new_tokens // 2
    lengths = sorted({max(1, c - half) for c in context_lengths})
    points = {n + half: n for n in lengths if n + max_new_tokens + max(runtime.gammas) + 1 <= runtime.max_seq}
    if not points:
        raise SpecCompileError(f"no context length in {context_lengths} leaves room for {max_new_tokens} new tokens "
                               f"in the bundle's max sequence length {runtime.max_seq}")
    return points


def prompt_groups(tokens: list[list[int]], batch: int, length: int, passes: int = 1) -> list[list[list[int]]]:
    """Groups of `batch` prompts of `length` tokens (prompts_at) that take every prompt `passes` times."""
    return [prompts_at(tokens, batch, length, offset=k * batch) for k in range(passes * -(-len(tokens) // batch))]


def rotated(keys: list, rotation: int) -> list:
    """`keys` from the rotation-th on, so that no key always runs first."""
    return keys[rotation % len(keys):] + keys[:rotation % len(keys)]


def summed_runs(groups: list, keys: list, run) -> dict:
    """run(group, key) for every key through every group, keys alternating group by group, so that a
    slow stretch of the machine hits them alike; each key's runs summed (LoopRun +)."""
    runs = [{key: run(group, key) for key in keys} for group in groups]
    return {key: sum((r[key] for r in runs[1:]), runs[0][key]) for key in keys}


def _warm_up(runtime, prompts, params: GenerationParams) -> None:
    """Sessions, bindings and first-run allocations of every mode at this batch size, untimed."""
    short = GenerationParams.of(params, max_new_tokens=WARMUP_TOKENS)
    for gamma in (0, *runtime.gammas):
        run_loop(runtime, prompts, gamma, short)


def _run_modes(runtime, groups: list[list], params: GenerationParams, rotation: int) -> dict[int, LoopRun]:
    """Every mode (0: plain decoding, then each γ) through every group of prompts, summed per mode.
    Modes alternate group by group, so a slow stretch of the machine hits them alike; their order is
    rotated, so no mode always runs first after another batch size's runs."""
    summed = summed_runs(groups, rotated([0, *runtime.gammas], rotation),
                         lambda group, g: run_loop(runtime, group, g, params))
    for gamma, run in summed.items():
        if not run.iterations:
            raise SpecCompileError(f"no run at γ={gamma} lasted a whole iteration after every request began "
                                   "(requests ended early): raise --max-new-tokens")
    return summed


def point_entry(samples: list[dict[int, LoopRun]], batch: int, context: int) -> ProfilePoint:
    """One batch size and context: its costs; its acceptance at each γ (P_k over every request of
    its runs at that γ); the speedup the γ policy predicts for each γ with these costs and the
    acceptance seen at that γ, and γ*, the best of them (GammaPolicy's rule); and the measured
    speedups: each round's rate at γ over the same round's in plain decoding, median over rounds,
    in steady state and end to end."""
    costs = context_costs(samples)
    gammas = costs.gammas
    acceptance = {g: point_acceptance(samples, g) for g in gammas}
    predicted = {0: 1.0, **{g: GammaPolicy(costs, acceptance[g]).speedup(g) for g in gammas}}

    def ratio(gamma: int, rate: str) -> float:
        return statistics.median(getattr(s[gamma], rate) / getattr(s[0], rate) for s in samples)

    return ProfilePoint(batch, context, **costs.timings(), acceptance_by_gamma=acceptance, predicted_speedup=predicted,
                        best_gamma=best_gamma(predicted), measured_speedup={g: ratio(g, "rate") for g in gammas},
                        end_to_end_speedup={g: ratio(g, "tokens_per_s") for g in gammas},
                        tokens_per_iteration={g: statistics.median(s[g].tokens_per_iteration for s in samples) / batch
                                              for g in gammas})


def point_acceptance(samples: list[dict[int, LoopRun]], gamma: int) -> list[float]:
    """P_1..P_γ over every request of the runs at γ (a position no iteration reached: 0)."""
    by_position = pooled([stats for s in samples for stats in s[gamma].stats]).acceptance_by_position
    return (by_position + [0.0] * gamma)[:gamma]


def context_costs(samples: list[dict[int, LoopRun]]) -> LoopCosts:
    """Costs at one batch size and context. Each round's costs are taken relative to the same
    round's plain decoding iteration, and each is the median of those ratios times the median
    iteration: the machine's speed drifts (its cores are shared), and a cost from a slow round set
    against a step from a fast one would mispredict their ratio, which is all a speedup depends on.
    The loop's own work is also the median over γ: one number per iteration, whatever the γ."""
    step = statistics.median(s[0].iteration_ms for s in samples)
    gammas = sorted(g for g in samples[0] if g)

    def relative(gamma: int, cost) -> float:
        return step * statistics.median(cost(s[gamma]) / s[0].iteration_ms for s in samples)

    return LoopCosts(step, {g: relative(g, lambda run: run.per_iteration("draft")) for g in gammas},
                     {g: relative(g, lambda run: run.per_iteration("verify")) for g in gammas},
                     statistics.median(relative(g, lambda run: run.overhead_ms) for g in gammas)).monotone()


# ---------------------------------------------------------------------------------------------
# plots, per-op engine profile


def save_plots(profile: GammaProfile, directory: Path) -> list[Path]:
    """speedup vs γ (predicted and measured, per batch size) and cost per iteration vs γ."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SpecCompileError("plots need matplotlib: pip install 'speccompile[profile]'") from None
    directory.mkdir(parents=True, exist_ok=True)
    speedup_png = directory / f"{profile.key}-speedup.png"
    costs_png = directory / f"{profile.key}-costs.png"
    for path, draw in ((speedup_png, _plot_speedups), (costs_png, _plot_costs)):
        fig, ax = plt.subplots(figsize=(6, 4))
        draw(ax, profile)
        ax.legend(fontsize="small")
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
    return [speedup_png, costs_png]


def _plot_speedups(ax, profile: GammaProfile) -> None:
    """At the shortest context: the others would crowd the plot (the table has them all)."""
    gammas, context = [0] + sorted(profile.gammas), min(profile.context_lengths)
    for batch in profile.batch_sizes:
        point = profile.point(batch, context)
        line = ax.plot(gammas, [point.predicted_speedup[g] for g in gammas], marker="o", label=f"batch {batch}")
        measured = [1.0] + [point.measured_speedup[g] for g in gammas[1:]]
        ax.plot(gammas, measured, marker="s", linestyle="--", color=line[0].get_color())
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xlabel="γ (draft tokens per iteration)", ylabel="speedup over plain decoding",
           title=f"speedup vs γ at context {context}: predicted (solid), measured (dashed)")


def _plot_costs(ax, profile: GammaProfile) -> None:
    batch, context, gammas = min(profile.batch_sizes), min(profile.context_lengths), sorted(profile.gammas)
    point = profile.point(batch, context)
    draft = [point.draft_ms[g] for g in gammas]
    verify = [point.verify_ms[g] for g in gammas]
    ax.bar(gammas, draft, label="γ draft steps")
    ax.bar(gammas, verify, bottom=draft, label="verification (γ+1 tokens)")
    ax.bar(gammas, [point.overhead_ms] * len(gammas), bottom=[a + b for a, b in zip(draft, verify)],
           label="the loop's own work")
    ax.axhline(point.target_step_ms, color="black", linestyle=":", label="one plain decoding iteration")
    ax.set(xlabel="γ", ylabel="ms per iteration", title=f"cost per iteration, batch {batch}, context {context}")


@dataclass(frozen=True)
class OpTime:
    """One op type's time in a graph's run: its kernels' total ms per run, and its share of all of them."""

    op: str
    ms: float
    share: float

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class GraphOps:
    """The op types that took most of one graph's time (batch and context: what its feeds had)."""

    graph: str
    batch: int
    context: int
    ops: tuple[OpTime, ...]  # by share, largest first

    def to_json(self) -> dict:
        return {"graph": self.graph, "batch": self.batch, "context": self.context,
                "ops": [op.to_json() for op in self.ops]}


def op_profiles(runtime, batch: int = 1, context: int = 32) -> list[GraphOps]:
    """The per-op profiles of what an iteration runs: the target's plain step, its verification at
    the largest γ, and the draft's step (a bundle with a draft model)."""
    graphs = [GraphId.step("target", sample=False), GraphId.verification(max(runtime.gammas), sample=False)]
    if runtime.draft is not None:
        graphs.append(GraphId.step("draft", sample=False))
    return [GraphOps(g.name, batch, context,
                     tuple(op_profile(runtime.bundle, g.name, graph_feeds(runtime.bundle, g.name, batch, context))))
            for g in graphs]


def op_profile(bundle, graph: str, feeds_for, runs: int = 5, top: int = 8) -> list[OpTime]:
    """ONNX Runtime's per-op profile of one graph: the `top` op types by share."""
    import onnxruntime as ort

    from speccompile.runtime.onnxruntime_engine import session_options, shared_thread_pool

    # a process with the shared pool must use it
    options = session_options(shared_pool=shared_thread_pool(create=False))
    options.enable_profiling = True
    # the trace goes to the temporary directory, not the caller's: a run that fails leaves nothing in the cwd
    options.profile_file_prefix = str(Path(tempfile.gettempdir()) / f"speccompile-op-profile-{os.getpid()}")
    options.log_severity_level = 3  # plain session.run copies the cache (no in-place binding): expected here
    session = ort.InferenceSession(str(bundle.graph_path(graph)), options, providers=["CPUExecutionProvider"])
    feeds = feeds_for(session)
    for _ in range(runs):
        session.run(None, feeds)
    trace = Path(session.end_profiling())
    totals: dict[str, float] = {}
    for event in json.loads(trace.read_text()):
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            op = event.get("args", {}).get("op_name", "?")
            totals[op] = totals.get(op, 0.0) + event["dur"] / 1e3 / runs
    trace.unlink(missing_ok=True)
    total = sum(totals.values()) or 1.0
    return sorted((OpTime(op, ms, ms / total) for op, ms in totals.items()), key=lambda r: -r.ms)[:top]


def graph_feeds(bundle, graph: str, batch: int = 1, context: int = 32):
    """Zero-filled feeds for a graph at a batch size and context (for per-op profiling)."""
    entry = bundle.graph(graph)

    def feeds_for(session):
        feeds = {}
        for spec in entry.inputs:
            shape = [batch if d == "batch" else (d if isinstance(d, int) else 1) for d in spec.shape]
            feeds[spec.name] = np.zeros(shape, dtype=np.dtype(spec.dtype))  # the manifest's numpy names
        feeds["past_len"] = np.full(batch, context, dtype=np.int64)
        if "token_count" in feeds:
            feeds["token_count"] = np.ones(batch, dtype=np.int64)
        if "draft_len" in feeds:  # a verification checks every draft it was given
            feeds["draft_len"] = np.full(batch, feeds["input_ids"].shape[1] - 1, dtype=np.int64)
        return feeds

    return feeds_for
