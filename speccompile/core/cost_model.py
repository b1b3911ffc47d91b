"""The speculative speedup model (Leviathan et al. 2023, §3), with costs as the loop incurs them.

Per iteration the draft runs γ steps and the target one verification of γ+1 tokens; the iteration
emits the accepted drafts plus one target token. With P_k the probability that draft k is accepted
(k = 1..γ; unconditional, so P_1 >= P_2 >= ...):

    E[tokens per iteration] = 1 + sum_k P_k                    (= (1 - α^(γ+1)) / (1 - α) for i.i.d. α)
    time per iteration      = t_draft(γ) + t_verify(γ) + t_overhead
    speedup                 = E · t_target / time per iteration

where t_target is one iteration of plain decoding (a target step). The paper assumes t_verify(γ) =
t_target ("free parallel verification") and t_draft(γ) = γ · one draft step; here both are measured
per γ, which is what makes γ hardware-specific. The draft's time is not quite proportional to γ:
its first step of an iteration reads two tokens (the loop's draft re-reads the token before the
last one), so a short γ pays more per draft token (demo pair, batch 1, in the loop: 0.76 ms per
draft token at γ=2, 0.54 at γ=6).
"""

from dataclasses import dataclass, replace

DRAFT, EAGLE = "draft", "eagle"  # whose steps a proposer's drafts cost: the draft model's, or the EAGLE-3 head's


def expected_tokens(acceptance_by_position: list[float]) -> float:
    """E[tokens emitted per iteration] from per-position (unconditional) acceptance."""
    return 1.0 + sum(acceptance_by_position)


def tokens_per_ms(costs: "LoopCosts | None", acceptance_by_position: list[float], drafts: int,
                  draft_steps: bool | str | None = True) -> float:
    """Expected tokens per millisecond of one iteration with `drafts` proposals, (1 + Σ P_k) over
    its time: verified by the smallest γ verified at that holds them, with the steps of the model that
    drafts them (draft_steps: "draft" or True the draft model's, "eagle" the EAGLE-3 head's; False or
    None none: a lookup costs no model time). 0 drafts is a plain step. Without costs, expected tokens
    per iteration. The one rate every choice between proposers and trees compares."""
    tokens = expected_tokens(acceptance_by_position[:drafts])
    if costs is None:
        return tokens
    if drafts == 0:
        return 1.0 / costs.plain_ms
    gamma = costs.graph_for(drafts)
    return rate(tokens, costs.iteration_ms(gamma, drafts, step_cost(draft_steps)))


def step_cost(draft_steps: bool | str | None) -> str | None:
    """The kind of model step drafts cost (LoopCosts.iteration_ms) from tokens_per_ms' draft_steps."""
    if draft_steps is True:
        return DRAFT
    return draft_steps or None


def nondecreasing(by_gamma: dict[int, float]) -> dict[int, float]:
    """The closest costs (least squares) that never fall as γ grows: neighbouring γ whose measured
    order says otherwise share their mean (pool adjacent violators). A longer γ does more work; a
    calibration that says otherwise measured noise (demo pair, 3 repeats on 2 cores: verify[4] 6.24
    ms under verify[2]'s 6.40), and a policy steered by it chose γ by the noise."""
    blocks: list[list] = []  # [sum, count, γs], means nondecreasing
    for gamma in sorted(by_gamma):
        blocks.append([by_gamma[gamma], 1, [gamma]])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count, gammas = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
            blocks[-1][2] += gammas
    return {gamma: total / count for total, count, gammas in blocks for gamma in gammas}


def rate(tokens: float, ms: float) -> float:
    """Tokens per millisecond."""
    return tokens / ms


def between(low: float, high: float, weight: float) -> float:
    """`weight` of the way from low to high: costs between two measured batch sizes are linear."""
    return (1 - weight) * low + weight * high


def iid_acceptance_by_position(alpha: float, gamma: int) -> list[float]:
    """P_k = α^k: the paper's i.i.d. acceptance assumption."""
    return [alpha**k for k in range(1, gamma + 1)]


def predicted_speedup(acceptance_by_position: list[float], t_target: float, t_draft: float, t_verify: float,
                      t_overhead: float = 0.0) -> float:
    """The speedup of γ = len(acceptance_by_position), t_draft one draft step (γ·t_draft per iteration)."""
    gamma = len(acceptance_by_position)
    if gamma == 0:
        return 1.0
    return predicted_speedup_mixed(acceptance_by_position, {gamma: 1}, t_target, t_draft, t_verify, t_overhead)


def predicted_speedup_mixed(acceptance_by_position: list[float], gammas_used: dict[int, int], t_target: float,
                            t_draft: float, t_verify: float, t_overhead: float = 0.0) -> float:
    """The speedup of iterations run at several γ (gammas_used: γ -> iterations, as γ = auto runs),
    with t_verify the mean verification time of those that drafted: expected tokens and time per
    iteration, each averaged over the mix; γ 0 (plain decoding chosen) costs a plain step, t_target.
    One γ gives predicted_speedup.

    With P_k measured over the iterations that proposed draft k (GenerationStats.acceptance_by_position),
    the mix's expected tokens per iteration equal the measured mean acceptance length:
    sum_γ n_γ (1 + sum_{k<=γ} P_k) = N + sum_k P_k · drafted_k = N + accepted.
    """
    iterations = sum(gammas_used.values())
    if iterations == 0:
        return 1.0
    tokens = sum(n * expected_tokens(acceptance_by_position[:g]) for g, n in gammas_used.items()) / iterations
    mean_gamma = sum(g * n for g, n in gammas_used.items()) / iterations
    drafting = sum(n for g, n in gammas_used.items() if g) / iterations
    iteration = mean_gamma * t_draft + drafting * (t_verify + t_overhead) + (1 - drafting) * t_target
    assert iteration > 0, "iteration time must be positive"
    return tokens * t_target / iteration


def predicted_end_to_end_speedup(plain_ms_per_token: float, plain_decode_ms_per_token: float,
                                 spec_prefill_ms_per_token: float, decode_speedup: float) -> float:
    """The speedup of whole requests, as a user times them, per generated token: plain decoding's
    measured time (`plain_ms_per_token`, of which `plain_decode_ms_per_token` in target steps)
    against the speculative runs' prefill (a draft's included) plus the same decoding at
    `decode_speedup` (predicted_speedup_mixed, with the loop's overhead). Prefill and a plain step's
    own overhead are not sped up: on the 1.1B pair's 64-token requests they held the measured
    speedup 12-17% below the decode-only prediction."""
    if plain_decode_ms_per_token <= 0 or decode_speedup <= 0:
        return 1.0
    return plain_ms_per_token / (spec_prefill_ms_per_token + plain_decode_ms_per_token / decode_speedup)


# ---------------------------------------------------------------------------------------------
# one batch size's costs, as a profile or a quick calibration gives them


@dataclass
class LoopCosts:
    """Milliseconds per iteration at one batch size (runtime/profile.py measures them).

    target_step: one plain-decoding iteration's target call. draft[γ]: an iteration's γ draft
    steps. verify[γ]: its verification (as measured or recorded, kept from falling as γ grows:
    `monotone`).
    overhead: the rest of a speculative iteration (proposing, emitting, rollback, choosing γ);
    plain_overhead: the rest of a plain one.

    An EAGLE-3 head (0 without one): head_step, one of its batched steps; head_catch_up, its
    catch-up over the positions the target kept since it last drafted, which gives its first draft.
    The catch-up runs only in an iteration that drafts with the head (a row decoding plainly keeps
    its features for later: proposers/eagle.py), so it is the first draft's cost, and a plain step
    costs what it costs on a bundle without a head.
    """

    target_step: float
    draft: dict[int, float]
    verify: dict[int, float]
    overhead: float = 0.0
    plain_overhead: float = 0.0
    head_step: float = 0.0
    head_catch_up: float = 0.0

    @property
    def plain_ms(self) -> float:
        """One iteration of plain decoding, what every speedup is measured against."""
        return self.target_step + self.plain_overhead

    @classmethod
    def from_timings(cls, timings: dict) -> "LoopCosts":
        """From the timings dict of GammaProfile.timings or measure_costs. Without a per-γ
        "draft_ms", drafting costs γ · draft_step_ms; without "overhead_ms", nothing. Monotone (a
        record may predate that rule)."""
        verify = {int(g): ms for g, ms in timings["verify_ms"].items()}
        per_gamma = {int(g): ms for g, ms in timings.get("draft_ms", {}).items()}
        draft = {g: per_gamma.get(g, g * timings["draft_step_ms"]) for g in verify}
        return cls(timings["target_step_ms"], draft, verify, timings.get("overhead_ms", 0.0),
                   head_step=timings.get("head_step_ms", 0.0),
                   head_catch_up=timings.get("head_catch_up_ms", 0.0)).monotone()

    def monotone(self) -> "LoopCosts":
        """These costs with draft and verification costs that never fall as γ grows (`nondecreasing`):
        what every measurement (calibration, profile) and every record read back gives the policy."""
        return replace(self, draft=nondecreasing(self.draft), verify=nondecreasing(self.verify))

    def timings(self) -> dict:
        """As a γ profile stores them (JSON): from_timings' input, draft_step_ms included (the head's
        costs only where there is one)."""
        head = {"head_step_ms": self.head_step, "head_catch_up_ms": self.head_catch_up} if self.has_head else {}
        return {"target_step_ms": self.target_step, "draft_step_ms": self.draft_step, "draft_ms": dict(self.draft),
                "verify_ms": dict(self.verify), "overhead_ms": self.overhead, **head}

    @property
    def has_head(self) -> bool:
        """Whether an EAGLE-3 head's costs were measured."""
        return self.head_step > 0 or self.head_catch_up > 0

    @property
    def draft_step(self) -> float:
        """One draft step, averaged over every γ's drafting."""
        return sum(self.draft.values()) / sum(self.draft) if self.draft else 0.0

    @property
    def gammas(self) -> list[int]:
        return sorted(self.verify)

    def filled(self, gammas: list[int]) -> "LoopCosts":
        """These costs at every γ of `gammas`, each not timed here linearly between the nearest timed
        γ below and above it (the nearest one beyond the timed range). On one session graph every γ
        is the same call at another width, and its cost grows with the width evenly enough for this
        (1.1B int4 target, 2 cores, a decode step's multiples timed: 1.03, 1.61, 2.05, 2.64 at γ = 1..4;
        linear from γ=1 and 4: 1.57 and 2.10): the calibration times the ends, not every γ."""
        timed = self.gammas

        def at(by_gamma: dict[int, float], gamma: int) -> float:
            below = max((g for g in timed if g <= gamma), default=timed[0])
            above = min((g for g in timed if g >= gamma), default=timed[-1])
            if below == above:
                return by_gamma[below]
            return between(by_gamma[below], by_gamma[above], (gamma - below) / (above - below))

        return replace(self, draft={g: at(self.draft, g) for g in gammas},
                       verify={g: at(self.verify, g) for g in gammas})

    def graph_for(self, drafts: int) -> int:
        """The smallest γ priced here that holds `drafts` (the largest when none does)."""
        return min((g for g in self.gammas if g >= drafts), default=max(self.gammas))

    def mix(self, other: "LoopCosts", weight: float) -> "LoopCosts":
        """Costs `weight` of the way from these to `other`: linear between two measured batch sizes."""
        w = weight
        return LoopCosts(between(self.target_step, other.target_step, w),
                         {g: between(self.draft[g], other.draft[g], w) for g in self.draft},
                         {g: between(self.verify[g], other.verify[g], w) for g in self.verify},
                         between(self.overhead, other.overhead, w),
                         between(self.plain_overhead, other.plain_overhead, w),
                         between(self.head_step, other.head_step, w),
                         between(self.head_catch_up, other.head_catch_up, w))

    def at_batch(self, batch: int) -> "LoopCosts":
        """These batch-1 costs carried to `batch` rows, as a prior for the loop to correct: a target
        call's time as a line in the tokens it scores, fitted to the plain step (1 token) and each
        verification (γ + 1); the draft's and the head's steps grown as the target's plain step grows. On the demo
        pair (2 cores) it put batch 8's verifications at 2.4x its plain step, as measured, but every
        call at about 0.7x its measured time: the loop's own measurements set the level (GammaPolicy)."""
        if batch == 1:
            return self
        points = [(1, self.target_step)] + [(g + 1, ms) for g, ms in self.verify.items()]
        slope, intercept = _line(points)
        call = lambda tokens: intercept + slope * tokens  # noqa: E731
        growth = call(batch) / call(1)
        return LoopCosts(call(batch), {g: ms * growth for g, ms in self.draft.items()},
                         {g: call(batch * (g + 1)) for g in self.verify}, self.overhead, self.plain_overhead,
                         self.head_step * growth, self.head_catch_up * growth)

    def verification_line(self) -> tuple[float, float]:
        """(ms per token, fixed ms) of one row's verification as a line in the positions it scores,
        through each compiled γ's (γ + 1) and, with one γ only, the plain step (1): a prior for what
        a token tree of any size costs to verify. (A plain step's graph costs less than any
        verification's, so it would steepen the line.)"""
        points = [(g + 1, ms) for g, ms in self.verify.items()]
        return _line(points if len(points) > 1 else [(1, self.target_step)] + points)

    def scaled(self, target: float, draft: float, overhead: float, plain_overhead: float,
               head: float = 1.0) -> "LoopCosts":
        """Every target call's time times `target`, every draft step's times `draft`, every head step's
        times `head` (its catch-up's too), and the loop's own work per iteration replaced (what
        GammaPolicy has measured)."""
        return LoopCosts(self.target_step * target, {g: ms * draft for g, ms in self.draft.items()},
                         {g: ms * target for g, ms in self.verify.items()}, overhead, plain_overhead,
                         self.head_step * head, self.head_catch_up * head)

    def draft_ms(self, gamma: int, drafts: int, steps: str | None = DRAFT) -> float:
        """What `drafts` drafts cost in an iteration verified at γ: draft-model steps ("draft"), the
        EAGLE-3 head's ("eagle": a catch-up gives the first draft, then drafts - 1 steps), or nothing
        (None: a lookup's proposal costs no model time)."""
        if steps == EAGLE:
            return self.head_catch_up + self.head_step * (drafts - 1) if drafts else 0.0
        return self.draft[gamma] * drafts / gamma if steps == DRAFT else 0.0

    def calls_ms(self, gamma: int, calls: int, steps: str = DRAFT) -> float:
        """`calls` calls of `steps`' model (cost_model.DRAFT, EAGLE) in an iteration verified at γ (the
        head's first call of an iteration is its catch-up)."""
        if steps == EAGLE:
            return self.draft_ms(gamma, calls, EAGLE)
        return calls * self.draft.get(gamma, 0.0) / gamma if gamma else 0.0

    def iteration_ms(self, gamma: int, drafts: int | None = None, steps: str | None = DRAFT) -> float:
        """One speculative iteration verified at γ, with `drafts` drafts (default γ) costing `steps`'
        model steps (draft_ms)."""
        drafts = gamma if drafts is None else drafts
        return self.draft_ms(gamma, drafts, steps) + self.verify[gamma] + self.overhead

    def speedup(self, acceptance_by_position: list[float], gamma: int) -> float:
        """Predicted speedup of γ over plain decoding (γ = 0 is plain decoding: 1)."""
        if gamma == 0:
            return 1.0
        tokens = expected_tokens(acceptance_by_position[:gamma])
        return rate(tokens, self.iteration_ms(gamma)) * self.plain_ms


def _line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through (x, y) points; the slope at least 0 and
    the intercept at least half the smallest y (a call's fixed cost), so extrapolations stay sane."""
    xs, ys = [x for x, _ in points], [y for _, y in points]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / spread) if spread else 0.0
    intercept = max(mean_y - slope * mean_x, 0.5 * min(ys))
    return slope, intercept
