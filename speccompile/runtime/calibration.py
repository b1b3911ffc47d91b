"""Quick calibration: step costs in the loop's order, timed on a model pair's engines directly, and
the draft model's acceptance in a few iterations continuing a prompt.

What a runtime without a γ profile measures once before `gamma="auto"` can weigh γ (runtime.py),
and what the measuring tools time; `speccompile profile` measures whole loop runs instead
(profile.py). It drives the engines only, never a Runtime, so the runtime may call it.
"""

import functools
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from speccompile.core.cost_model import LoopCosts


def measure_costs(target, draft, gammas: list[int], batch: int, context: int, repeats: int = 5,
                  seed: int = 0, eagle=None, text: "Continuation | None" = None) -> LoopCosts:
    """Step costs at one batch size and context, each call finding the caches as the loop leaves
    them: per γ, the draft's γ steps (the first over two tokens) and then a verification, as an
    iteration runs them; the target's steps back to back, as plain decoding runs them. Every call
    is rolled back, so every repeat sees the same context. Medians over `repeats`, after one warm-up
    round (LoopCosts keeps them from falling as γ grows). No loop work is timed: the overhead is 0
    (`runtime.profile` measures it in loop runs).
    draft None (a draft-free bundle): iterations have no draft steps. eagle: an EAGLE-3 head, whose
    step and catch-up after a plain step are timed too (_head_calls). text (batch 1, with a draft
    model): the context is its prompt (`context` is its length), and each round's iteration at the
    largest γ is one of its iterations (Continuation): the same calls, on the draft's own tokens,
    kept as the loop keeps them instead of rolled back, so the rounds also tell what the draft's
    drafts keep, at no call more."""
    rng = _prefilled(target, draft, batch, context, seed, eagle, text.prompt if text else None)
    if text is not None:
        text.start(target)
    rounds = [_round(target, draft, gammas, batch, rng, eagle=eagle, text=text) for _ in range(repeats + 1)]
    times = {key: [r[key] for r in rounds] for key in rounds[0]}
    head = {} if eagle is None else {"head_step": _median_after_warm_up(times["head"], 0),
                                     "head_catch_up": _median_after_warm_up(times["head"], 1)}
    return LoopCosts(_median_after_warm_up(times["target"], 0), {g: _median_after_warm_up(times[g], 0) for g in gammas},
                     {g: _median_after_warm_up(times[g], 1) for g in gammas}, **head).monotone()


# Where no γ profile measured the draft model's acceptance, the policy first judges it by the
# calibration's iterations continuing this prompt (prose, then code). Without them its prior was a
# guess (0.5 at the first position, halving) worth two iterations, under which, at a low-bit
# target's costs, the first probe's result decided alone: on the 1.1B int8 pair whose draft agrees
# 93 times in 100, a first probe that kept 2 of 4 drafts (where the text began) left it decoding
# plainly for the next 13 steps of a 64-token request.
ACCEPTANCE_PROMPT = ("Speculative decoding makes a large language model generate faster: a small draft model "
                     "proposes a few tokens, and the large model checks them all in one pass.\n\n"
                     "def moving_average(values, window):\n"
                     '    """The mean of each run of `window` consecutive values."""\n')


@dataclass
class Continuation:
    """Greedy speculative iterations continuing `prompt` (at least two tokens) in slot 0, run as
    the loop runs them: the draft one token behind the target, its first step over the last token
    kept and the target's token after it, both caches keeping what was accepted. Each continues the
    target's own text, so what it kept is what a request continuing the prompt would keep. `kept`:
    the drafts each iteration kept."""

    prompt: list[int]
    kept: list[int] = field(default_factory=list)
    _last: int = field(default=0, init=False, repr=False)  # the last token kept, which the draft reads next
    _correction: int = field(default=0, init=False, repr=False)  # the target's token after it

    def start(self, target) -> None:
        """With the prompt in both caches (the draft's one token behind): the target's token after it,
        by stepping over the prompt's last token again."""
        target.cache_lengths[0] = len(self.prompt) - 1
        self._last = self.prompt[-1]
        self._correction = int(target.forward(np.array([self.prompt[-1:]]), np.ones(1, dtype=np.int64))[0])

    def iterate(self, target, draft, gamma: int) -> tuple[float, float]:
        """One iteration at γ: (draft ms, verification ms), as _iteration times them."""
        behind = int(draft.cache_lengths[0])
        start = time.perf_counter()
        drafts = [int(draft.forward(np.array([[self._last, self._correction]]), np.array([2]))[0])]
        while len(drafts) < gamma:
            drafts.append(int(draft.forward(np.array([drafts[-1:]]), np.ones(1, dtype=np.int64))[0]))
        drafted = time.perf_counter()
        accepted, next_token = target.verify(np.array([[self._correction, *drafts]]), np.array([gamma]))
        verified = time.perf_counter()
        kept = int(accepted[0])
        self.kept.append(kept)
        # the draft holds everything before the last token kept: its next first step reads it and the correction
        draft.cache_lengths[0] = behind + 1 + kept
        self._last, self._correction = (drafts[kept - 1] if kept else self._correction), int(next_token[0])
        return (drafted - start) * 1e3, (verified - drafted) * 1e3


def measure_acceptance(target, draft, prompt: list[int], gamma: int, iterations: int) -> list[int]:
    """The drafts kept in each of `iterations` iterations at γ continuing `prompt` (Continuation),
    nothing timed."""
    text = Continuation(prompt)
    _prefilled(target, draft, 1, len(prompt), 0, prompt=prompt)
    text.start(target)
    for _ in range(iterations):
        text.iterate(target, draft, gamma)
    return text.kept


# From this size of target weights up, load() does not warm up (Runtime.warm_up): a first run's own
# cost (buffers allocated, threads started) is small beside its compute, and warming costs the start
# the compute. 1.1B int8 target (1.4 GB), 2 cores: load() 5.5 s with warm-up, 2.7 s without; the first
# token of an 8-token prompt after it 0.27 s and 0.28 s (`python -m tools.measure load`). On the demo
# pair (16 MB) the warm-up is what keeps a first request's TTFT near a later one's (Runtime.warm_up).
WARM_UP_MAX_BYTES = 256 << 20


def first_runs_matter(target) -> bool:
    """Whether the model's first runs cost noticeably more than later ones (see WARM_UP_MAX_BYTES)."""
    return target.weight_bytes < WARM_UP_MAX_BYTES


def warm_up(target, draft, gammas: list[int], batch: int, context: int = 8, seed: int = 0) -> None:
    """One call of every graph a plain step and each γ's speculative iteration run at this batch
    size, on random tokens, every call rolled back: ONNX Runtime's first run of a session (its
    buffers allocated, its threads started) happens here instead of in a request."""
    _round(target, draft, gammas, batch, _prefilled(target, draft, batch, context, seed), target_steps=1)


def _prefilled(target, draft, batch: int, context: int, seed: int, eagle=None, prompt: list[int] | None = None):
    """The engines' caches hold `context` tokens per row (the prompt's, or random ones), as the loop
    leaves them (the draft one token behind: its first step re-reads the last; the head has read the
    target's features of every position but the last, each with the token after it); the random
    generator the rounds draw their tokens from."""
    rng = np.random.default_rng(seed)
    for engine in (e for e in (target, draft) if e is not None):
        engine.start(batch)
        tokens = rng.integers(0, engine.vocab_size, (batch, context)) if prompt is None else \
            np.tile(np.asarray(prompt, dtype=np.int64), (batch, 1))
        engine.forward(tokens, np.full(batch, context, dtype=np.int64))
        if engine is target and eagle is not None:
            eagle.start(batch)
            eagle.catch_up(tokens[:, 1:], target.last_aux_hidden[:, : context - 1],
                           np.full(batch, context - 1, dtype=np.int64))
    if draft is not None:
        draft.cache_lengths[:batch] -= 1
    return rng


def _round(target, draft, gammas: list[int], batch: int, rng, target_steps: int = 3, eagle=None,
           text: Continuation | None = None) -> dict:
    """One round, every call rolled back: per γ, (draft ms, verification ms) of an iteration;
    "target": (ms of the last of `target_steps` plain steps,); with a head, "head": (ms of one of its
    steps, ms of its catch-up after a plain step). text: the largest γ's iteration is its next one, kept."""
    engines = (target, draft, eagle)
    times = {g: _rolled_back(engines, lambda g=g: _iteration(target, draft, batch, g, rng)) for g in gammas
             if text is None or g != max(gammas)}
    if text is not None:
        times[max(gammas)] = text.iterate(target, draft, max(gammas))
    times["target"] = _rolled_back(engines, lambda: _target_steps(target, batch, rng, target_steps))
    if eagle is not None:
        times["head"] = _rolled_back(engines, lambda: _head_calls(target, eagle, batch, rng, max(gammas) - 1))
    return times


def _median_after_warm_up(rounds: list[tuple], i: int) -> float:
    return statistics.median(r[i] for r in rounds[1:])


def _rolled_back(engines, call):
    engines = [e for e in engines if e is not None]
    lengths = [e.cache_lengths.copy() for e in engines]
    result = call()
    for engine, length in zip(engines, lengths):
        engine.cache_lengths = length
    return result


def _iteration(target, draft, batch: int, gamma: int, rng) -> tuple[float, float]:
    """(draft ms, verification ms) of one speculative iteration on random tokens (no draft: 0 ms of it)."""
    start = time.perf_counter()
    if draft is not None:
        token = draft.forward(rng.integers(0, draft.vocab_size, (batch, 2)), np.full(batch, 2))
        for _ in range(gamma - 1):
            token = draft.forward(token[:, None], np.ones(batch, dtype=np.int64))
    drafted = time.perf_counter()
    tokens = rng.integers(0, target.vocab_size, (batch, gamma + 1))
    target.verify(tokens, np.full(batch, gamma, dtype=np.int64))
    return (drafted - start) * 1e3, (time.perf_counter() - drafted) * 1e3


def _target_steps(target, batch: int, rng, steps: int = 3) -> tuple[float]:
    """ms of the last of `steps` plain decoding steps in a row (the first finds the draft's traces)."""
    token = rng.integers(0, target.vocab_size, (batch, 1))
    for _ in range(steps):
        start = time.perf_counter()
        token = target.forward(token, np.ones(batch, dtype=np.int64))[:, None]
    return ((time.perf_counter() - start) * 1e3,)


def _head_calls(target, eagle, batch: int, rng, steps: int) -> tuple[float, float]:
    """(ms of one head step, ms of its catch-up) as the loop runs them: a plain target step, the
    head's catch-up of the position it cached (what follows every plain step; a verification's
    reads a few positions more in the same call), then `steps` head steps (at least one) fed back,
    as an iteration's drafts after the first are."""
    one = np.ones(batch, dtype=np.int64)
    token = target.forward(rng.integers(0, target.vocab_size, (batch, 1)), one)
    features = target.last_aux_hidden
    start = time.perf_counter()
    token, _, hidden = eagle.catch_up(np.asarray(token, dtype=np.int64)[:, None], features[:, :1], one)
    caught = time.perf_counter()
    steps = max(1, steps)
    for _ in range(steps):
        token, _, hidden = eagle.step(token[:, None], hidden[:, None, :])
    return (time.perf_counter() - caught) * 1e3 / steps, (caught - start) * 1e3


def measure_tree_costs(target, trees: dict, batch: int, context: int, repeats: int = 5, seed: int = 0) -> dict:
    """ms of one token-tree verification (Medusa heads included) per tree size, {nodes: TokenTree},
    on random tokens at this batch size and context, every call rolled back. Medians after a warm-up."""
    rng = np.random.default_rng(seed)
    target.start(batch)
    target.forward(rng.integers(0, target.vocab_size, (batch, context)), np.full(batch, context, dtype=np.int64))
    times = {size: [] for size in trees}
    for _ in range(repeats + 1):
        for size, tree in trees.items():
            tokens = rng.integers(0, target.vocab_size, (batch, tree.size))
            draft_len = np.full(batch, tree.size - 1, dtype=np.int64)
            call = functools.partial(_timed, target.verify_tree, tokens, draft_len, tree)
            times[size].append(_rolled_back((target,), call))
    return {size: statistics.median(t[1:]) for size, t in times.items()}


def _timed(call, *args) -> float:
    start = time.perf_counter()
    call(*args)
    return (time.perf_counter() - start) * 1e3
