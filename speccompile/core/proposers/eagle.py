"""EAGLE-3: a one-layer head drafts from the target's own hidden states (speccompile/eagle_head.py).

The target's graphs also return its features (the residual stream entering three of its layers) at
every position they cache. The head's position t reads the features of the target's position t with
the token at t + 1, and its output there predicts the token at t + 2; from its second draft on, it
reads its own output in place of the target's features.

Per request (`EagleDraft`): how often its drafts were kept per position, as for the draft model.

Shared (`EagleRunner`): the head's one-layer cache, kept in step with the target's slots. Invariant
between iterations, for a row in step: the head has read the target's features of every position the
target has cached, each with the token after it, so its last output is already the row's first draft
(`pending`): an iteration of k drafts costs k - 1 head steps. After every target call the runner rolls
the head back to where the target was before it (what it read past there came from its own drafts)
and reads the call's features of the positions the target kept. A row whose features the target did
not return (a prompt scored for echo) falls out of step and gets no drafts.
"""

import time

import numpy as np

from speccompile.core.gamma_policy import Acceptance, GammaPolicy
from speccompile.core.proposers.base import Offer, Proposer

# What a request believes of the head until it has its own (EAGLE-3's published acceptance is higher
# than a small draft model's; a prior only orders the first iterations of `auto`)
EAGLE_PRIOR, EAGLE_PRIOR_WEIGHT = 0.7, 2.0


class EagleRunner:
    """Runs the EAGLE-3 head for the rows of a plan whose proposer drafts with it. `engine` runs the
    head's graphs: `catch_up(tokens, features, counts, first)` reads target features with the tokens
    after them, `step(tokens, hidden, first)` reads its own output; both return (next_token [B],
    confidence [B], hidden [B, H]) after each row's last position, and advance `cache_lengths`."""

    reads_target_features = True  # the scheduler hands it every target call's features (after_target)

    def __init__(self, engine, max_seq: int):
        self.engine, self.max_seq = engine, max_seq
        self.steps, self.catch_up_ms = 0, 0.0
        self.read_ms = 0.0  # the last after_target's head call: the loop's work, not the drafts'
        self.pending = np.zeros(0, dtype=np.int64)  # per slot: the first draft, read at the last catch-up
        self.confidence = np.zeros(0, dtype=np.float32)
        self.hidden: np.ndarray | None = None  # per slot [H]: the head's output there, fed back by the next step
        self.in_step = np.zeros(0, dtype=bool)  # per slot: the head has read every position the target cached

    def start(self, slots: int) -> None:
        self.engine.start(slots)
        self.pending = np.zeros(slots, dtype=np.int64)
        self.confidence = np.zeros(slots, dtype=np.float32)
        self.hidden = None
        self.in_step = np.zeros(slots, dtype=bool)

    def admit(self, slot: int) -> None:
        self.engine.cache_lengths[slot] = 0
        self.in_step[slot] = False  # until a catch-up has read its first position

    def prefill(self, request, tokens: np.ndarray, counts: np.ndarray, slot: int, complete: bool,
                feed: bool = True) -> None:
        """Nothing before the target: a prompt chunk's features come with the target's call (after_target)."""
        if request.prefilled == 0:
            self.in_step[slot] = True

    def move(self, source: int, destination: int) -> None:
        self.engine.move(source, destination)
        states = (self.pending, self.confidence, self.in_step) + ((self.hidden,) if self.hidden is not None else ())
        for state in states:
            state[destination] = state[source]

    def share(self, source: int, destination: int, length: int) -> None:
        """Slot `destination` starts with what `source` read of its first `length` positions (a shared
        prompt); the target prefills the rest of it, whose features it then reads."""
        self.move(source, destination)
        self.engine.cache_lengths[destination] = min(self.engine.cache_lengths[destination], length)

    def after_verify(self, rows: list) -> None:
        """Nothing: after_target has read the verification's features."""

    def after_target(self, rows: list, first: int, before: np.ndarray, after: np.ndarray,
                     features: np.ndarray | None) -> None:
        """A target call over slots first.. has cached row b's positions before[b]..after[b] - 1 and
        returned their features [B, T, F] (None: it returned none): roll the head back to before[b] and
        read each position t with the token at t + 1, as far as the request has tokens. A row the head
        was behind, or whose features did not come, falls out of step."""
        slots = np.arange(first, first + len(rows))
        lengths = self.engine.cache_lengths
        if features is None:
            self.in_step[slots] = False
            return
        self.in_step[slots] &= lengths[slots] >= before
        known = np.array([len(r.tokens) - 1 for r in rows], dtype=np.int64)
        counts = np.where(self.in_step[slots], np.maximum(np.minimum(after, known) - before, 0), 0)
        if not counts.any():
            return
        lengths[slots] = np.where(self.in_step[slots], before, lengths[slots])
        width = int(counts.max())
        tokens = np.zeros((len(rows), width), dtype=np.int64)
        for b, request in enumerate(rows):
            tokens[b, : counts[b]] = request.tokens[before[b] + 1 : before[b] + 1 + counts[b]]
        began = time.perf_counter()
        token, confidence, hidden = self.engine.catch_up(tokens, features[:, :width], counts, first=first)
        self.read_ms = (time.perf_counter() - began) * 1e3
        read = counts > 0
        if self.hidden is None:
            self.hidden = np.zeros((len(self.pending), hidden.shape[-1]), dtype=np.float32)
        self.pending[slots[read]], self.confidence[slots[read]], self.hidden[slots[read]] = \
            token[read], confidence[read], hidden[read]
        self.in_step[slots[counts < after - before]] = False  # tokens it could not read yet: behind

    def draft(self, rows: list, offers: list[Offer], drafts: np.ndarray, proposed: np.ndarray,
              sampling: bool) -> np.ndarray | None:
        """Draft for the rows whose offer is this runner's (greedy ones: a sampled request is offered
        none; their drafts are point proposals, which the verification of a mixed batch handles
        exactly): the pending first draft, then
        max(drafts) - 1 batched head steps over every row, each feeding back the head's output and
        the draft before. A row stops drafting at a draft whose confidence is below its p_min. Writes
        drafts into proposed and counts into drafts."""
        mine = np.array([offer.source.runner is self for offer in offers])
        slots = np.arange(len(rows))
        drafts[mine & ~self.in_step[slots]] = 0
        self.steps, self.catch_up_ms = 0, 0.0  # its catch-up runs with the target's calls (after_target)
        steps = max((int(d) for d, m in zip(drafts, mine) if m), default=0)
        if steps == 0 or self.hidden is None:
            drafts[mine] = 0
            return None
        p_min = np.array([offer.source.p_min if m else 0.0 for offer, m in zip(offers, mine)], dtype=np.float32)
        token, confidence, hidden = self.pending[slots], self.confidence[slots], self.hidden[slots]
        for k in range(steps):
            drafting = mine & (k < drafts)
            unsure = drafting & (confidence < p_min)
            drafts[unsure] = k
            drafting &= ~unsure
            proposed[drafting, k] = token[drafting]
            if not (drafting & (k + 1 < drafts)).any():
                break
            token, confidence, hidden = self.engine.step(token[:, None], hidden[:, None, :], first=0)
            self.steps += 1
        return None


class EagleDraft(Proposer):
    name = "eagle"
    runs_model = True

    def __init__(self, runner: EagleRunner, p_min: float = 0.0):
        self.runner, self.p_min = runner, p_min
        self.acceptance = Acceptance([EAGLE_PRIOR], EAGLE_PRIOR_WEIGHT)

    def offer(self, request, wanted: int, cap: int, policy: GammaPolicy | None) -> Offer:
        """`wanted` drafts (none for a sampled request: the head drafts greedily, and exact chain
        sampling needs its distribution, which its graphs do not return yet), expected to be kept as
        this request's drafts were."""
        count = wanted if request.params.greedy else 0
        return Offer(count, self, None, lambda: self.acceptance.by_position(count))

    def observe(self, stats, offer: Offer, drafts: int, accepted: int) -> None:
        stats.record_iteration(accepted, drafts, self.name)
        if drafts:
            self.acceptance.observe(drafts, accepted)
