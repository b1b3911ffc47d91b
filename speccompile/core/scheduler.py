"""Continuous batching: the request-level speculative engine, over the backend-free interface of
`engine.py`. The scheduler only decides; proposers (core/proposers) own what each request proposes.

Requests arrive at any time (`add`) and wait in a queue. Each `step` is one iteration:
  1. cancelled and stopped requests leave;
  2. prefill: waiting requests join, a chunk of prompt at a time (below);
  3. one decoding iteration over every decoding request at once, in three parts:
     plan     γ for this iteration: the policy's choice for the current number of decoding requests
              and their mean context (its profile measured each batch size and context), capped per
              request by its own γ and by the tokens it still needs; each row's proposer makes its
              offer (a lookup's tokens at once, the draft model's count); under γ auto, an offer
              that promises fewer tokens per ms than a plain step is declined (the row decodes
              plainly), but for a rare probe (core/gamma_policy.py); the verification graph is
              the smallest γ verified at that holds the longest offer. Rows may carry different numbers
              of drafts: the verification takes each row's draft length. A Medusa plan verifies
              token trees instead. All of it is one `Plan`.
     execute  the runners draft what the offers left to them (the draft model, batched, stopping a
              row at a token less sure than its p_min), then the target scores [last, d_1..d_γ] of
              every row in ONE verification pass whose SpecAccept keeps each row's longest agreeing
              prefix (n drafts), returns the target's own next token and rolls the target cache back
              (a length update); or, when no row carries drafts, one plain decoding step;
     update   d_1..d_n and the target's token are emitted; each row's proposer and the γ policy learn
              from the outcome, the policy from its times too; the runners roll their caches back;
  4. finished requests leave at once; their slots are refilled by moving the last decoding row.

Slots. The caches have `max_batch` slots, allocated once. Decoding requests occupy slots
0..n-1 and every call runs on that prefix, so a step costs what the active requests need; a single
active request runs the single-sequence graphs. A request still being prefilled sits in slot n,
right after them, and joins the decoding batch (becoming slot n) when its prompt is in.

Prefill is chunked so that a joining request does not stall the running ones for long: while
requests are decoding, an iteration prefills at most `prefill_chunk` prompt tokens, so each
iteration is delayed by at most one chunk's prefill; with no request decoding, whole prompts are
prefilled at once. A long prompt thus joins over several iterations, each costing its decoding
requests one chunk. Waiting requests whose whole prompts fit in a chunk (and what is left of that
budget) together join in one call over their slots (`_group`: prompts right-padded to the longest,
grouped only while padding stays under GROUP_PADDING of the call's tokens); any other joins alone, a
chunk at a time (one call at batch 1).

Invariant between iterations, per decoding request with history h (prompt + generated, last = h[-1]):
the target has cached h[:-1]; each runner keeps its own (proposers/draft_model.py).
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from speccompile.core.engine import DecoderEngine, VerifierEngine
from speccompile.core.gamma_policy import GammaPolicy, Timing
from speccompile.core.processors import grammar_masks, processing_inputs, words
from speccompile.core.proposers import Offer, Proposers
from speccompile.core.proposers.draft_model import DraftModel, DraftRunner, sampling_params
from speccompile.core.proposers.eagle_tree import TreeEconomy, TreeSizing, draft_tree
from speccompile.core.request import AUTO, Request
from speccompile.core.sampling import draws

# (number of decoding requests, their mean context length) -> the γ policy for that load (None: no
# costs known yet). Context matters as much as load: every step grows with it, and a draft's
# acceptance can fall with it (a draft distilled on short sequences drafts poorly past them).
PolicyFor = Callable[[int, int], GammaPolicy | None]

# Joining requests prefilled in one call: at most this share of its tokens may be padding (the rows
# shorter than the longest). Demo target, 2 cores, 8 prompts: 8 tokens each, one call 2.6x faster
# than eight; 36 each, 1.28x; 22 to 90 tokens (half of the call padding), 1.5x slower.
GROUP_PADDING = 0.25


@dataclass
class Plan:
    """One decoding iteration, as decided: its rows (the decoding requests, slot order), each row's
    offer and the drafts it carries (at most its offer and the tokens it still needs), the compiled
    γ whose verification runs (0: a plain step), and the policy that chose γ, which learns from it."""

    rows: list[Request]
    offers: list[Offer]
    drafts: np.ndarray
    gamma: int
    policy: GammaPolicy | None = None
    tree: bool = False  # a token-tree verification (Medusa) instead of a chain
    eagle_tree: bool = False  # an EAGLE-3 head's dynamic tree (one request: core/proposers/eagle_tree.py)
    tree_or_chain: bool = False  # a request that may draft a dynamic tree: this iteration's rate chooses (TreeEconomy)


class Scheduler:
    def __init__(self, target: VerifierEngine, draft: DecoderEngine | None, max_batch: int, max_seq: int,
                 gammas: list[int], eos_ids: set[int], policy_for: PolicyFor | None = None,
                 prefill_chunk: int = 64, fallback_gamma: int | None = None, proposers: Proposers | None = None):
        """fallback_gamma: what AUTO requests run while there is no policy (default: the largest γ).
        proposers: what the requests' proposers share (default: the draft model's runner over
        `draft`, None for a bundle without a draft model)."""
        self.target = target
        self.max_batch, self.max_seq, self.gammas = max_batch, max_seq, sorted(gammas)
        self.eos_ids, self.policy_for, self.prefill_chunk = eos_ids, policy_for, prefill_chunk
        self.fallback_gamma = max(self.gammas) if fallback_gamma is None else fallback_gamma
        self.proposers = proposers or Proposers(DraftRunner(draft, max_seq) if draft is not None else None)
        self.runners = self.proposers.runners
        # runners that read the target's features of every position it caches (EAGLE-3): after each call
        self.feature_readers = [runner for runner in self.runners if runner.reads_target_features]
        self.verifies_trees = bool(getattr(target, "drafts_trees", False))  # an EAGLE-3 head's dynamic trees
        self.waiting: deque[Request] = deque()  # appended by any thread; popped here only
        self.decoding: list[Request] = []  # slot i holds decoding[i]
        self.joining: Request | None = None  # partly prefilled, in slot len(decoding)
        self._started = False
        self.last_gamma = 0  # the γ of the last decoding iteration's verification (0: a plain step), for metrics
        self.tree_economy = TreeEconomy()  # what EAGLE-2 trees have kept and cost so far (their sizing)

    def forget(self) -> None:
        """Forget what the load's dynamic trees taught their sizing (Runtime.forget)."""
        self.tree_economy = TreeEconomy()

    # -- the queue --------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request (thread-safe). Its γ and length must have been checked (see `fits`); its
        proposer is made now if it names one, and its γ cap is noted, so that iterations read both."""
        self.proposer(request)
        assert self.fits(request), "request does not fit the caches: check it before adding it"
        request.gamma_cap = self.gamma_cap(request)
        self.waiting.append(request)

    def fits(self, request: Request) -> bool:
        """Every position a request can write, its longest verification included, is in the cache."""
        return len(request.prompt) + request.max_new_tokens + self.gamma_cap(request) <= self.max_seq

    def gamma_cap(self, request: Request) -> int:
        """The most drafts one of this request's iterations may carry: its own γ, or under AUTO the
        largest compiled γ that its length leaves room for (0 if none: it decodes plainly)."""
        if not self.proposer(request).reserves_room:  # a tree shrinks to the room its rows leave
            return 0
        if request.gamma != AUTO:
            return request.gamma
        room = self.max_seq - len(request.prompt) - request.max_new_tokens
        return max([g for g in self.gammas if g <= room], default=0)

    def proposer(self, request: Request):
        """The request's proposer, made from its kind's name the first time it is asked for."""
        if isinstance(request.proposer, str):
            request.proposer = self.proposers.make(request.proposer, request.p_min)
        return request.proposer

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.decoding or self.joining)

    @property
    def active(self) -> int:
        return len(self.decoding) + (self.joining is not None)

    # -- one iteration ------------------------------------------------------------------------------
    def start(self) -> None:
        """Caches for every slot, allocated once: by the runtime's load, or else by the first step."""
        if not self._started:
            self.target.start(self.max_batch)
            for runner in self.runners:
                runner.start(self.max_batch)
            self._started = True

    def step(self) -> None:
        self.start()
        self._retire_cancelled()
        self._prefill()
        if self.decoding:
            began = time.perf_counter()
            plan = self.plan(self.decoding)
            emitted = len(plan.rows[0].tokens) if plan.tree_or_chain else 0
            timing = self.execute(plan)
            if plan.tree_or_chain:  # which pays, a tree or the chain (or the plain step it chose), measured
                self.tree_economy.observe_rate(plan.eagle_tree, len(plan.rows[0].tokens) - emitted,
                                               (time.perf_counter() - began) * 1e3)
            if plan.policy is not None and timing is not None:  # what the iteration cost teaches the policy
                timing.total_ms = (time.perf_counter() - began) * 1e3 - timing.catch_up_ms
                plan.policy.observe_timing(timing)
        self._retire_finished()

    def cancel_all(self) -> None:
        """Shutting down: every request in flight or waiting ends as cancelled."""
        self._end_all("cancelled")

    def fail_in_flight(self, error: Exception) -> None:
        """A backend failure during an iteration: the requests it touched (decoding, or being
        prefilled) end with it; the waiting ones were not touched and go on, into fresh slots."""
        for request in [*self.decoding, *([self.joining] if self.joining else [])]:
            request.finish("error", error)
            self.proposer(request).finish(request)
        self.decoding, self.joining = [], None

    def _end_all(self, reason: str, error: Exception | None = None) -> None:
        for request in [*self.decoding, *([self.joining] if self.joining else []), *self.waiting]:
            request.finish(reason, error)
            self.proposer(request).finish(request)
        self.decoding, self.joining = [], None
        self.waiting.clear()

    # -- prefill ----------------------------------------------------------------------------------
    def _prefill(self) -> None:
        budget = self.prefill_chunk if self.decoding else self.max_seq * self.max_batch
        while budget > 0:
            if self.joining is None:
                if not self.waiting or len(self.decoding) >= self.max_batch:
                    return
                group = self._group(budget)
                if group:
                    budget -= self._prefill_group(group)
                else:
                    self._admit(self.waiting.popleft())
                continue
            budget -= self._prefill_chunk(self.joining, budget)
            if self.joining.done:  # its first token ended it (EOS, a stop, or max_new_tokens 1)
                self.joining.finish(self.joining.finish_reason)
                self.joining = None
            elif self.joining.prefilled == len(self.joining.prompt):
                self.decoding.append(self.joining)
                self.joining = None

    def _admit(self, request: Request) -> None:
        if request.cancelled:
            request.finish("cancelled")
            return
        slot = len(self.decoding)
        self._take_slot(request, slot)
        self._reuse_prefill(request, slot)
        self.joining = request

    def _take_slot(self, request: Request, slot: int) -> None:
        request.stats.queue_ms = (time.perf_counter() - request.submitted) * 1e3
        self.target.cache_lengths[slot] = 0
        for runner in self.runners:
            runner.admit(slot)

    def _group(self, budget: int) -> list[Request] | None:
        """Waiting requests to prefill together, the first in the queue among them (None: it joins
        alone). A request joins the group if its whole prompt fits with the others' in `budget` tokens
        and in one prefill chunk, padded to the longest, with padding at most GROUP_PADDING of them.
        Why a chunk: on a CPU a prefill costs by the token, so a group's call delays each of its
        requests' first token by the others' prompts; within a chunk that costs little beside the
        fixed cost of the calls it saves (demo target, a burst of its 8 prompts of 8 to 26 tokens:
        median first token 33 ms one request per call, 46 ms in groups of up to 130 tokens, 31 ms in
        groups within a 64-token chunk; `python -m tools.measure burst`). Not grouped: a request
        that scores its prompt (chunked scoring) or shares another's prefill (copied from that one's
        slot once it decodes), and a cancelled one."""
        limit, free = min(budget, self.prefill_chunk), self.max_batch - len(self.decoding)
        group, real, width = [], 0, 0
        for request in list(self.waiting):
            if len(group) == free:
                break
            if request.cancelled or request.prompt_logprobs is not None or request.shares_prefill_with is not None:
                if not group:
                    return None
                continue
            widest = max(width, len(request.prompt))
            padded = widest * (len(group) + 1)
            if padded <= limit and real + len(request.prompt) >= (1 - GROUP_PADDING) * padded:
                group.append(request)
                real, width = real + len(request.prompt), widest
            elif not group:
                return None
        return group if len(group) > 1 else None

    def _prefill_group(self, group: list[Request]) -> int:
        """Prefill the group's whole prompts in one call over the slots after the decoding rows (right-
        padded), each row's first token with it; they join the decoding rows. Returns the tokens the
        call computed (padding included)."""
        for request in group:
            self.waiting.remove(request)
        first = len(self.decoding)
        for row, request in enumerate(group):
            self._take_slot(request, first + row)
        counts = np.array([len(r.prompt) for r in group], dtype=np.int64)
        tokens = np.zeros((len(group), counts.max()), dtype=np.int64)
        for row, request in enumerate(group):
            tokens[row, : counts[row]] = request.prompt
        began = time.perf_counter()
        before = self._lengths_before(first, len(group))
        feed = [not self._model_declined(r) for r in group]
        if all(r.params.greedy for r in group):
            next_token = self.target.forward(tokens, counts, first=first, **self._options(group))
        else:
            next_token, _ = self.target.forward_sample(tokens, counts, sampling_params(group),
                                                       *draws(group, self.target.vocab_size), first=first,
                                                       **self._options(group))
        for row, request in enumerate(group):
            request.emit([next_token[row]], self.eos_ids, self._scores(group, row, 1))
        self._runners_prefill(group, tokens, counts, first, True, feed)
        for request in group:
            request.prefilled = len(request.prompt)
        self._features_read(group, first, before)
        elapsed = (time.perf_counter() - began) * 1e3
        for row, request in enumerate(group):
            request.stats.prefill_ms += elapsed
            if request.done:  # its first token ended it (EOS, a stop, or max_new_tokens 1)
                request.finish(request.finish_reason)
                continue
            if first + row != len(self.decoding):  # a row before it ended: keep the decoding rows packed
                self._move(first + row, len(self.decoding))
            self.decoding.append(request)
        return tokens.size

    def _runners_prefill(self, rows: list[Request], tokens: np.ndarray, counts: np.ndarray, first: int,
                         complete: bool, feed: list[bool]) -> None:
        """The proposers' models read the prompt chunk the target has just read, after the target: a
        request's first token is emitted before its draft reads the prompt (the time to first token is
        the target's prefill alone), and a request that its first token ended is not read at all when
        it prefilled alone. Called before `request.prefilled` counts the chunk."""
        for runner in self.runners:
            runner.prefill(rows, tokens, counts, first, complete, feed)

    def _reuse_prefill(self, request: Request, slot: int) -> None:
        """Another sample of a prompt that a decoding request has prefilled (n samples): the cached
        prompt, all but its last token, is copied from that request's slot instead of computed again;
        the last token is prefilled as any request's last chunk, and yields this sample's first token."""
        source, keep = request.shares_prefill_with, len(request.prompt) - 1
        if source is None or source not in self.decoding or source.prompt != request.prompt or keep < 1 \
                or request.prompt_logprobs is not None:  # a scored prompt is scored: nothing to copy
            return
        origin = self.decoding.index(source)
        self.target.move(origin, slot)
        self.target.cache_lengths[slot] = keep
        for runner in self.runners:
            runner.share(origin, slot, keep)
        request.prefilled = keep

    def _prefill_chunk(self, request: Request, budget: int) -> int:
        """Prefill the next chunk of a joining request's prompt; its first token when complete. A
        request that scores its prompt (echo) has every token but the last scored, in chunks, and
        the last prefilled alone, as any request's last chunk: it yields the first token."""
        slot, start = len(self.decoding), request.prefilled
        scoring = request.prompt_logprobs is not None and start < len(request.prompt) - 1
        count = min(budget, len(request.prompt) - (1 if scoring else 0) - start)
        tokens = np.array([request.prompt[start : start + count]], dtype=np.int64)
        counts = np.array([count], dtype=np.int64)
        began = time.perf_counter()
        complete = start + count == len(request.prompt)
        feed = not self._model_declined(request)
        before = self._lengths_before(slot, 1)
        options = {"processing": processing_inputs([request], self.target.vocab_size),
                   "logprobs": request.logprobs is not None}
        if scoring:
            following = np.array([request.prompt[start + 1 : start + count + 1]], dtype=np.int64)
            scores = self.target.score(tokens, following, first=slot)
            request.prompt_scores.extend(scores.row(0, count, request.prompt_logprobs))
        elif complete and not request.params.greedy:
            uniform, coupled, noise = draws([request], self.target.vocab_size)
            token, _ = self.target.forward_sample(tokens, counts, sampling_params([request]), uniform, coupled, noise,
                                                  first=slot, **options)
        else:
            token = self.target.forward(tokens, counts, first=slot, **options)
        if complete:
            request.emit(token, self.eos_ids, self._scores([request], 0, 1))
        if not request.done:
            self._runners_prefill([request], tokens, counts, slot, complete, [feed])
        request.prefilled += count
        self._features_read([request], slot, before, scored=scoring)
        request.stats.prefill_ms += (time.perf_counter() - began) * 1e3
        return count

    def _model_declined(self, request: Request) -> bool:
        """Whether the draft model's offers are being declined at the load this request joins (its
        prompt then need not be read by the draft: the draft catches up if a probe or a change of
        text makes it draft later)."""
        if self.policy_for is None or request.gamma != AUTO or not request.allow_plain:
            return False
        policy = self.policy_for(len(self.decoding) + 1, len(request.prompt))
        return policy is not None and policy.declined.get(DraftModel.name, 0) > 0

    # -- decoding: plan -------------------------------------------------------------------------
    def plan(self, rows: list[Request]) -> Plan:
        """Decide this iteration: γ, each row's offer and drafts, and the graph that verifies them."""
        if any(r.proposer.tree and r.gamma != 0 for r in rows):
            return Plan(rows, [], np.zeros(len(rows), dtype=np.int64), 0, tree=True)
        tree_or_chain = len(rows) == 1 and self.verifies_trees and rows[0].proposer.drafts_tree(
            rows[0], 1, self.max_seq - len(rows[0].tokens))
        if tree_or_chain and self.tree_economy.tree_turn():
            return Plan(rows, [], np.zeros(1, dtype=np.int64), 0, eagle_tree=True, tree_or_chain=True)
        policy = None
        if self.policy_for and any(r.gamma == AUTO or r.proposer.compares_costs for r in rows):
            policy = self.policy_for(len(rows), round(sum(len(r.tokens) for r in rows) / len(rows)))
        wanted, shared = self._wanted_gamma(rows, policy)
        needed = np.array([r.remaining - 1 for r in rows], dtype=np.int64)  # the target adds one token of its own
        offers = [r.proposer.offer(r, int(w), self._cap(r, shared), policy) if r.gamma
                  else Offer(0, r.proposer) for r, w in zip(rows, np.minimum(wanted, needed))]
        if policy is not None:
            offers = self._against_plain(rows, offers, policy)
            offers = self._one_model_drafter(rows, offers, policy)
        # A request near its end drafts only what it still needs, but a model drafter's row keeps the
        # graph of the γ it wanted (or more, where the head chose more): switching graphs costs more
        # than the padded slots.
        counts = np.array([max(w, o.count) if o.source.runs_model and o.count else o.count
                           for o, w in zip(offers, wanted)], dtype=np.int64)
        gamma = self._graph_gamma(rows, counts)
        drafts = np.minimum(np.minimum(counts, gamma), needed)
        for row, (request, offer) in enumerate(zip(rows, offers)):
            if request.grammar is not None and offer.tokens is not None and drafts[row]:
                # a lookup's proposal is cut where the grammar forbids it (the draft model's is masked)
                drafts[row] = request.grammar.valid_prefix(offer.tokens[: drafts[row]])
        return Plan(rows, offers, drafts, gamma if drafts.max() > 0 else 0, policy, tree_or_chain=tree_or_chain)

    def _against_plain(self, rows: list[Request], offers: list[Offer], policy: GammaPolicy) -> list[Offer]:
        """Under γ auto, a row whose offer promises fewer tokens per ms than a plain step decodes
        plainly this iteration (its offer becomes none), unless its proposer's probe is due
        (GammaPolicy.worth_running). A row that may not decode plainly (mode "speculative") keeps it."""
        free = [row for row, (r, o) in enumerate(zip(rows, offers)) if o.count and r.gamma == AUTO and r.allow_plain]
        if not free:
            return offers
        costs = policy.costs_now()
        free_rows = set(free)
        committed = any(o.count for row, o in enumerate(offers) if row not in free_rows)  # drafting whatever these do
        verdicts = policy.worth_running([(offers[row].source.name, offers[row].rate(costs),
                                          offers[row].iteration_ms(costs)) for row in free], len(rows), committed)
        offers = list(offers)
        for row, runs in zip(free, verdicts):
            if not runs:
                offers[row] = Offer(0, offers[row].source)
        return offers

    @staticmethod
    def _one_model_drafter(rows: list[Request], offers: list[Offer], policy: GammaPolicy) -> list[Offer]:
        """Rows whose offers draft with different models (a draft model and an EAGLE-3 head, under
        auto) would make the iteration pay both models' calls over every row, which no row's offer
        counts: the model whose offers promise the most tokens per ms, summed over its rows, drafts,
        and the other model's rows that may decode plainly (γ auto) do so this iteration."""
        by_runner: dict[int, list[int]] = {}
        for row, offer in enumerate(offers):
            if offer.count and offer.source.runner is not None:
                by_runner.setdefault(id(offer.source.runner), []).append(row)
        if len(by_runner) < 2:
            return offers
        costs = policy.costs_now()
        kept = max(by_runner.values(), key=lambda group: sum(offers[row].rate(costs) for row in group))
        return [Offer(0, offer.source) if offer.count and offer.source.runner is not None and row not in kept
                and rows[row].gamma == AUTO and rows[row].allow_plain else offer for row, offer in enumerate(offers)]

    def _wanted_gamma(self, rows: list[Request], policy: GammaPolicy | None) -> tuple[np.ndarray, int | None]:
        """The drafts each row asks of a model drafter this iteration: its own γ, or under AUTO the
        policy's best γ for the current load (whether drafting pays at all is each offer's to show:
        `_against_plain`), capped by the room its length leaves. And, when several rows decode under
        AUTO, that γ as the most any of their offers may carry (None: no such cap)."""
        if policy is None:
            chosen = declined = self.fallback_gamma
        else:
            chosen = policy.choose(allow_zero=False)
            # rows that may decode plainly ask nothing of a model drafter whose offer would be declined again
            plain_rows = any(r.gamma == AUTO and r.allow_plain for r in rows)
            declined = 0 if plain_rows and policy.still_declined(DraftModel.name) else chosen
        wanted = np.array([min(declined if r.allow_plain else chosen, r.gamma_cap) if r.gamma == AUTO else r.gamma
                           for r in rows], dtype=np.int64)
        return wanted, chosen if len(rows) > 1 and policy is not None else None

    @staticmethod
    def _cap(request: Request, shared: int | None) -> int:
        """The most drafts a row's offer may carry: its γ cap and the tokens it still needs, and under
        AUTO in a batch the load's γ. Rows share one verification graph, the longest offer's, so one
        row's long lookup would make every row verify at a longer γ, and alternating graphs evicts
        each one's weights from the caches (demo pair, batch 8: lookups of up to 6 beside drafts of 2
        ran at 0.87x a fixed γ=4)."""
        cap = min(request.gamma_cap, request.remaining - 1)
        return min(cap, shared) if shared is not None and request.gamma == AUTO else cap

    def _graph_gamma(self, rows: list[Request], wanted: np.ndarray) -> int:
        """The γ whose verification runs: the smallest that holds every row's wanted
        drafts, and whose padded positions stay inside every row's cache."""
        longest = int(wanted.max())
        if longest == 0:
            return 0
        room = self.max_seq - max(len(r.tokens) for r in rows)  # writes reach position len + γ - 1
        fitting = [g for g in self.gammas if g <= room]
        covering = [g for g in fitting if g >= longest]
        return min(covering) if covering else max(fitting, default=0)

    # -- decoding: execute ----------------------------------------------------------------------
    def execute(self, plan: Plan) -> Timing | None:
        """Run the plan; its times (None for a token tree, whose sizing measured its own)."""
        if plan.tree:
            self._tree_iteration(plan.rows)
            return None
        if plan.eagle_tree:
            self._eagle_tree_iteration(plan.rows[0])
            return None
        began = time.perf_counter()
        if plan.gamma == 0:
            return Timing(0, self._plain_iteration(plan.rows, began), 0.0)
        rows, offers, drafts = plan.rows, plan.offers, plan.drafts.copy()
        proposed = np.zeros((len(rows), int(drafts.max())), dtype=np.int64)
        for row, offer in enumerate(offers):
            if offer.tokens is not None:
                proposed[row, : drafts[row]] = offer.tokens[: drafts[row]]
        sampling = not all(r.params.greedy for r in rows)
        q = {}  # runner -> the distributions [B, steps, V] its rows drew from (sampling)
        for runner in {id(o.source.runner): o.source.runner for o in offers if o.source.runner}.values():
            q[runner] = runner.draft(rows, offers, drafts, proposed, sampling)
        drafted = time.perf_counter()
        draft_ms = (drafted - began) * 1e3
        catch_up_ms = sum(runner.catch_up_ms for runner in q)
        kinds = {o.step_cost for o, d in zip(offers, drafts) if d and o.step_cost}  # whose steps draft_ms timed
        timing = Timing(0, 0.0, 0.0, draft_ms - catch_up_ms, max((runner.steps for runner in q), default=0),
                        catch_up_ms, step_cost=kinds.pop() if len(kinds) == 1 else None)
        if drafts.max() == 0:  # every row stopped before its first draft: a plain step is cheaper
            self.last_gamma = 0
            timing.target_ms = self._plain_iteration(rows, began)
            return timing
        gamma = self.last_gamma = min(g for g in self.gammas if g >= drafts.max())  # fewer drafts: a shorter one
        before = self._lengths_before(0, len(rows))
        accepted, next_token = self._verify(rows, offers, drafts, gamma, proposed, q)
        verify_ms = (time.perf_counter() - drafted) * 1e3
        self.update(plan, drafts, proposed, accepted, next_token, (draft_ms, verify_ms))
        self._features_read(rows, 0, before)
        timing.gamma, timing.target_ms, timing.tokens = gamma, verify_ms, float(np.mean(accepted)) + 1.0
        return timing

    def _options(self, rows: list[Request], drafted: list | None = None, positions: int = 1) -> dict:
        """What a target call of these rows applies and reports: their processors' inputs (and
        grammars' masks, at the call's scored positions: after each row's `drafted` tokens 1..r in
        a verification), and whether any of them asks for log-probabilities."""
        return {"processing": processing_inputs(rows, self.target.vocab_size, drafted=drafted, positions=positions),
                "logprobs": any(r.logprobs is not None for r in rows)}

    def _scores(self, rows: list[Request], row: int, count: int) -> list | None:
        """Row `row`'s log-probabilities at its first `count` positions in the last target call, if it asks."""
        request = rows[row]
        if request.logprobs is None:
            return None
        return self.target.last_logprobs.row(row, count, request.logprobs)

    def _verify(self, rows: list[Request], offers: list[Offer], drafts: np.ndarray, gamma: int,
                proposed: np.ndarray, q: dict):
        candidates = np.zeros((len(rows), gamma + 1), dtype=np.int64)
        candidates[:, 0] = [r.tokens[-1] for r in rows]
        width = min(gamma, proposed.shape[1])
        candidates[:, 1 : width + 1] = proposed[:, :width]
        options = self._options(rows, [candidates[row, 1 : 1 + int(d)] for row, d in enumerate(drafts)], gamma + 1)
        if all(r.params.greedy for r in rows):
            return self.target.verify(candidates, drafts, **options)
        vocab = next((probs.shape[2] for probs in q.values() if probs is not None), self.target.vocab_size)
        draft_probs = np.zeros((len(rows), gamma, vocab), dtype=np.float32)
        u_accept = np.full((len(rows), gamma), 0.5, dtype=np.float32)
        u_sample = np.full(len(rows), 0.5, dtype=np.float32)
        coupled = np.array([r.coupled for r in rows])
        noise = np.zeros((len(rows), gamma + 1, self.target.vocab_size), dtype=np.float32) if coupled.any() else None
        for row, (request, offer, d) in enumerate(zip(rows, offers, drafts)):
            if request.coupled:  # the target's draws at the γ+1 positions it scores; q is never read
                request.noise(0, noise[row])
                continue
            if request.rng is not None:  # one uniform per real draft, one for the correction or bonus token
                u_accept[row, :d] = request.uniforms(int(d))
                u_sample[row] = request.uniforms(1)[0]
            if not d:
                continue
            probs = q.get(offer.source.runner)
            if probs is not None:  # drawn by a runner: its distributions
                steps = min(int(d), probs.shape[1])
                draft_probs[row, :steps] = probs[row, :steps]
            else:  # a point proposal (a lookup) is a point mass
                draft_probs[row, np.arange(d), proposed[row, :d]] = 1.0
        return self.target.verify_sample(candidates, drafts, draft_probs, sampling_params(rows), u_accept, u_sample,
                                         coupled if noise is not None else None, noise, **options)

    def _plain_iteration(self, rows: list[Request], began: float) -> float:
        """One plain decoding step of every row, its time (since `began`) counted as decoding.
        Returns the target call's ms."""
        last = np.array([[r.tokens[-1]] for r in rows], dtype=np.int64)
        one = np.ones(len(rows), dtype=np.int64)
        before = self._lengths_before(0, len(rows))
        called = time.perf_counter()
        if all(r.params.greedy for r in rows):
            next_token = self.target.forward(last, one, **self._options(rows))
        else:
            next_token, _ = self.target.forward_sample(last, one, sampling_params(rows),
                                                       *draws(rows, self.target.vocab_size), **self._options(rows))
        done = time.perf_counter()
        for row, request in enumerate(rows):
            request.emit([next_token[row]], self.eos_ids, self._scores(rows, row, 1))
            request.stats.decode_ms += (done - began) * 1e3
            request.stats.record_iteration(0, 0)
        self._features_read(rows, 0, before)
        return (done - called) * 1e3

    def _lengths_before(self, first: int, count: int) -> np.ndarray | None:
        """The target's cache lengths of slots first.. before a call, for the runners that read its
        features (none: nothing to copy, on every iteration of a bundle without an EAGLE-3 head)."""
        return self.target.cache_lengths[first : first + count].copy() if self.feature_readers else None

    def _features_read(self, rows: list[Request], first: int, before: np.ndarray | None,
                       scored: bool = False) -> None:
        """The runners that read the target's features (EAGLE-3) read those of the call just made over
        slots first.., of the positions it kept; a scoring call returns none."""
        if not self.feature_readers:
            return
        after = self.target.cache_lengths[first : first + len(rows)].copy()
        features = None if scored else getattr(self.target, "last_aux_hidden", None)
        for runner in self.feature_readers:
            runner.after_target(rows, first, before, after, features)

    def _tree_iteration(self, rows: list[Request]) -> None:
        """Medusa: one target pass verifies each row's token tree (the heads' proposal of the last
        pass, rooted at its last token) and returns the next one. A row with no proposal yet, and a
        plain row (γ 0), verify the root alone. A row verifies the prefix of the tree at depths up to
        its γ and the tokens it still needs; typical acceptance applies when every row asked for it."""
        shape = rows[0].proposer.shape
        assert shape.tree is not None, "Medusa requests need the runtime's token tree"
        # a tree writes all its nodes: near the cache's end, its first nodes (a tree too) only
        tree = shape.for_batch(len(rows), self.max_seq - max(len(r.tokens) - 1 for r in rows))
        tokens = np.zeros((len(rows), tree.size), dtype=np.int64)
        draft_len = np.zeros(len(rows), dtype=np.int64)
        for row, request in enumerate(rows):
            tokens[row, 0] = request.tokens[-1]
            proposal = request.proposer.next_tree
            if proposal is not None and request.gamma != 0:
                # the last pass's tree may have been a smaller prefix (less room then): verify what it proposed
                have = min(tree.size, len(proposal))
                tokens[row, 1:have] = proposal[1:have]
                cap = request.remaining - 1 if request.gamma == AUTO else min(request.gamma, request.remaining - 1)
                draft_len[row] = min(tree.nodes_within(cap), have - 1)
        typical = None
        if all(r.acceptance_rule == "typical" for r in rows):
            typical = tuple(np.array([r.typical[k] for r in rows], dtype=np.float32) for k in (0, 1))
        began = time.perf_counter()
        forbidden = self._tree_masks(rows, tokens, draft_len, tree)
        best, next_token, next_tree = self.target.verify_tree(tokens, draft_len, tree, typical, forbidden=forbidden)
        elapsed = (time.perf_counter() - began) * 1e3
        self.last_gamma = int(tree.depths[draft_len].max())
        for row, request in enumerate(rows):
            path = tree.path_to(int(best[row]))
            request.stats.verify_ms += elapsed
            request.stats.record_iteration(len(path), int(tree.depths[draft_len[row]]), request.proposer.name)
            request.stats.tree_nodes += int(draft_len[row])
            request.proposer.next_tree = next_tree[row]
            request.emit([*tokens[row, path], next_token[row]], self.eos_ids)

    def _eagle_tree_iteration(self, request: Request) -> None:
        """An EAGLE-3 head's dynamic tree (core/proposers/eagle_tree.py) for one request, verified by the
        target in one pass; the head then reads the features of the root and the accepted path. Where
        the head drafts none (out of step), a plain step."""
        began = time.perf_counter()
        sizing = self._tree_sizing(request, began)
        drafted = draft_tree(request.proposer.runner, request, request.proposer.shape, sizing=sizing)
        if drafted is None:
            self._plain_iteration([request], began)
            return
        tree, nodes, expected = drafted
        tokens = np.concatenate([[request.tokens[-1]], nodes])[None]
        verifying = time.perf_counter()
        before = self._lengths_before(0, 1)
        best, next_token = self.target.verify_eagle_tree(tokens, tree)
        done = time.perf_counter()
        path = tree.path_to(int(best[0]))
        if sizing is not None:
            self.tree_economy.observe(expected, len(path) - 1, (done - verifying) * 1e3, sizing.line_ms(tree.size))
        stats = request.stats
        stats.draft_ms += (verifying - began) * 1e3
        stats.verify_ms += (done - verifying) * 1e3
        stats.record_iteration(len(path), int(tree.max_depth), request.proposer.name)
        stats.tree_nodes += tree.size - 1
        request.emit([*tokens[0, path], next_token[0]], self.eos_ids)
        features = self.target.last_aux_hidden[:, [0, *path]]  # the kept positions', in order
        for runner in self.feature_readers:
            runner.after_target([request], 0, before, self.target.cache_lengths[:1].copy(), features)

    def _tree_sizing(self, request: Request, began: float) -> TreeSizing | None:
        """The loop's costs for sizing this request's dynamic tree (TreeSizing), as the γ policy of a
        request alone has measured them; None without a policy (the tree shape's own size)."""
        policy = self.policy_for(1, len(request.tokens)) if self.policy_for else None
        if policy is None:
            return None
        costs, economy = policy.costs_now(), self.tree_economy
        return TreeSizing(costs.verification_line(), economy.extra_ms, costs.overhead, economy.scale, began)

    def _tree_masks(self, rows: list[Request], tokens: np.ndarray, draft_len: np.ndarray, tree) -> np.ndarray | None:
        """[B, N, W]: the grammar's mask at each verified node of each constrained row, after the path
        to it (None when no row is constrained). A node whose path the grammar refuses keeps zeros:
        it cannot be accepted, since a refused token is never the masked target's choice."""
        if all(r.grammar is None for r in rows):
            return None
        forbidden = grammar_masks(len(rows), tree.size, self.target.vocab_size)
        for row, request in enumerate(rows):
            if request.grammar is None:
                continue
            for node in range(1 + int(draft_len[row])):
                mask = request.grammar.mask_after(list(tokens[row, tree.path_to(node)]) if node else [])
                if mask is not None:
                    words(forbidden[row])[node] = mask
        return forbidden

    # -- decoding: update -----------------------------------------------------------------------
    def update(self, plan: Plan, drafts: np.ndarray, proposed: np.ndarray, accepted: np.ndarray,
               next_token: np.ndarray, phase_ms: tuple[float, float]) -> None:
        """Each row's accepted drafts and the target's token go out; its statistics, its proposer and
        the γ policy learn from the iteration; the runners roll their caches back."""
        draft_ms, verify_ms = phase_ms
        for row, (request, offer) in enumerate(zip(plan.rows, plan.offers)):
            n, d = int(accepted[row]), int(drafts[row])
            request.stats.draft_ms += draft_ms
            request.stats.verify_ms += verify_ms
            offer.source.observe(request.stats, offer, d, n)
            if plan.policy is not None and request.gamma == AUTO and d and offer.source.learns_policy:
                plan.policy.observe(d, n)
            request.emit([*proposed[row, :n], next_token[row]], self.eos_ids, self._scores(plan.rows, row, n + 1))
        for runner in self.runners:
            runner.after_verify(plan.rows)

    # -- leaving ----------------------------------------------------------------------------------
    def _retire_cancelled(self) -> None:
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            request.finish("cancelled")
        if self.joining is not None and self.joining.cancelled:
            self.joining.finish("cancelled")
            self.joining = None
        self._retire(lambda r: r.cancelled, "cancelled")
        self._retire(lambda r: r.stop_keep is not None, "stop")  # a stop string found at the edge

    def _retire_finished(self) -> None:
        self._retire(lambda r: r.done or r.stop_keep is not None, "stop")

    def _retire(self, leaves: Callable[[Request], bool], reason: str) -> None:
        """Finished requests leave; the last decoding row moves into each freed slot (and the joining
        request, if any, moves down behind it), keeping the decoding rows packed at the front."""
        for slot in reversed(range(len(self.decoding))):
            request = self.decoding[slot]
            if not leaves(request):
                continue
            last = len(self.decoding) - 1
            if slot != last:
                self._move(last, slot)
                self.decoding[slot] = self.decoding[last]
            self.decoding.pop()
            if self.joining is not None:
                self._move(last + 1, last)
            request.finish(reason)
            self.proposer(request).finish(request)

    def _move(self, source: int, destination: int) -> None:
        self.target.move(source, destination)
        for runner in self.runners:
            runner.move(source, destination)

