"""Per-sequence generation statistics, defined once for `generate`, `bench` and `profile`.

Counts are each request's own. Times: the requests decoding together share each iteration, so
every iteration's draft, verification or decode time is added to each of them; prefill time is a
request's own. total_ms runs from submission (queueing included) to its last token, so a request
that stops early at EOS reports its own latency, and tokens_per_s is the rate at which it received
its tokens.
"""

from dataclasses import dataclass, field


@dataclass
class GenerationStats:
    mode: str  # the loop that ran: "speculative" or "autoregressive"
    gamma: int | str  # the γ asked for: one the bundle verifies at, "auto" (see gammas_used), or 0 for plain decoding
    new_tokens: int = 0
    iterations: int = 0  # target passes after prefill: verifications, or plain decode steps
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)  # accepted_at[k]: iterations whose draft k+1 was kept
    drafted_at: list[int] = field(default_factory=list)  # drafted_at[k]: iterations that proposed a draft k+1
    gammas_used: dict[int, int] = field(default_factory=dict)  # γ -> iterations run at it
    # proposer ("draft", "ngram", "medusa") -> [iterations it proposed in, drafts proposed, drafts accepted]
    by_proposer: dict[str, list[int]] = field(default_factory=dict)
    # prompt lookup by matched suffix length n -> [draft positions reached, drafts kept]: their
    # ratio is the conditional rate at which its drafts are kept (what `profile` seeds "auto" with)
    lookup_by_match: dict[int, list[int]] = field(default_factory=dict)
    tree_nodes: int = 0  # Medusa: tree nodes verified, the root excluded (draft_tokens counts their depth)
    acceptance: str = "exact"  # "typical": approximate acceptance was asked for; the output may not be the target's
    prefill_ms: float = 0.0
    draft_ms: float = 0.0  # speculative phases
    verify_ms: float = 0.0
    decode_ms: float = 0.0  # autoregressive phase: the target's decode steps
    total_ms: float = 0.0  # from submission (queueing included) to the last token
    ttft_ms: float = 0.0  # from submission to the first token
    queue_ms: float = 0.0  # from submission to the start of its prefill (waiting for a slot)
    grammar_ms: float = 0.0  # a constrained request's masks, commits and rollbacks (inside the phases above)
    # the time between each delivery of tokens and the one before (several tokens arrive at once after
    # a verification): vLLM's inter-token latencies, one per engine output after the first
    gaps_ms: list[float] = field(default_factory=list)

    def record_iteration(self, accepted: int, gamma: int, proposer: str | None = None) -> None:
        """One verification that checked `gamma` drafts, from `proposer`, and kept the first `accepted`."""
        self.iterations += 1
        self.draft_tokens += gamma
        self.accepted_tokens += accepted
        self.gammas_used[gamma] = self.gammas_used.get(gamma, 0) + 1
        if proposer is not None and gamma:
            counts = self.by_proposer.setdefault(proposer, [0, 0, 0])
            counts[0], counts[1], counts[2] = counts[0] + 1, counts[1] + gamma, counts[2] + accepted
        for counts in (self.accepted_at, self.drafted_at):
            counts.extend([0] * (gamma - len(counts)))
        for k in range(gamma):
            self.drafted_at[k] += 1
            self.accepted_at[k] += k < accepted

    def record_lookup(self, matched: int, drafts: int, accepted: int) -> None:
        """A lookup iteration's drafts, from a suffix of `matched` tokens: positions 1..accepted+1 reached."""
        counts = self.lookup_by_match.setdefault(matched, [0, 0])
        counts[0], counts[1] = counts[0] + min(accepted + 1, drafts), counts[1] + accepted

    @property
    def auto_chose_plain(self) -> bool:
        """gamma "auto" judged that speculation does not pay here and decoded with the target alone."""
        return self.mode == "autoregressive" and self.gamma == "auto"

    @property
    def mean_gamma(self) -> float:
        """Drafts proposed per verification: the γ used, averaged over iterations (it varies under "auto")."""
        return self.draft_tokens / self.iterations if self.iterations else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed drafts."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_drafts(self) -> float:
        """Drafts kept per verification (0..γ)."""
        return self.accepted_tokens / self.iterations if self.iterations else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification, 1 + accepted/verifications: the kept drafts plus the
        target's own token. This is vLLM's, TensorRT-LLM's and SGLang's "mean acceptance length"."""
        return 1.0 + self.mean_accepted_drafts if self.iterations else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """P_k for k = 1.., index k-1: the share of the iterations that proposed a draft k in which
        drafts 1..k were all kept. Iterations at a shorter γ never proposed draft k and do not count;
        this is the P_k of cost_model.expected_tokens."""
        return [accepted / drafted for accepted, drafted in zip(self.accepted_at, self.drafted_at)]

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / (self.total_ms / 1e3) if self.total_ms else 0.0

    def to_dict(self) -> dict:
        """Every count and rate; of the phase times, only those of the loop that ran."""
        phases = {"prefill_ms": self.prefill_ms}
        if self.mode == "speculative":
            phases.update(draft_ms=self.draft_ms, verify_ms=self.verify_ms)
        else:
            phases.update(decode_ms=self.decode_ms)
        return {
            "mode": self.mode,
            "gamma": self.gamma,
            "auto_chose_plain": self.auto_chose_plain,
            "gammas_used": self.gammas_used,
            "mean_gamma": self.mean_gamma,
            "new_tokens": self.new_tokens,
            "iterations": self.iterations,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_drafts": self.mean_accepted_drafts,
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_by_position": self.acceptance_by_position,
            "acceptance": self.acceptance,
            "tree_nodes": self.tree_nodes,
            "by_proposer": {name: {"iterations": n, "draft_tokens": drafted, "accepted_tokens": kept,
                                   "acceptance_rate": kept / drafted}
                            for name, (n, drafted, kept) in self.by_proposer.items()},
            **phases,
            **({"grammar_ms": self.grammar_ms} if self.grammar_ms else {}),
            "total_ms": self.total_ms,
            "ttft_ms": self.ttft_ms,
            "tokens_per_s": self.tokens_per_s,
        }


def pooled(stats: list[GenerationStats]) -> GenerationStats:
    """The statistics of several runs taken together (counts and times summed): for runs made one
    after another, such as bench's batch-1 calls. Rows of one batch share their clocks, so their
    summed times would count the same milliseconds more than once."""
    total = GenerationStats(stats[0].mode if stats else "speculative", stats[0].gamma if stats else 0)
    for s in stats:
        total.acceptance = stats[0].acceptance if stats else "exact"
        for name in ("new_tokens", "iterations", "draft_tokens", "accepted_tokens", "tree_nodes", "prefill_ms",
                     "draft_ms", "verify_ms", "decode_ms", "total_ms", "grammar_ms"):
            setattr(total, name, getattr(total, name) + getattr(s, name))
        for mine, theirs in ((total.accepted_at, s.accepted_at), (total.drafted_at, s.drafted_at)):
            mine.extend([0] * (len(theirs) - len(mine)))
            for k, count in enumerate(theirs):
                mine[k] += count
        for g, n in s.gammas_used.items():
            total.gammas_used[g] = total.gammas_used.get(g, 0) + n
        for name, counts in s.by_proposer.items():
            total.by_proposer[name] = [a + b for a, b in zip(total.by_proposer.get(name, [0, 0, 0]), counts)]
        for n, counts in s.lookup_by_match.items():
            total.lookup_by_match[n] = [a + b for a, b in zip(total.lookup_by_match.get(n, [0, 0]), counts)]
    return total

