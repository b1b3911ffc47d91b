"""Continuous batching: the request-level speculative engine, over the backend-free interface of
`engine.py`.

Requests arrive at any time (`add`) and wait in a queue. Each `step` is one iteration:
  1. cancelled requests leave;
  2. prefill: waiting requests join, a chunk of prompt at a time (below);
  3. one decoding iteration over every decoding request at once:
     a. γ for this iteration: the policy's choice for the current number of decoding requests and
        their mean context (its profile measured each batch size and context), capped per request
        by its own γ and by the tokens it still needs: rows may carry different numbers of drafts,
        and the verification takes each row's draft length;
     b. each row's proposer proposes (proposers.py): prompt lookup, or the draft model, one batched
        step at a time, a row stopping at a draft it is less sure of than its p_min; the draft's
        first step feeds each row the tokens it has not cached yet (normally [prev, last], more
        after plain iterations), and lookup rows are fed their own proposals;
     c. the target scores [last, d_1..d_γ] of every row in ONE verification pass whose SpecAccept
        keeps each row's longest agreeing prefix (n drafts), returns the target's own next token
        and rolls the target cache back (a length update); or, when γ is 0 for every row, one plain
        decoding step;
     d. d_1..d_n and the target's token are emitted; the draft cache is rolled back to match;
  4. finished requests leave at once; their slots are refilled by moving the last decoding row.

Slots. The caches have `max_batch` slots, allocated once. Decoding requests occupy slots
0..n-1 and every call runs on that prefix, so a step costs what the active requests need; a single
active request runs the single-sequence graphs. A request still being prefilled sits in slot n,
right after them, and joins the decoding batch (becoming slot n) when its prompt is in.

Prefill is chunked so that a joining request does not stall the running ones for long: while
requests are decoding, an iteration prefills at most `prefill_chunk` prompt tokens (one call per
joining request, at batch 1), so each iteration is delayed by at most one chunk's prefill; with no
request decoding, whole prompts are prefilled at once. A long prompt thus joins over several
iterations, each costing its decoding requests one chunk.

Invariant between iterations, per decoding request with history h (prompt + generated, last = h[-1]):
the target has cached h[:-1]; the draft has cached a prefix of h[:-1] (normally h[:-2]: its first
step re-reads [prev, last], which costs nothing extra and removes the special case where every
draft was accepted and the draft never saw d_γ).
"""

import time
from collections import deque
from collections.abc import Callable

import numpy as np

from speccompile.core.engine import DecoderEngine, VerifierEngine
from speccompile.core.gamma_policy import GammaPolicy
from speccompile.core.proposers import draft_rate, lookup_rate, lookup_source
from speccompile.core.request import AUTO, Request
from speccompile.core.tree import TokenTree

# (number of decoding requests, their mean context length) -> the γ policy for that load (None: no
# costs known yet). Context matters as much as load: every step grows with it, and a draft's
# acceptance can fall with it (a draft distilled on short sequences drafts poorly past them).
PolicyFor = Callable[[int, int], GammaPolicy | None]


class Scheduler:
    def __init__(self, target: VerifierEngine, draft: DecoderEngine | None, max_batch: int, max_seq: int,
                 gammas: list[int], eos_ids: set[int], policy_for: PolicyFor | None = None,
                 profiled: bool = False, prefill_chunk: int = 64, fallback_gamma: int | None = None,
                 tree: TokenTree | None = None):
        """profiled: the policies' costs were measured by a profile of this hardware, so the policy may
        choose plain decoding from the start; otherwise only once it has observed acceptance.
        fallback_gamma: what AUTO requests run while there is no policy (default: the largest γ).
        draft None: a draft-free bundle, whose requests all speculate with prompt lookup, or with
        `tree` a Medusa bundle's: every iteration is one tree verification (`_tree_iteration`), which
        the runtime may set or replace between iterations (it sizes the tree by measured cost, and
        `tree_nodes`, the prefix each batch size verifies)."""
        self.target, self.draft = target, draft
        self.max_batch, self.max_seq, self.gammas = max_batch, max_seq, sorted(gammas)
        self.eos_ids, self.policy_for, self.prefill_chunk = eos_ids, policy_for, prefill_chunk
        self.profiled = profiled
        self.fallback_gamma = max(self.gammas) if fallback_gamma is None else fallback_gamma
        self.waiting: deque[Request] = deque()  # appended by any thread; popped here only
        self.decoding: list[Request] = []  # slot i holds decoding[i]
        self.joining: Request | None = None  # partly prefilled, in slot len(decoding)
        self._started = False
        self.last_gamma = 0  # the γ of the last decoding iteration's verification (0: a plain step), for metrics
        self.tree = tree
        self.tree_nodes: dict[int, int] = {}  # decoding requests -> nodes of the tree's prefix they verify

    # -- the queue --------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        """Queue a request (thread-safe). Its γ and length must have been checked (see `fits`)."""
        assert self.fits(request), "request does not fit the caches: check it before adding it"
        self.waiting.append(request)

    def fits(self, request: Request) -> bool:
        """Every position a request can write, its longest verification included, is in the cache."""
        return len(request.prompt) + request.max_new_tokens + self.gamma_cap(request) <= self.max_seq

    def gamma_cap(self, request: Request) -> int:
        """The most drafts one of this request's iterations may carry: its own γ, or under AUTO the
        largest compiled γ that its length leaves room for (0 if none: it decodes plainly)."""
        if request.proposer == "medusa":  # a tree shrinks to the room its rows leave (_tree_iteration)
            return 0
        if request.gamma != AUTO:
            return request.gamma
        room = self.max_seq - len(request.prompt) - request.max_new_tokens
        return max([g for g in self.gammas if g <= room], default=0)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.decoding or self.joining)

    @property
    def active(self) -> int:
        return len(self.decoding) + (self.joining is not None)

    # -- one iteration ------------------------------------------------------------------------------
    def step(self) -> None:
        if not self._started:  # caches for every slot, once
            self.target.start(self.max_batch)
            if self.draft is not None:
                self.draft.start(self.max_batch)
            self._started = True
        self._retire_cancelled()
        self._prefill()
        if self.decoding:
            self._decode()
        self._retire_finished()

    def cancel_all(self) -> None:
        """Shutting down: every request in flight or waiting ends as cancelled."""
        self._end_all("cancelled")

    def fail_all(self, error: Exception) -> None:
        """A backend failure: every request in flight or waiting ends with it."""
        self._end_all("error", error)

    def _end_all(self, reason: str, error: Exception | None = None) -> None:
        for request in [*self.decoding, *([self.joining] if self.joining else []), *self.waiting]:
            request.finish(reason, error)
        self.decoding, self.joining = [], None
        self.waiting.clear()

    # -- prefill ----------------------------------------------------------------------------------
    def _prefill(self) -> None:
        budget = self.prefill_chunk if self.decoding else self.max_seq * self.max_batch
        while budget > 0:
            if self.joining is None:
                if not self.waiting or len(self.decoding) >= self.max_batch:
                    return
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
        self.target.cache_lengths[slot] = 0
        if self.draft is not None:
            self.draft.cache_lengths[slot] = 0
        self.joining = request

    def _prefill_chunk(self, request: Request, budget: int) -> int:
        """Prefill the next chunk of a joining request's prompt; its first token when complete."""
        slot, start = len(self.decoding), request.prefilled
        count = min(budget, len(request.prompt) - start)
        tokens = np.array([request.prompt[start : start + count]], dtype=np.int64)
        counts = np.array([count], dtype=np.int64)
        began = time.perf_counter()
        if request.gamma != 0 and self.draft is not None:  # the draft reads the prompt too (not a plain request)
            self.draft.forward(tokens, counts, first=slot)
        complete = start + count == len(request.prompt)
        if complete and not request.params.greedy:
            token, _ = self.target.forward_sample(tokens, counts, _params([request]), request.uniforms(1), first=slot)
        else:
            token = self.target.forward(tokens, counts, first=slot)
        request.prefilled += count
        if complete:
            request.emit(token, self.eos_ids)
            if self.draft is not None:
                self.draft.cache_lengths[slot] = min(self.draft.cache_lengths[slot], len(request.tokens) - 2)
        request.stats.prefill_ms += (time.perf_counter() - began) * 1e3
        return count

    # -- decoding ---------------------------------------------------------------------------------
    def _decode(self) -> None:
        rows = self.decoding
        if any(r.proposer == "medusa" and r.gamma != 0 for r in rows):
            self._tree_iteration(rows)
            return
        policy = None
        if self.policy_for and any(r.gamma == AUTO or r.proposer == "auto" for r in rows):
            policy = self.policy_for(len(rows), round(sum(len(r.tokens) for r in rows) / len(rows)))
        wanted = self._wanted_gamma(rows, policy)
        # None: the draft model drafts (compared at the drafts the row can still use)
        lookups = [self._lookup(r, min(int(w), r.remaining - 1), policy) for r, w in zip(rows, wanted)]
        sources = ["draft" if lk is None else lookup_source(r.ngram) for r, lk in zip(rows, lookups)]
        wanted = np.array([len(lk) if lk is not None else w for lk, w in zip(lookups, wanted)], dtype=np.int64)
        gamma = self._graph_gamma(rows, wanted)
        # A request near its end drafts only what it still needs (the target adds one token of its
        # own), but keeps the iteration's graph: switching graphs costs more than the padded slots.
        drafts = np.minimum(wanted, gamma)
        drafts = np.minimum(drafts, np.array([r.remaining - 1 for r in rows], dtype=np.int64))
        gamma = self.last_gamma = gamma if drafts.max() > 0 else 0
        began = time.perf_counter()
        if gamma == 0:
            self._plain_iteration(rows, began)
            return
        proposed, probs, drafts = self._propose(rows, drafts, lookups)
        if drafts.max() == 0:  # every row stopped before its first draft: a plain step is cheaper
            self.last_gamma = 0
            self._plain_iteration(rows, began)
            return
        gamma = self.last_gamma = min(g for g in self.gammas if g >= drafts.max())  # fewer drafts: a shorter one
        drafted = time.perf_counter()
        accepted, next_token = self._verify(rows, drafts, gamma, proposed, probs, lookups)
        verified = time.perf_counter()
        draft_ms, verify_ms = (drafted - began) * 1e3, (verified - drafted) * 1e3
        if policy is not None and drafts.max() == gamma and all(lk is None for lk in lookups):
            policy.observe_costs(gamma, draft_ms, verify_ms)
        self._emit_verified(rows, lookups, sources, proposed, drafts, accepted, next_token, policy,
                            (draft_ms, verify_ms))

    def _emit_verified(self, rows, lookups, sources, proposed, drafts, accepted, next_token, policy,
                       phase_ms: tuple[float, float]) -> None:
        """Each row's accepted drafts and the target's token go out; its statistics, its acceptance
        per proposer and the γ policy learn from the iteration; the draft's cache is rolled back."""
        draft_ms, verify_ms = phase_ms
        for row, (request, lookup) in enumerate(zip(rows, lookups)):
            n, d = int(accepted[row]), int(drafts[row])
            request.stats.draft_ms += draft_ms
            request.stats.verify_ms += verify_ms
            request.stats.record_iteration(n, d, "draft" if lookup is None else "ngram")
            if d:
                request.acceptance[sources[row]].observe(d, n)
            if d and lookup is not None:
                request.stats.record_lookup(sources[row][1], d, n)
            if policy is not None and request.gamma == AUTO and d and lookup is None:
                policy.observe(d, n)
            request.emit([*proposed[row, :n], next_token[row]], self.eos_ids)
        # the draft keeps what it cached of the accepted tokens, re-reading the last two next time
        if self.draft is not None:
            lengths = np.array([len(r.tokens) for r in rows], dtype=np.int64)
            self.draft.cache_lengths[: len(rows)] = np.minimum(self.draft.cache_lengths[: len(rows)], lengths - 2)

    def _tree_iteration(self, rows: list[Request]) -> None:
        """Medusa: one target pass verifies each row's token tree (the heads' proposal of the last
        pass, rooted at its last token) and returns the next one. A row's first iteration, with no
        proposal yet, and a plain row (γ 0) verify the root alone: a plain step that also reads the
        heads. A row verifies the prefix of the tree at depths up to its γ and the tokens it still
        needs; typical acceptance applies when every row asked for it. Heads propose nothing the
        target has not verified, so a tree never needs room reserved: it shrinks near the end."""
        assert self.tree is not None, "Medusa requests need the runtime's token tree"
        # a tree writes all its nodes: near the cache's end, its first nodes (a tree too) only
        room = self.max_seq - max(len(r.tokens) - 1 for r in rows)
        size = min(room, self.tree_nodes.get(len(rows), self.tree.size))  # a batch may verify a smaller prefix
        tree = self.tree.prefix(size)
        tokens = np.zeros((len(rows), tree.size), dtype=np.int64)
        draft_len = np.zeros(len(rows), dtype=np.int64)
        for row, request in enumerate(rows):
            tokens[row, 0] = request.tokens[-1]
            if request.next_tree is not None and request.gamma != 0:
                # the last pass's tree may have been a smaller prefix (less room then): verify what it proposed
                have = min(tree.size, len(request.next_tree))
                tokens[row, 1:have] = request.next_tree[1:have]
                cap = request.remaining - 1 if request.gamma == AUTO else min(request.gamma, request.remaining - 1)
                draft_len[row] = min(tree.nodes_within(cap), have - 1)
        typical = None
        if all(r.acceptance_rule == "typical" for r in rows):
            typical = tuple(np.array([r.typical[k] for r in rows], dtype=np.float32) for k in (0, 1))
        began = time.perf_counter()
        best, next_token, next_tree = self.target.verify_tree(tokens, draft_len, tree, typical)
        elapsed = (time.perf_counter() - began) * 1e3
        self.last_gamma = int(tree.depths[draft_len].max())
        for row, request in enumerate(rows):
            path = tree.path_to(int(best[row]))
            request.stats.verify_ms += elapsed
            request.stats.record_iteration(len(path), int(tree.depths[draft_len[row]]), "medusa")
            request.stats.tree_nodes += int(draft_len[row])
            request.next_tree = next_tree[row]
            request.emit([*tokens[row, path], next_token[row]], self.eos_ids)

    def _lookup(self, request: Request, wanted: int, policy: GammaPolicy | None) -> list[int] | None:
        """A request's prompt-lookup proposal this iteration (as many as its γ allows), or None when
        the draft model drafts for it: always under "draft"; under "auto" when lookup finds nothing,
        or when the draft model's predicted rate is the better one (see proposers.py)."""
        if request.proposer == "draft" or request.gamma == 0:
            return None
        cap = min(self.gamma_cap(request), request.remaining - 1)
        lookup = request.ngram.propose(request.tokens, cap)
        if request.proposer == "ngram" or self.draft is None:
            return lookup
        if not lookup:
            return None
        costs = policy.costs if policy is not None else None
        ours = lookup_rate(costs, request.acceptance[lookup_source(request.ngram)].by_position(len(lookup)),
                           len(lookup))
        if wanted == 0:  # the draft model would not draft: lookup against plain decoding
            return lookup if costs is None or ours > 1 / costs.target_step else None
        theirs_by_position = (policy.acceptance_by_position(wanted) if policy is not None and request.gamma == AUTO
                              else request.acceptance["draft"].by_position(wanted))
        return lookup if ours >= draft_rate(costs, theirs_by_position, wanted) else None

    def _wanted_gamma(self, rows: list[Request], policy: GammaPolicy | None) -> np.ndarray:
        """The drafts each row asks for this iteration: its own γ, or under AUTO the policy's choice
        for the current load, capped by the room its length leaves."""
        chosen = self.fallback_gamma
        if policy is not None:
            allow_plain = all(r.allow_plain for r in rows if r.gamma == AUTO)
            chosen = policy.choose(allow_zero=allow_plain and (self.profiled or policy.iterations > 0))
        return np.array([min(chosen, self.gamma_cap(r)) if r.gamma == AUTO else r.gamma for r in rows],
                        dtype=np.int64)

    def _graph_gamma(self, rows: list[Request], wanted: np.ndarray) -> int:
        """The compiled γ whose verification graph runs: the smallest that holds every row's wanted
        drafts, and whose padded positions stay inside every row's cache."""
        longest = int(wanted.max())
        if longest == 0:
            return 0
        room = self.max_seq - max(len(r.tokens) for r in rows)  # writes reach position len + γ - 1
        fitting = [g for g in self.gammas if g <= room]
        covering = [g for g in fitting if g >= longest]
        return min(covering) if covering else max(fitting, default=0)

    def _plain_iteration(self, rows: list[Request], began: float) -> None:
        """One plain decoding step of every row, its time (since `began`) counted as decoding."""
        self._plain_step(rows)
        elapsed = (time.perf_counter() - began) * 1e3
        for request in rows:
            request.stats.decode_ms += elapsed
            request.stats.record_iteration(0, 0)

    def _plain_step(self, rows: list[Request]) -> None:
        last = np.array([[r.tokens[-1]] for r in rows], dtype=np.int64)
        one = np.ones(len(rows), dtype=np.int64)
        if all(r.params.greedy for r in rows):
            next_token = self.target.forward(last, one)
        else:
            next_token, _ = self.target.forward_sample(last, one, _params(rows), _uniforms(rows, 1)[:, 0])
        for row, request in enumerate(rows):
            request.emit([next_token[row]], self.eos_ids)

    def _propose(self, rows: list[Request], drafts: np.ndarray, lookups: list[list[int] | None]):
        """Every row's proposals, tokens [B, max(drafts)], and, when sampling, the distributions
        [B, max, V] the draft model drew its rows' from (None where no row drew any). Lookup rows
        propose their lookup; the draft model runs max(its rows' drafts) batched steps over every
        row, and is fed the lookup rows' proposals as their inputs, so that its cache holds their
        tokens too (the rollback keeps what was accepted). A row's proposals past its own count are
        never verified, and never draw from its random stream.

        Confidence thresholding: a draft-model row stops drafting at the first token the draft gives
        a probability below the request's p_min (that token is not proposed), and the steps stop
        once no row drafts on. Returns (proposed, probs, drafts: each row's count after stopping)."""
        drafts = drafts.copy()
        proposed = np.zeros((len(rows), int(drafts.max())), dtype=np.int64)
        for row, lookup in enumerate(lookups):
            if lookup is not None:
                proposed[row, : len(lookup)] = lookup
        steps = max((int(d) for d, lk in zip(drafts, lookups) if lk is None), default=0)
        if steps == 0:
            return proposed, None, drafts
        sampling = not all(r.params.greedy for r in rows)
        params = _params(rows) if sampling else None
        self._catch_up(rows)
        lengths = self.draft.cache_lengths[: len(rows)]
        tokens, counts = _pad([r.tokens[length:] for r, length in zip(rows, lengths)])
        p_min = np.array([r.p_min for r in rows], dtype=np.float32)
        probs_out = []
        for k in range(steps):
            drafting = [lk is None and k < d for d, lk in zip(drafts, lookups)]
            if not any(drafting):  # every draft-model row stopped below its p_min
                break
            if sampling:
                u = np.array([r.uniforms(1)[0] if on and r.rng is not None else 0.5 for r, on in zip(rows, drafting)],
                             dtype=np.float32)
                token, probs = self.draft.forward_sample(tokens, counts, params, u)
                confidence = probs[np.arange(len(rows)), token]
                probs_out.append(probs)
            else:
                token, confidence = self.draft.forward_confident(tokens, counts)
            for row, lookup in enumerate(lookups):
                if drafting[row] and confidence[row] < p_min[row]:
                    drafts[row] = k
                elif drafting[row]:
                    proposed[row, k] = token[row]
                elif lookup is not None and k < len(lookup):
                    token[row] = lookup[k]
            tokens, counts = token[:, None], np.ones(len(rows), dtype=np.int64)
        return proposed, (np.stack(probs_out, axis=1) if sampling else None), drafts

    def _catch_up(self, rows: list[Request]) -> None:
        """Feed the draft what it missed (after plain iterations) in chunks, until every row lacks
        at most its last two tokens; chunks are sized so that no row's padded write leaves the cache."""
        while True:
            lengths = self.draft.cache_lengths[: len(rows)]
            behind = [max(0, len(r.tokens) - 2 - int(length)) for r, length in zip(rows, lengths)]
            if not any(behind):
                return
            size = min(max(behind), self.max_seq - int(lengths.max()))
            self.draft.forward(*_pad([r.tokens[int(length) : int(length) + min(b, size)]
                                      for r, length, b in zip(rows, lengths, behind)]))

    def _verify(self, rows: list[Request], drafts: np.ndarray, gamma: int, proposed: np.ndarray, probs, lookups):
        candidates = np.zeros((len(rows), gamma + 1), dtype=np.int64)
        candidates[:, 0] = [r.tokens[-1] for r in rows]
        width = min(gamma, proposed.shape[1])
        candidates[:, 1 : width + 1] = proposed[:, :width]
        if all(r.params.greedy for r in rows):
            return self.target.verify(candidates, drafts)
        vocab = probs.shape[2] if probs is not None else self.target.vocab_size
        q = np.zeros((len(rows), gamma, vocab), dtype=np.float32)
        if probs is not None:
            q[:, : min(width, probs.shape[1])] = probs[:, :width]
        for row, lookup in enumerate(lookups):  # a lookup proposal is a point mass
            if lookup is not None:
                q[row, :width] = 0.0
                q[row, np.arange(len(lookup[:width])), lookup[:width]] = 1.0
        u_accept = np.full((len(rows), gamma), 0.5, dtype=np.float32)
        for row, (request, d) in enumerate(zip(rows, drafts)):
            if request.rng is not None:
                u_accept[row, :d] = request.uniforms(int(d))
        return self.target.verify_sample(candidates, drafts, q, _params(rows), u_accept, _uniforms(rows, 1)[:, 0])

    # -- leaving ----------------------------------------------------------------------------------
    def _retire_cancelled(self) -> None:
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            request.finish("cancelled")
        if self.joining is not None and self.joining.cancelled:
            self.joining.finish("cancelled")
            self.joining = None
        self._retire(lambda r: r.cancelled, "cancelled")

    def _retire_finished(self) -> None:
        self._retire(lambda r: r.done, "stop")

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

    def _move(self, source: int, destination: int) -> None:
        self.target.move(source, destination)
        if self.draft is not None:
            self.draft.move(source, destination)


def _pad(token_lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad token lists into [B, T_max] (T_max >= 1); returns (ids, counts)."""
    counts = np.array([len(t) for t in token_lists], dtype=np.int64)
    ids = np.zeros((len(token_lists), max(1, int(counts.max()))), dtype=np.int64)
    for row, tokens in enumerate(token_lists):
        ids[row, : len(tokens)] = tokens
    return ids, counts


def _params(rows: list[Request]) -> dict:
    """The sampling graphs' per-row controls (greedy rows: temperature 0, i.e. one-hot)."""
    return {"temperature": np.array([r.params.temperature for r in rows], dtype=np.float32),
            "top_k": np.array([r.params.top_k for r in rows], dtype=np.int64),
            "top_p": np.array([r.params.top_p for r in rows], dtype=np.float32)}


def _uniforms(rows: list[Request], count: int) -> np.ndarray:
    """[B, count]: each sampling row's next draws from its own stream; greedy rows draw nothing."""
    return np.stack([r.uniforms(count) if r.rng is not None else np.full(count, 0.5, dtype=np.float32) for r in rows])
