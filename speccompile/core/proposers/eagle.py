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

Sampled requests (a head built with its sampled graphs): each draft is drawn from the head's
distribution after the request's temperature, top-k and top-p, which is returned with it (q, for the
rejection rule's test), or by Gumbel-max with the noise of the output position it proposes for (the
coupled rule), as the draft model draws. The first draft of an iteration is drawn at the catch-up that
read the last verification's features, so that catch-up draws it for the next output position of
every sampled row that drafts here (`pending_probs` keeps its q); the rest at the steps.
"""

import time

import numpy as np

from speccompile.core.gamma_policy import Acceptance, GammaPolicy
from speccompile.core.proposers.base import Offer, Proposer
from speccompile.core.proposers.draft_model import sampled_confidence, sampling_params
from speccompile.core.sampling import draws

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
        self.drawn = np.zeros(0, dtype=bool)  # per slot: `pending` was drawn for a sampled request (its q kept)
        self.pending_probs: np.ndarray | None = None  # per slot [V]: the distribution `pending` was drawn from

    @property
    def samples(self) -> bool:
        """Whether the head drafts for sampled requests (its bundle has the sampled graphs)."""
        return bool(getattr(self.engine, "samples_drafts", False))

    def start(self, slots: int) -> None:
        self.engine.start(slots)
        self.drawn = np.zeros(slots, dtype=bool)
        self.pending_probs = None
        self.pending = np.zeros(slots, dtype=np.int64)
        self.confidence = np.zeros(slots, dtype=np.float32)
        self.hidden = None
        self.in_step = np.zeros(slots, dtype=bool)

    def admit(self, slot: int) -> None:
        self.engine.cache_lengths[slot] = 0
        self.in_step[slot] = False  # until a catch-up has read its first position

    def prefill(self, request, tokens: np.ndarray, counts: np.ndarray, slot: int, complete: bool,
                feed: bool = True) -> None:
        """Nothing before the target: a prompt chunk's features come with the target's call (after_target).
        A request that will never draft here (plain decoding, or a proposer without the head) is never
        in step, so the head reads nothing for it."""
        if request.prefilled == 0:
            self.in_step[slot] = request.gamma != 0 and self._drafts_here(request)

    def move(self, source: int, destination: int) -> None:
        self.engine.move(source, destination)
        states = (self.pending, self.confidence, self.in_step, self.drawn) + \
            tuple(state for state in (self.hidden, self.pending_probs) if state is not None)
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
        # a sampled row's first draft is for the output position after its last token: drawn when the
        # head has read up to that token (in step), for a request that may draft here
        drawing = np.array([self.samples and not r.params.greedy and self._drafts_here(r) for r in rows]) \
            & (counts > 0) & (before + counts == known)
        read = counts > 0
        if drawing.any():
            uniform, coupled, noise = draws(rows, self.engine.vocab_size, active=drawing)
            token, probs, hidden = self.engine.catch_up_sample(tokens, features[:, :width], counts,
                                                               sampling_params(rows), uniform, coupled, noise,
                                                               first=first)
            confidence = sampled_confidence(rows, probs, token)
            if self.pending_probs is None:
                self.pending_probs = np.zeros((len(self.pending), probs.shape[-1]), dtype=np.float32)
            self.pending_probs[slots[drawing]] = probs[drawing]
        else:
            token, confidence, hidden = self.engine.catch_up(tokens, features[:, :width], counts, first=first)
        self.read_ms = (time.perf_counter() - began) * 1e3
        self.drawn[slots[read]] = drawing[read]
        if self.hidden is None:
            self.hidden = np.zeros((len(self.pending), hidden.shape[-1]), dtype=np.float32)
        self.pending[slots[read]], self.confidence[slots[read]], self.hidden[slots[read]] = \
            token[read], confidence[read], hidden[read]
        self.in_step[slots[counts < after - before]] = False  # tokens it could not read yet: behind

    def draft(self, rows: list, offers: list[Offer], drafts: np.ndarray, proposed: np.ndarray,
              sampling: bool) -> np.ndarray | None:
        """Draft for the rows whose offer is this runner's: the pending first draft, then
        max(drafts) - 1 batched head steps over every row, each feeding back the head's output and
        the draft before. A row stops drafting at a draft whose confidence is below its p_min. Writes
        drafts into proposed and counts into drafts; returns, when a sampled row drafts here, the
        distributions [B, steps, V] its rows drew from (a greedy row's: a point mass on its draft)."""
        mine = np.array([offer.source.runner is self for offer in offers])
        slots = np.arange(len(rows))
        drafts[mine & ~self.in_step[slots]] = 0
        sampled = mine & np.array([not r.params.greedy for r in rows])
        drafts[sampled & ~self.drawn[slots]] = 0  # its pending draft was not drawn for it: none to verify
        self.steps, self.catch_up_ms = 0, 0.0  # its catch-up runs with the target's calls (after_target)
        steps = max((int(d) for d, m in zip(drafts, mine) if m), default=0)
        if steps == 0 or self.hidden is None:
            drafts[mine] = 0
            return None
        p_min = np.array([offer.source.p_min if m else 0.0 for offer, m in zip(offers, mine)], dtype=np.float32)
        token, confidence, hidden = self.pending[slots], self.confidence[slots], self.hidden[slots]
        drawing = sampling and bool((sampled & (drafts > 0)).any())
        params = sampling_params(rows) if drawing else None
        probs_out = [self.pending_probs[slots]] if drawing else []
        for k in range(steps):
            drafting = mine & (k < drafts)
            unsure = drafting & (confidence < p_min)
            drafts[unsure] = k
            drafting &= ~unsure
            proposed[drafting, k] = token[drafting]
            going_on = drafting & (k + 1 < drafts)
            if not going_on.any():
                break
            if drawing:  # draft k + 1 is for the output position k + 1 after each row's last token
                uniform, coupled, noise = draws(rows, self.engine.vocab_size, offset=k + 1, active=going_on & sampled)
                token, probs, hidden = self.engine.step_sample(token[:, None], hidden[:, None, :], params, uniform,
                                                               coupled, noise, first=0)
                confidence = sampled_confidence(rows, probs, token)
                probs_out.append(probs)
            else:
                token, confidence, hidden = self.engine.step(token[:, None], hidden[:, None, :], first=0)
            self.steps += 1
        if not drawing:
            return None
        q = np.stack(probs_out, axis=1)
        for row in np.flatnonzero(mine & ~sampled):  # a greedy row's draft is no draw: a point mass
            count = min(int(drafts[row]), q.shape[1])
            q[row] = 0.0
            q[row, np.arange(count), proposed[row, :count]] = 1.0
        return q

    def _drafts_here(self, request) -> bool:
        """Whether the request's proposer may offer this runner's drafts (itself, or a member of auto's):
        only their random streams pay for a draw at the catch-up."""
        proposer = request.proposer
        return any(getattr(p, "runner", None) is self for p in (proposer, *getattr(proposer, "members", ())))


class EagleDraft(Proposer):
    name = "eagle"
    runs_model = True
    step_cost = "eagle"  # cost_model.EAGLE: head steps, the first draft free (it came with the catch-up)

    def __init__(self, runner: EagleRunner, p_min: float = 0.0):
        self.runner, self.p_min = runner, p_min
        self.acceptance = Acceptance([EAGLE_PRIOR], EAGLE_PRIOR_WEIGHT)

    def offer(self, request, wanted: int, cap: int, policy: GammaPolicy | None) -> Offer:
        """`wanted` drafts (for a sampled request, where the head has its sampled graphs: drafts drawn
        from its distribution, verified exactly with it), expected to be kept as this request's drafts were."""
        count = wanted if request.params.greedy or self.runner.samples else 0
        return Offer(count, self, None, lambda: self.acceptance.by_position(count))

    def observe(self, stats, offer: Offer, drafts: int, accepted: int) -> None:
        stats.record_iteration(accepted, drafts, self.name)
        if drafts:
            self.acceptance.observe(drafts, accepted)
