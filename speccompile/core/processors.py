"""Logits processors: what changes a request's next-token distribution besides temperature, top-k and
top-p, the OpenAI and vLLM parameters. Here: the per-request controls and state, the graph inputs a
batch feeds (the graphs apply them: compiler/logits.py), and the numpy reference of what they do.

Every processor changes the target's distribution the same way at a drafted position as it would when
decoding one token at a time (its counts include the drafts before that position), and the draft
model's proposal the same way, so speculation keeps the output exactly the processed target's: greedy
identical to autoregressive decoding, sampled from the processed distribution.

A grammar (core/grammar.py) rides along: its masks are one more input of the same graphs' processing,
with the same rule: each position masked by the grammar's state after the tokens before it.

  presence_penalty   -p for every token generated at least once          (OpenAI; -2..2)
  frequency_penalty  -f × the times a token was generated                (OpenAI; -2..2)
  repetition_penalty logit / r if positive, × r if not, for tokens in the prompt or generated
                     (HF's and vLLM's; r > 0, 1 off)
  logit_bias         + bias[token]                                        (OpenAI; -100..100)
  min_tokens         EOS and the stop tokens cannot be chosen before this many tokens  (vLLM's)
  min_p              after temperature, top-k and top-p: tokens below min_p × the most likely one's
                     probability are dropped (vLLM's and HF's; sampling only: greedy keeps its argmax)
"""

from dataclasses import dataclass, field

import numpy as np

from speccompile.errors import SpecCompileError

NEG_INF = np.finfo(np.float32).min  # what a banned token's logit becomes (compiler/logits.NEG_INF)


@dataclass(frozen=True)
class Processors:
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0
    min_p: float = 0.0

    def __post_init__(self):
        for name, low, high in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2), ("min_p", 0, 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
                raise SpecCompileError(f"{name} must be a number in [{low}, {high}], got {value!r}")
        if isinstance(self.repetition_penalty, bool) or not self.repetition_penalty > 0:
            raise SpecCompileError(f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty!r}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise SpecCompileError(f"min_tokens must be a non-negative integer, got {self.min_tokens!r}")
        for token, bias in self.logit_bias:
            if not -100 <= bias <= 100:
                raise SpecCompileError(f"logit_bias of token {token} must be in [-100, 100], got {bias}")

    @property
    def active(self) -> bool:
        return self != Processors()


@dataclass
class ProcessorState:
    """One request's processors and what they count: each token's times generated (`counts`) and
    whether it is in the prompt or generated (`seen`), over the vocabulary."""

    processors: Processors
    counts: np.ndarray
    seen: np.ndarray
    bias: np.ndarray
    banned: np.ndarray = field(repr=False)

    @classmethod
    def start(cls, processors: Processors, prompt: list[int], vocab: int, stop_ids) -> "ProcessorState":
        bias = np.zeros(vocab, np.float32)
        for token, value in processors.logit_bias:
            if not 0 <= token < vocab:
                raise SpecCompileError(f"logit_bias names token {token}, outside the vocabulary (0..{vocab - 1})")
            bias[token] = value
        seen = np.zeros(vocab, np.float32)
        seen[prompt] = 1.0
        banned = np.zeros(vocab, np.float32)
        banned[[t for t in stop_ids if 0 <= t < vocab]] = 1.0
        return cls(processors, np.zeros(vocab, np.float32), seen, bias, banned)

    def observe(self, tokens: list[int]) -> None:
        """Tokens generated (kept)."""
        np.add.at(self.counts, tokens, 1.0)
        self.seen[tokens] = 1.0

    def penalties(self) -> list[float]:
        p = self.processors
        return [p.presence_penalty, p.frequency_penalty, p.repetition_penalty - 1.0, p.min_p]


def processing_inputs(rows: list, vocab: int, offset: int = 0, drafted: list | None = None,
                      positions: int = 1) -> dict | None:
    """The processors' graph inputs for a batch of requests (None when none of them processes or is
    constrained): offset: the output position the call's first scored position predicts, after each
    row's generated tokens (a draft step k: k). A grammar's masks (`forbidden` [B, positions, W],
    core/grammar.py) are for the call's scored positions: after each row's `drafted` tokens 1..r
    (a verification), or at its committed state (one position). Each part has its switch (`process`,
    `constrain`); a part that is off is left out, and the engine feeds its inputs' zeros."""
    states = [r.processing for r in rows]
    processing, constrained = any(s is not None for s in states), any(r.grammar is not None for r in rows)
    if not (processing or constrained):
        return None
    batch = len(rows)
    inputs = {"process": np.array(processing), "constrain": np.array(constrained)}
    if constrained:
        inputs["forbidden"] = grammar_masks(batch, positions, vocab)
        for row, request in enumerate(rows):
            if request.grammar is not None:
                request.grammar.masks(drafted[row] if drafted is not None else (), words(inputs["forbidden"][row]))
    if not processing:
        return inputs
    inputs |= {"penalties": np.zeros((batch, 4), np.float32), "ban_until": np.zeros(batch, np.int64),
               **{name: np.zeros((batch, vocab), np.float32) for name in ("counts", "seen", "logit_bias", "banned")}}
    for row, (request, state) in enumerate(zip(rows, states)):
        if state is None:
            continue
        inputs["penalties"][row] = state.penalties()
        inputs["counts"][row], inputs["seen"][row] = state.counts, state.seen
        inputs["logit_bias"][row], inputs["banned"][row] = state.bias, state.banned
        inputs["ban_until"][row] = state.processors.min_tokens - len(request.generated) - offset
    return inputs


def grammar_masks(batch: int, positions: int, vocab: int) -> np.ndarray:
    """Unconstrained grammar masks as the graphs take them: uint8 [B, positions, 4 ceil(V/32)], the
    bytes of core/grammar.py's int32 bitmask words (see `words`)."""
    return np.zeros((batch, positions, 4 * ((vocab + 31) // 32)), np.uint8)


def words(masks: np.ndarray) -> np.ndarray:
    """The int32 words a grammar writes its masks in, over the same memory as the graphs' bytes."""
    return masks.view(np.int32)


def add_drafted(inputs: dict | None, tokens: np.ndarray, drafting) -> None:
    """A draft step fed `tokens` [B] (rows where `drafting`): the next step counts them."""
    if inputs is None or not inputs["process"]:
        return
    rows = np.flatnonzero(drafting)
    inputs["counts"][rows, tokens[rows]] += 1.0
    inputs["seen"][rows, tokens[rows]] = 1.0
    inputs["ban_until"] -= 1


def constrain_next(inputs: dict | None, requests: list, proposed: np.ndarray, counts) -> None:
    """The draft model's next step: each constrained row's mask after its first counts[row] proposals
    (proposed [B, ≥ count]); a row that proposes no more is left unconstrained (its token is not read)."""
    if inputs is None or not inputs["constrain"]:
        return
    for row, (request, count) in enumerate(zip(requests, counts)):
        if request.grammar is None:
            continue
        mask = request.grammar.mask_after(list(proposed[row, :count])) if count is not None else None
        words(inputs["forbidden"][row])[0] = 0 if mask is None else mask


def reference(logits: np.ndarray, state: ProcessorState, generated: int, drafts=()) -> np.ndarray:
    """The numpy reference of the graphs' processing of one request's logits [R, V] at R positions,
    position r predicting output position `generated` + r, after the drafts d_1..d_r (drafts[:r])."""
    p = state.processors
    out = np.array(logits, np.float32, copy=True)
    for r in range(len(out)):
        counts, seen = state.counts.copy(), state.seen.copy()
        for token in list(drafts)[:r]:
            counts[token] += 1.0
            seen[token] = 1.0
        z = out[r]
        z[:] = np.where(seen > 0, np.where(z > 0, z / np.float32(p.repetition_penalty),
                                           z * np.float32(p.repetition_penalty)), z)
        z -= np.float32(p.frequency_penalty) * counts + np.float32(p.presence_penalty) * np.minimum(counts, 1.0)
        z += state.bias
        if generated + r < p.min_tokens:
            z[state.banned > 0] = NEG_INF
    return out


def min_p_reference(probs: np.ndarray, min_p: float) -> np.ndarray:
    """Drop what is below min_p × each row's largest probability; renormalise (last axis)."""
    kept = np.where(probs >= np.float32(min_p) * probs.max(-1, keepdims=True), probs, 0.0).astype(np.float32)
    return kept / kept.sum(-1, keepdims=True)
