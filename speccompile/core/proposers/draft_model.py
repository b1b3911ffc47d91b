"""The draft model: a small model of the target's family drafts γ tokens, one batched step at a time.

Per request (`DraftModel`): how often its drafts were kept per position (what `auto` weighs it by)
and its confidence threshold p_min: a row stops drafting at the first token the draft gives less
probability than p_min (that token is not proposed).

Shared (`DraftRunner`): the draft's cache, kept in step with the target's slots. Invariant between
iterations, per decoding request with history h (prompt + generated, last = h[-1]): the draft has
cached a prefix of h[:-1], normally h[:-2]; its first step re-reads [prev, last], which costs nothing
extra and removes the special case where every draft was accepted and the draft never saw d_γ. After
plain iterations it is further behind and catches up in chunks before it drafts.
"""

import time

import numpy as np

from speccompile.core.engine import DecoderEngine
from speccompile.core.gamma_policy import Acceptance, GammaPolicy
from speccompile.core.processors import add_drafted, constrain_next, processing_inputs
from speccompile.core.proposers.base import Offer, Proposer
from speccompile.core.sampling import draws

# Without a γ policy (a fixed γ): what a request believes of its draft model until it has its own.
DRAFT_PRIOR, DRAFT_PRIOR_WEIGHT = 0.7, 2.0


class DraftRunner:
    """Runs the draft model for the rows of a plan whose proposer drafts with it."""

    reads_target_features = False  # it reads the tokens, not the target's features

    def __init__(self, engine: DecoderEngine, max_seq: int):
        self.engine, self.max_seq = engine, max_seq
        self.steps, self.catch_up_ms = 0, 0.0  # of the last `draft`: model steps, and ms spent catching up

    def start(self, slots: int) -> None:
        self.engine.start(slots)

    def admit(self, slot: int) -> None:
        self.engine.cache_lengths[slot] = 0

    def prefill(self, rows: list, tokens: np.ndarray, counts: np.ndarray, first: int, complete: bool,
                feed: list[bool]) -> None:
        """The draft reads the joining requests' prompt chunks too (rows in slots first.., right-padded
        tokens), but not a plain request's, nor one whose drafts would not run now (feed False), and
        only as long as it holds the whole prompt before the chunk; once a prompt is in, it keeps all
        but its last token (its first step re-reads it). What it did not read, it catches up on before
        it first drafts for the row."""
        lengths = self.engine.cache_lengths
        reads = [request.gamma != 0 and fed and lengths[first + row] == request.prefilled
                 for row, (request, fed) in enumerate(zip(rows, feed))]
        if all(reads):
            self.engine.forward(tokens, counts, first=first)
        else:  # some rows are not read: the others one at a time (rare: a group of plain and speculative rows)
            for row in np.flatnonzero(reads):
                self.engine.forward(tokens[row : row + 1, : counts[row]], counts[row : row + 1], first=first + row)
        if complete:
            for row, request in enumerate(rows):
                lengths[first + row] = min(lengths[first + row], len(request.prompt) - 1)

    def move(self, source: int, destination: int) -> None:
        self.engine.move(source, destination)

    def share(self, source: int, destination: int, length: int) -> None:
        """Slot `destination` starts with what `source` cached of its first `length` tokens (a shared prompt)."""
        self.engine.move(source, destination)
        self.engine.cache_lengths[destination] = min(self.engine.cache_lengths[destination], length)

    def after_verify(self, rows: list) -> None:
        """The draft keeps what it cached of the accepted tokens, re-reading the last two next time."""
        lengths = np.array([len(r.tokens) for r in rows], dtype=np.int64)
        self.engine.cache_lengths[: len(rows)] = np.minimum(self.engine.cache_lengths[: len(rows)], lengths - 2)

    def draft(self, rows: list, offers: list[Offer], drafts: np.ndarray, proposed: np.ndarray,
              sampling: bool) -> np.ndarray | None:
        """Draft for the rows whose offer is this runner's: max(their drafts) batched steps over every
        row, the other rows fed their own proposals so that the draft's cache holds their tokens too
        (the rollback keeps what was accepted). Writes the drafts into proposed [B, max] and each
        row's count after thresholding into `drafts`; returns, when sampling, the distributions
        [B, steps, V] its rows drew from. A row's proposals past its count never draw a uniform."""
        mine = [offer.source.runner is self for offer in offers]
        steps = max((int(d) for d, m in zip(drafts, mine) if m), default=0)
        self.steps, self.catch_up_ms = 0, 0.0
        if steps == 0:
            return None
        began = time.perf_counter()
        self._catch_up(rows)
        self.catch_up_ms = (time.perf_counter() - began) * 1e3
        lengths = self.engine.cache_lengths[: len(rows)]
        tokens, counts = pad([r.tokens[length:] for r, length in zip(rows, lengths)])
        p_min = np.array([offer.source.p_min if m else 0.0 for offer, m in zip(offers, mine)], dtype=np.float32)
        params = sampling_params(rows) if sampling else None
        # the target's processors, drafts counted, and its grammars, each step masked after the drafts before it
        processing = processing_inputs(rows, self.engine.vocab_size)
        probs_out = []
        for k in range(steps):
            drafting = [m and k < d for m, d in zip(mine, drafts)]
            if not any(drafting):  # every row stopped below its p_min
                break
            self.steps += 1
            if sampling:
                uniform, coupled, noise = draws(rows, self.engine.vocab_size, offset=k, active=drafting)
                token, probs = self.engine.forward_sample(tokens, counts, params, uniform, coupled, noise,
                                                          processing=processing)
                confidence = sampled_confidence(rows, probs, token)
                probs_out.append(probs)
            else:
                token, confidence = self.engine.forward_confident(tokens, counts, processing=processing)
            for row, offer in enumerate(offers):
                if drafting[row] and confidence[row] < p_min[row]:
                    drafts[row] = k
                elif drafting[row]:
                    proposed[row, k] = token[row]
                elif offer.tokens is not None and k < len(offer.tokens):
                    token[row] = offer.tokens[k]
            add_drafted(processing, token, np.ones(len(rows), bool))  # every row's next step reads the token fed
            constrain_next(processing, rows, proposed, [k + 1 if drafting[row] and drafts[row] > k else None
                                                        for row in range(len(rows))])
            tokens, counts = token[:, None], np.ones(len(rows), dtype=np.int64)
        return np.stack(probs_out, axis=1) if sampling else None

    def _catch_up(self, rows: list) -> None:
        """Feed the draft what it missed (after plain iterations) in chunks, until every row lacks
        at most its last two tokens; chunks are sized so that no row's padded write leaves the cache."""
        while True:
            lengths = self.engine.cache_lengths[: len(rows)]
            behind = [max(0, len(r.tokens) - 2 - int(length)) for r, length in zip(rows, lengths)]
            if not any(behind):
                return
            size = min(max(behind), self.max_seq - int(lengths.max()))
            self.engine.forward(*pad([r.tokens[int(length) : int(length) + min(b, size)]
                                      for r, length, b in zip(rows, lengths, behind)]))


class DraftModel(Proposer):
    name = "draft"
    runs_model = True
    learns_policy = True

    def __init__(self, runner: DraftRunner, p_min: float = 0.0):
        self.runner, self.p_min = runner, p_min
        self.acceptance = Acceptance([DRAFT_PRIOR], DRAFT_PRIOR_WEIGHT)

    def offer(self, request, wanted: int, cap: int, policy: GammaPolicy | None) -> Offer:
        """`wanted` drafts, expected to be kept as the load's policy has learned (γ auto) or as this
        request's own drafts were (a fixed γ)."""
        if policy is not None and request.gamma_is_auto:
            return Offer(wanted, self, None, lambda: policy.acceptance_by_position(wanted))
        return Offer(wanted, self, None, lambda: self.acceptance.by_position(wanted))

    def observe(self, stats, offer: Offer, drafts: int, accepted: int) -> None:
        stats.record_iteration(accepted, drafts, self.name)
        if drafts:
            self.acceptance.observe(drafts, accepted)

    def observed(self, request, policy: GammaPolicy | None) -> int:
        """The load's iterations (γ auto: its policy's) or this request's whose drafts its offers expect."""
        if policy is not None and request.gamma_is_auto:
            return policy.counts.observed[0]
        return self.acceptance.observed[0]


def pad(token_lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists into [B, T_max] (T_max >= 1); returns (ids, counts)."""
    counts = np.array([len(t) for t in token_lists], dtype=np.int64)
    ids = np.zeros((len(token_lists), max(1, int(counts.max()))), dtype=np.int64)
    for row, tokens in enumerate(token_lists):
        ids[row, : len(tokens)] = tokens
    return ids, counts


def sampling_params(rows: list) -> dict:
    """The sampling graphs' per-row controls (greedy rows: temperature 0, i.e. one-hot)."""
    return {"temperature": np.array([r.params.temperature for r in rows], dtype=np.float32),
            "top_k": np.array([r.params.top_k for r in rows], dtype=np.int64),
            "top_p": np.array([r.params.top_p for r in rows], dtype=np.float32)}


def sampled_confidence(rows: list, probs: np.ndarray, token: np.ndarray) -> np.ndarray:
    """What a sampled draft's p_min is compared with, per row. Coupled rule: the drawn token's
    probability: the token at a position is the target's draw with that position's noise whoever
    proposes it, so dropping a draft after seeing it changes nothing but speed. Rejection rule: the
    most likely token's, which the draw cannot change: dropping a token for being drawn would
    propose from q cut to its likely tokens while the test accepts it by q's own probability, and
    the output would no longer be the target's distribution (chi-square tests at p_min 0.3 rejected
    it, statistic 85-93 against a critical 79)."""
    drawn = probs[np.arange(len(rows)), token]
    coupled = np.array([row.coupled for row in rows])
    return np.where(coupled, drawn, probs.max(axis=-1))
