"""EAGLE-3: a one-layer head drafts from the target's own hidden states (speccompile/eagle_head.py).

The target's graphs also return its features (the residual stream entering three of its layers) at
every position they cache. The head's position t reads the features of the target's position t with
the token at t + 1, and its output there predicts the token at t + 2; from its second draft on, it
reads its own output in place of the target's features.

Per request (`EagleDraft`): how often its drafts were kept per position, as for the draft model.

Shared (`EagleRunner`): the head's one-layer cache, kept in step with the target's slots. The target
returns its features with every call; the runner keeps those of the positions the target kept
(`unread`) and reads them only when the row drafts here: at the start of such an iteration (one
catch-up call over all of them, whose output is the row's first draft: an iteration of k drafts
costs one catch-up and k - 1 head steps; a row that held more than an iteration's worth reads them
alone first, timed as the iteration's catch-up), or, bounding memory, once a row holds
HOLD_AT_MOST of them (all but the last). So an iteration that decodes plainly costs the head nothing
but a copy of its features, and a request the head stops drafting for is never read again (demo
pair, batch 8, the head declined: reading every 32 positions cost 12% of the call). Under `auto`
beside a draft model, once auto has decoded LET_GO_AFTER tokens of a row without the head, the head
lets go of it if auto drafted them with the other model (`_let_go`): it stops keeping its features,
and offers it nothing more. Reading costs the head a pass over every position (demo
pair, batch 1: 8% of the default call's time, where the draft model outdrafts the head), and a row
the head does not draft for gains nothing by it. Before a catch-up
the head rolls back to what it had read of the target's features (`read_to`): what it wrote past
there came from its own drafts. A row whose features the target did not return (a prompt scored for
echo) falls out of step and gets no drafts.

Sampled requests (a head built with its sampled graphs): each draft is drawn from the head's
distribution after the request's temperature, top-k and top-p, which is returned with it (q, for the
rejection rule's test), or by Gumbel-max with the noise of the output position it proposes for (the
coupled rule), as the draft model draws. The first draft of an iteration is drawn at its catch-up, for
the next output position (`pending_probs` keeps its q); the rest at the steps.
"""


import time

import numpy as np

from speccompile.core.cost_model import tokens_per_ms
from speccompile.core.gamma_policy import ACCEPTANCE_HORIZON, Acceptance, GammaPolicy
from speccompile.core.proposers.base import Offer, Proposer
from speccompile.core.proposers.draft_model import sampled_confidence, sampling_params
from speccompile.core.sampling import draws

# What the load believes of the head before it has seen it draft (EAGLE-3's published acceptance is
# higher than a small draft model's; a prior only orders the first iterations of `auto`)
EAGLE_PRIOR, EAGLE_PRIOR_WEIGHT = 0.7, 2.0
# Tokens auto decodes of a row without the head before the head decides to let go of it, if auto
# drafted them with another model
LET_GO_AFTER = 32
# Positions a row may hold unread, in memory HOLD_AT_MOST feature rows (3 hidden sizes each): read
# beyond it. A row the head never drafts again is never read (demo pair, batch 8, the head declined:
# reading every 32 positions cost 12% of the call)
HOLD_AT_MOST = 512
SHORT_READ = 8  # positions a drafting iteration's catch-up reads per row at most: more (the row held) is read first


class EagleRunner:
    """Runs the EAGLE-3 head for the rows of a plan whose proposer drafts with it. `engine` runs the
    head's graphs: `catch_up(tokens, features, counts, first)` reads target features with the tokens
    after them, `step(tokens, hidden, first)` reads its own output; both return (next_token [B],
    confidence [B], hidden [B, H]) after each row's last position, and advance `cache_lengths`."""

    reads_target_features = True  # the scheduler hands it every target call's features (after_target)

    def __init__(self, engine, max_seq: int):
        self.engine, self.max_seq = engine, max_seq
        # how often the head's drafts are kept, learned over every request of the load, as the γ
        # policy learns the draft model's: a request that starts believing the prior pays for its first
        # iterations of a head that drafts worse (demo pair, batch 1: `auto` at 1.81x beside 2.27x without it)
        self.forget()
        # of the last draft: head calls (its catch-up the first), and the ms of reading what rows held
        self.steps, self.catch_up_ms = 0, 0.0
        self.pending = np.zeros(0, dtype=np.int64)  # per slot: the first draft, read at the last catch-up
        self.confidence = np.zeros(0, dtype=np.float32)
        self.hidden: np.ndarray | None = None  # per slot [H]: the head's output there, fed back by the next step
        self.in_step = np.zeros(0, dtype=bool)  # per slot: the head holds or has read every position the target kept
        self.read_to = np.zeros(0, dtype=np.int64)  # per slot: the positions the head has read of the target's features
        self.unread: list[list[np.ndarray]] = []  # per slot: the features [n, F] of the positions read_to.., in order
        self.held = np.zeros(0, dtype=np.int64)  # per slot: how many positions `unread` holds
        # per slot: when the head last read the row, the tokens it had generated, and the iterations auto
        # had drafted it with another model (a row under auto: _let_go)
        self.read_at = np.zeros(0, dtype=np.int64)
        self.others_seen = np.zeros(0, dtype=np.int64)
        self.drawn = np.zeros(0, dtype=bool)  # per slot: `pending` was drawn for a sampled request (its q kept)
        self.pending_probs: np.ndarray | None = None  # per slot [V]: the distribution `pending` was drawn from

    def forget(self) -> None:
        """Back to the prior of how often the head's drafts are kept (Runtime.forget)."""
        self.acceptance = Acceptance([EAGLE_PRIOR], EAGLE_PRIOR_WEIGHT, ACCEPTANCE_HORIZON)

    @property
    def trees(self) -> bool:
        """Whether the head drafts dynamic trees (its bundle has their graphs: core/proposers/eagle_tree.py)."""
        return bool(getattr(self.engine, "drafts_trees", False))

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
        self.read_to = np.zeros(slots, dtype=np.int64)
        self.unread = [[] for _ in range(slots)]
        self.held = np.zeros(slots, dtype=np.int64)
        self.read_at = np.zeros(slots, dtype=np.int64)
        self.others_seen = np.zeros(slots, dtype=np.int64)

    def admit(self, slot: int) -> None:
        self.engine.cache_lengths[slot] = self.read_to[slot] = self.read_at[slot] = self.others_seen[slot] = 0
        self.unread[slot], self.held[slot] = [], 0
        self.in_step[slot] = False  # until the prefill says the request may draft here

    def prefill(self, rows: list, tokens: np.ndarray, counts: np.ndarray, first: int, complete: bool,
                feed: list[bool]) -> None:
        """Nothing before the target: a prompt chunk's features come with the target's call (after_target).
        A request that will never draft here (plain decoding, or a proposer without the head) is never
        in step, so the head reads nothing for it."""
        for row, request in enumerate(rows):
            if request.prefilled == 0:
                self.in_step[first + row] = request.gamma != 0 and self._drafts_here(request)

    def move(self, source: int, destination: int) -> None:
        self.engine.move(source, destination)
        states = (self.pending, self.confidence, self.in_step, self.drawn, self.read_to, self.held, self.read_at,
                  self.others_seen) + tuple(state for state in (self.hidden, self.pending_probs) if state is not None)
        for state in states:
            state[destination] = state[source]
        self.unread[destination] = list(self.unread[source])

    def share(self, source: int, destination: int, length: int) -> None:
        """Slot `destination` starts with what `source` read or holds of its first `length` positions (a
        shared prompt); the target prefills the rest of it, whose features it then reads."""
        self.move(source, destination)
        self._truncate(destination, length)

    def after_verify(self, rows: list) -> None:
        """Nothing: after_target has kept the verification's features."""

    def after_target(self, rows: list, first: int, before: np.ndarray, after: np.ndarray,
                     features: np.ndarray | None) -> None:
        """A target call over slots first.. has cached row b's positions before[b]..after[b] - 1 and
        returned their features [B, T, F] (None: it returned none): keep those of each position t
        whose token t + 1 the request has, to be read later. A row with a gap before them, or whose
        features did not come, falls out of step (_hold_or_read: what a row holding many does)."""
        rows_here = slice(first, first + len(rows))  # views: writes through them update the slots' state
        in_step = self.in_step[rows_here]
        if not in_step.any():  # none may draft here (plain requests): nothing to keep
            return
        if features is None:
            in_step[:] = False
            return
        ends = self.read_to[rows_here] + self.held[rows_here]
        in_step &= ends >= before
        for b in np.flatnonzero(in_step & (ends > before)):
            self._truncate(first + int(b), int(before[b]))  # the target dropped positions the head had
        known = np.fromiter((len(r.tokens) - 1 for r in rows), dtype=np.int64, count=len(rows))
        counts = np.where(in_step, np.maximum(np.minimum(after, known) - before, 0), 0)
        for b in np.flatnonzero(counts):
            self.unread[first + b].append(features[b, : counts[b]].copy())
        held = self.held[rows_here]
        held += counts
        in_step &= counts >= after - before  # tokens it could not read yet: behind
        for b in np.flatnonzero(in_step & (held >= LET_GO_AFTER)):
            self._hold_or_read(rows[b], first + int(b), int(held[b]))

    def _hold_or_read(self, request, slot: int, held: int) -> None:
        """A row holding LET_GO_AFTER positions or more: under auto, once its window has closed, the head
        lets go of it if auto drafted it with the other model meanwhile; otherwise it keeps holding
        them, and reads all but the last alone once it holds HOLD_AT_MOST (its memory's bound)."""
        others = self._others_drafted(request)
        window_closed = held >= HOLD_AT_MOST or len(request.generated) - self.read_at[slot] >= LET_GO_AFTER
        if others is not None and window_closed and others > self.others_seen[slot]:
            self._let_go(request, slot)
        elif held >= HOLD_AT_MOST:
            self._catch_up([request], slot, np.array([held - 1]), np.zeros(1, dtype=bool))

    def _others_drafted(self, request) -> int | None:
        """The iterations in which auto drafted the request with a model other than the head (None: its
        proposer drafts with no other model)."""
        others = [m.name for m in getattr(request.proposer, "members", ())
                  if m.runs_model and getattr(m, "runner", None) is not self]
        if not others:
            return None
        return sum(request.stats.by_proposer.get(name, (0,))[0] for name in others)

    def _let_go(self, request, slot: int) -> None:
        """Auto drafted this row with another model, and never with the head, since the head last read
        it (the module's docstring): the head stops reading it, and offers it nothing."""
        self.in_step[slot], self.unread[slot], self.held[slot] = False, [], 0
        for member in request.proposer.members:
            if getattr(member, "runner", None) is self:
                member.let_go = True

    def _truncate(self, slot: int, length: int) -> None:
        """Forget what the head read or holds of positions `length`.. (the target no longer has them)."""
        if self.read_to[slot] >= length:
            self.read_to[slot], self.unread[slot], self.held[slot] = length, [], 0
        elif self.read_to[slot] + self.held[slot] > length:
            self.held[slot] = length - self.read_to[slot]
            self.unread[slot] = [np.concatenate(self.unread[slot])[: self.held[slot]]]
        self.engine.cache_lengths[slot] = min(self.engine.cache_lengths[slot], self.read_to[slot])

    def _catch_up(self, rows: list, first: int, counts: np.ndarray, drawing: np.ndarray, top: bool = False):
        """The head reads the first counts[b] positions it holds of each row b (slots first..), each
        with the token after it, from where it last read the target's features: one batched call. Its
        output after a row's last position read is the row's next draft (`pending`); a `drawing` row's
        is drawn (a sampled request, for the output position after its last token). Whether it ran;
        with `top` (a dynamic tree's first level), the best tokens there instead: (top_ids [B, K],
        top_logprobs [B, K]), or None."""
        slots = np.arange(first, first + len(rows))
        read = counts > 0
        if not read.any():
            return None if top else False
        width = int(counts.max())
        tokens = np.zeros((len(rows), width), dtype=np.int64)
        features = None
        for b in np.flatnonzero(read):
            slot, count, start = slots[b], int(counts[b]), int(self.read_to[slots[b]])
            held = np.concatenate(self.unread[slot])
            if features is None:
                features = np.zeros((len(rows), width, held.shape[-1]), dtype=held.dtype)
            features[b, :count] = held[:count]
            self.unread[slot] = [held[count:]] if count < len(held) else []
            self.held[slot] -= count
            tokens[b, :count] = rows[b].tokens[start + 1 : start + 1 + count]
        lengths = self.engine.cache_lengths
        lengths[slots] = np.where(read, self.read_to[slots], lengths[slots])
        if drawing.any():
            uniform, coupled, noise = draws(rows, self.engine.vocab_size, active=drawing)
            token, probs, hidden = self.engine.catch_up_sample(tokens, features, counts, sampling_params(rows),
                                                               uniform, coupled, noise, first=first)
            confidence = sampled_confidence(rows, probs, token)
            if self.pending_probs is None:
                self.pending_probs = np.zeros((len(self.pending), probs.shape[-1]), dtype=np.float32)
            self.pending_probs[slots[drawing]] = probs[drawing]
        elif top:
            token, confidence, hidden, *best = self.engine.tree_catch_up(tokens, features, counts, first=first)
        else:
            token, confidence, hidden = self.engine.catch_up(tokens, features, counts, first=first)
        self.read_to[slots] += counts
        self.drawn[slots[read]] = drawing[read]
        for b in np.flatnonzero(read):
            others = self._others_drafted(rows[b])
            self.read_at[slots[b]] = len(rows[b].generated)
            self.others_seen[slots[b]] = others or 0
        if self.hidden is None:
            self.hidden = np.zeros((len(self.pending), hidden.shape[-1]), dtype=np.float32)
        self.pending[slots[read]], self.confidence[slots[read]], self.hidden[slots[read]] = \
            token[read], confidence[read], hidden[read]
        return tuple(best) if top else True

    def _read_held(self, rows: list, reading: np.ndarray) -> None:
        """Rows about to be read that hold more than SHORT_READ positions (they declined for a while,
        or start after their prompt) read all but their last alone first, timed as the iteration's
        catch-up (`catch_up_ms`: what the policy charges a probe for resuming, as the draft model's);
        the batched catch-up then runs every row over a few positions, not over the longest row's."""
        began = time.perf_counter()
        for b in np.flatnonzero(reading & (self.held[: len(rows)] > SHORT_READ)):
            self._catch_up([rows[b]], int(b), self.held[b : b + 1] - 1, np.zeros(1, dtype=bool))
        self.catch_up_ms = (time.perf_counter() - began) * 1e3

    def read_for_tree(self, request, slot: int) -> tuple[np.ndarray, np.ndarray] | None:
        """A greedy row about to draft a dynamic tree: the head reads every position it holds of it
        (core/proposers/eagle_tree.py) and returns the tree's first level, its best tokens after the
        row's last token (top_ids [K], top_logprobs [K]); its output there is hidden[slot]. None where
        the row is out of step or holds nothing to read (the tree needs the catch-up's output)."""
        if not self.in_step[slot] or self.held[slot] == 0:
            return None
        counts = self.held[slot : slot + 1].copy()  # a copy: the catch-up counts `held` down as it reads
        top_ids, top_logprobs = self._catch_up([request], slot, counts, np.zeros(1, dtype=bool), top=True)
        return top_ids[0], top_logprobs[0]

    def draft(self, rows: list, offers: list[Offer], drafts: np.ndarray, proposed: np.ndarray,
              sampling: bool) -> np.ndarray | None:
        """Draft for the rows whose offer is this runner's: a catch-up over the features the head holds
        of them (its output their first draft), then max(drafts) - 1 batched head steps over every
        row, each feeding back the head's output and the draft before. A row stops drafting at a draft
        whose confidence is below its p_min. Writes drafts into proposed and counts into drafts;
        returns, when a sampled row drafts here, the distributions [B, steps, V] its rows drew from
        (a greedy row's: a point mass on its draft)."""
        mine = np.array([offer.source.runner is self for offer in offers])
        slots = np.arange(len(rows))
        drafts[mine & ~self.in_step[slots]] = 0
        self.steps, self.catch_up_ms = 0, 0.0
        if not (mine & (drafts > 0)).any():
            drafts[mine] = 0
            return None
        sampled = mine & np.array([not r.params.greedy for r in rows])
        reading = mine & (drafts > 0)
        self.drawn[slots[reading]] = False
        self._read_held(rows, reading)
        self.steps = int(self._catch_up(rows, 0, np.where(reading, self.held[slots], 0), reading & sampled))
        drafts[sampled & ~self.drawn[slots]] = 0  # no draw for it at this catch-up: none to verify
        drafts[mine & (self.read_to[slots] == 0)] = 0  # the head has read nothing of it yet
        steps = max((int(d) for d, m in zip(drafts, mine) if m), default=0)
        if steps == 0:
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
        only such a request's features are kept for the head."""
        proposer = request.proposer
        return any(getattr(p, "runner", None) is self for p in (proposer, *getattr(proposer, "members", ())))


class EagleDraft(Proposer):
    name = "eagle"
    runs_model = True
    step_cost = "eagle"  # cost_model.EAGLE: a catch-up (which gives the first draft), then head steps

    def __init__(self, runner: EagleRunner, p_min: float = 0.0):
        self.runner, self.p_min = runner, p_min
        self.let_go = False  # the head stopped following the request (auto drafts it with another model)

    def offer(self, request, wanted: int, cap: int, policy: GammaPolicy | None) -> Offer:
        """`wanted` drafts (for a sampled request, where the head has its sampled graphs: drafts drawn
        from its distribution, verified exactly with it), expected to be kept as the load's were.
        Under γ auto, as many as the head's own acceptance and costs make best, up to `cap`: the load's
        γ is chosen for the draft model, whose drafts are kept at other rates and whose steps cost
        otherwise (demo pair, default call: the head drafted at the draft model's γ of 2, where 4 pays)."""
        if not (request.params.greedy or self.runner.samples) or self.let_go or not wanted:
            return Offer(0, self)
        count = self._best_count(cap, policy.costs_now()) if policy is not None and request.gamma_is_auto else wanted
        return Offer(count, self, None, lambda: self.runner.acceptance.by_position(count))

    def _best_count(self, cap: int, costs) -> int:
        """The drafts, at most `cap`, whose iteration yields the most tokens per ms (the fewest on a tie)."""
        counts = sorted({min(gamma, cap) for gamma in costs.gammas})
        by_position = self.runner.acceptance.by_position(counts[-1])
        return max(counts, key=lambda n: tokens_per_ms(costs, by_position, n, self.step_cost))

    def observe(self, stats, offer: Offer, drafts: int, accepted: int) -> None:
        stats.record_iteration(accepted, drafts, self.name)
        if drafts:
            self.runner.acceptance.observe(drafts, accepted)

    def observed(self, request, policy: GammaPolicy | None) -> int:
        """The load's iterations whose drafts its offers expect (the head's acceptance is the load's)."""
        return self.runner.acceptance.observed[0]
