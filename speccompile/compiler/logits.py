"""What a model's logits go through before a token is chosen (the logits processors), and the
log-probabilities a request may ask for; both in the graph, both switched by a scalar input so that a
call that needs neither pays for neither (an If whose other branch passes the logits through, or
yields zeros). The numpy reference of both is `core/processors.py`; tests hold these to it.

Processing (the `process` input), on logits z [B, R, V] at R positions (a verification's γ+1, or 1):
  repetition   z / r where z > 0, z · r where not, for tokens in the prompt or output  (penalties[:, 2] = r - 1)
  frequency    z - f · c   with c a token's count among the output tokens                (penalties[:, 1])
  presence     z - p · [c > 0]                                                         (penalties[:, 0])
  logit_bias   z + bias
  min_tokens   z = -inf for the `banned` tokens (EOS and stop tokens) at positions r < ban_until
  min_p        after temperature, top-k and top-p: drop tokens below min_p × the largest probability,
               renormalise (penalties[:, 3]; sampling only: greedy decoding keeps its argmax)
  grammar      (its own If, on `constrain`) z + NEG_INF/2 for the tokens a request's grammar forbids at
               position r: `forbidden` [B, R, 4·ceil(V/32)] uint8, the bytes of int32 bitmask words (bit
               t % 32 of word t // 32, core/grammar.py), unpacked by a 256-entry table
Position r of a verification predicts the token after its input r, so its counts and seen tokens are
the fed ones (`counts`, `seen`: everything generated so far) plus the drafts d_1..d_r before it: the
draft-dependent part is a cumulative sum in the graph, and every drafted position is scored under the
penalties of the tokens before it, exactly as decoding one token at a time would. Every input's zero
is "off", so the session graph's zero defaults disable all of them.

Log-probabilities (the `want_logprobs` input): at each position, the log-probability of the token
emitted there (a kept draft, the correction or the bonus token: `emitted`) and the K most likely
tokens with theirs, under the distribution the token was drawn from: the processed logits after
temperature, top-k, top-p and min_p when sampling, their log-softmax when greedy. K = TOP_LOGPROBS,
a build-time constant (TensorRT's TopK takes no other K). A few numbers per position reach the host.
A prompt is scored (`prompt_scores`) under the model's own distribution: the log-softmax of its logits.
"""

import numpy as np
import onnx

from speccompile.bundle import TOP_LOGPROBS
from speccompile.compiler.onnx_graph import BOOL, FLOAT, INT32, INT64, UINT8

NEG_INF = float(np.finfo(np.float32).min)  # a banned token's logit: exp gives 0, argmax never picks it
PROCESS_INPUTS = ("process", "penalties", "counts", "seen", "logit_bias", "banned", "ban_until", "constrain",
                  "forbidden")
LOGPROB_INPUTS = ("want_logprobs",)


def processed(g, logits: str, vocab: int, drafts: str | None = None, vocab_ids: str | None = None,
              single: bool = False, positions: int | str = 1) -> str:
    """logits [B, R, V'] (single: [B, V'], one position) after the processors (an If on `process`,
    whose other branch passes them through), then the grammar's mask (an If on `constrain`). drafts
    [B, R-1]: the drafted input tokens before positions 1..R-1 (a verification), or None (R = 1).
    vocab_ids: the scored subset of a cut draft head (its V' columns of the [B, V] inputs).
    positions: R, as the grammar mask's shape declares it."""
    process = g.input("process", BOOL, [])
    then = g.branch("process")
    z = _penalised(then, then.op("Unsqueeze", logits, then.const([1])) if single else logits, vocab, drafts, vocab_ids)
    z = then.op("Squeeze", z, then.const([1])) if single else z
    keep = g.branch("keep")
    penalised = g.op("If", process, then_branch=then.graph([(z, FLOAT)]),
                     else_branch=keep.graph([(keep.op("Identity", logits), FLOAT)]))
    return constrained(g, penalised, vocab, positions, vocab_ids, single)


def _penalised(b, z: str, vocab: int, drafts: str | None, vocab_ids: str | None) -> str:
    penalties = b.input("penalties", FLOAT, ["batch", 4])
    presence, frequency, repetition = (_per_row(b, b.op("Gather", penalties, b.const(k), axis=1)) for k in range(3))
    columns = _columns(b, vocab_ids)
    counts = columns(b.input("counts", FLOAT, ["batch", vocab]))  # [B, 1, V']
    seen = columns(b.input("seen", FLOAT, ["batch", vocab]))
    if drafts is not None:  # each position also counts the drafts before it
        token_ids = vocab_ids or b.op("Range", b.const(0), b.const(vocab), b.const(1))
        one_hot = b.op("Cast", b.op("Equal", b.op("Unsqueeze", drafts, b.const([2])), token_ids), to=FLOAT)
        before = b.op("CumSum", one_hot, b.const(1))  # [B, R-1, V']: drafts 1..r
        before = b.op("Pad", before, b.const([0, 1, 0, 0, 0, 0]))  # position 0 has none before it
        counts = b.op("Add", counts, before)
        seen = b.op("Max", seen, b.op("Min", before, b.const(1.0, np.float32)))
    scale = b.op("Add", repetition, b.const(1.0, np.float32))
    positive = b.op("Greater", z, b.const(0.0, np.float32))
    repeated = b.op("Where", positive, b.op("Div", z, scale), b.op("Mul", z, scale))
    z = b.op("Where", b.op("Greater", seen, b.const(0.0, np.float32)), repeated, z)
    z = b.op("Sub", z, b.op("Mul", frequency, counts))
    z = b.op("Sub", z, b.op("Mul", presence, b.op("Min", counts, b.const(1.0, np.float32))))
    z = b.op("Add", z, columns(b.input("logit_bias", FLOAT, ["batch", vocab])))
    banned = b.op("Greater", columns(b.input("banned", FLOAT, ["batch", vocab])), b.const(0.0, np.float32))
    ban_until = b.op("Unsqueeze", b.input("ban_until", INT64, ["batch"]), b.const([1, 2]))  # [B, 1, 1]
    positions = b.op("Unsqueeze", b.op("Range", b.const(0), b.op("Squeeze", b.op("Shape", z, start=1, end=2),
                                                                   b.const([0])), b.const(1)), b.const([0, 2]))
    early = b.op("Less", positions, ban_until)  # [B, R, 1]
    return b.op("Where", b.op("And", early, banned), b.const(NEG_INF, np.float32), z)


def constrained(g, logits: str, vocab: int, positions: int | str, vocab_ids: str | None = None,
                single: bool = False) -> str:
    """logits [B, R, V'] (single: [B, V']) without the tokens each position's grammar forbids (an If
    on `constrain`, whose other branch passes them through). A Medusa tree's verification applies it
    alone: it takes no other processor."""
    constrain = g.input("constrain", BOOL, [])
    then = g.branch("constrain")
    z = _allowed(then, then.op("Unsqueeze", logits, then.const([1])) if single else logits, vocab, vocab_ids, positions)
    z = then.op("Squeeze", z, then.const([1])) if single else z
    keep = g.branch("unconstrained")
    return g.op("If", constrain, then_branch=then.graph([(z, FLOAT)]),
                else_branch=keep.graph([(keep.op("Identity", logits), FLOAT)]))


def grammar_mask(g, vocab: int, positions: int | str) -> str:
    """The `forbidden` input: uint8 [B, positions, 4 ceil(V/32)], the bytes of the int32 bitmask words
    (a session graph declares it first, with free positions)."""
    return g.input("forbidden", UINT8, ["batch", positions, 4 * ((vocab + 31) // 32)])


# byte value -> its 8 tokens' logit offsets (bit k set: token 8·byte + k is forbidden): half of NEG_INF,
# so that any finite logit plus it stays finite, and below every allowed one. A weight (8 KB, stored
# with the model's), not an inline constant
BYTE_OFFSETS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, np.float32(NEG_INF / 2),
                        np.float32(0)).astype(np.float32)


def _allowed(b, z: str, vocab: int, vocab_ids: str | None, positions: int | str) -> str:
    """z [B, R, V'] plus BYTE_OFFSETS of each forbidden token: one lookup per byte of the bitmask, 5×
    cheaper on ONNX Runtime than unpacking bits with integer division (measured: 113 against 560 µs
    for 5 positions of 8192 tokens), and ops TensorRT parses (it has no bitwise ones)."""
    forbidden = b.op("Cast", grammar_mask(b, vocab, positions), to=INT32)
    offsets = b.op("Gather", b.weight("grammar_byte_offsets", BYTE_OFFSETS), forbidden)  # [B, R, 4W, 8]
    offsets = b.op("Slice", b.op("Reshape", offsets, b.const([0, 0, -1])), b.const([0]), b.const([vocab]),
                   b.const([2]))
    if vocab_ids is not None:
        offsets = b.op("Gather", offsets, vocab_ids, axis=2)
    return b.op("Add", z, offsets)


def _columns(b, vocab_ids: str | None):
    """[B, V] -> [B, 1, V'] (the scored subset's columns)."""
    def take(x):
        x = b.op("Gather", x, vocab_ids, axis=1) if vocab_ids is not None else x
        return b.op("Unsqueeze", x, b.const([1]))
    return take


def _per_row(b, x: str) -> str:
    return b.op("Unsqueeze", x, b.const([1, 2]))  # [B] -> [B, 1, 1]


def min_p_filtered(g, probs: str) -> str:
    """probs [B, R, V] without the tokens below min_p × each row's largest probability, renormalised
    (an If on `process`; penalties[:, 3] = min_p, 0: off)."""
    process = g.input("process", BOOL, [])
    then = g.branch("min_p")
    min_p = _per_row(then, then.op("Gather", then.input("penalties", FLOAT, ["batch", 4]), then.const(3), axis=1))
    floor = then.op("Mul", min_p, then.op("ReduceMax", probs, then.const([2]), keepdims=1))
    kept = then.op("Where", then.op("GreaterOrEqual", probs, floor), probs, then.const(0.0, np.float32))
    filtered = then.op("Div", kept, then.op("ReduceSum", kept, then.const([2]), keepdims=1))
    keep = g.branch("no_min_p")
    return g.op("If", process, then_branch=then.graph([(filtered, FLOAT)]),
                else_branch=keep.graph([(keep.op("Identity", probs), FLOAT)]))


def logprob_outputs(g, logits: str, emitted, vocab: int, probs: str | None = None, temperature: str | None = None,
                    single: bool = False) -> list[str]:
    """(token_logprob [B, R], top_logprobs [B, R, K], top_ids [B, R, K]) of the tokens emitted at
    each position (an If on `want_logprobs`; zeros when not wanted). logits [B, R, V]: processed
    (single: [B, V], R = 1). emitted(branch) -> [B, R]: makes the emitted tokens, in the branch that
    needs them. probs [B, R, V]: what sampled rows drew from (temperature [B] > 0), whose log it is
    for those rows."""
    wanted = g.input("want_logprobs", BOOL, [])
    then = g.branch("logprobs")
    log_p = then.op("LogSoftmax", then.op("Unsqueeze", logits, then.const([1])) if single else logits, axis=-1)
    if probs is not None:
        sampled = _per_row(then, then.op("Greater", temperature, then.const(0.0, np.float32)))
        log_p = then.op("Where", sampled, then.op("Log", probs), log_p)
    token = then.op("Squeeze", then.op("GatherElements", log_p, then.op("Unsqueeze", emitted(then), then.const([2])),
                                       axis=2), then.const([2]))
    top, ids = _top(then, log_p, vocab)
    none = g.branch("no_logprobs")
    shape = none.op("Shape", logits, start=0, end=1 if single else 2)
    shape = none.op("Concat", shape, none.const([1]), axis=0) if single else shape
    wide = none.op("Concat", shape, none.const([TOP_LOGPROBS]), axis=0)
    zeros = [none.op("ConstantOfShape", shape, value=_zero(np.float32)),
             none.op("ConstantOfShape", wide, value=_zero(np.float32)),
             none.op("ConstantOfShape", wide, value=_zero(np.int64))]
    types = (FLOAT, FLOAT, INT64)
    return g.op("If", wanted, outputs=3, then_branch=then.graph(list(zip((token, top, ids), types))),
                else_branch=none.graph(list(zip(zeros, types))))


def _zero(dtype) -> onnx.TensorProto:
    return onnx.numpy_helper.from_array(np.zeros([1], dtype))


def emitted_tokens(g, ids: str, accepted: str, next_token: str) -> str:
    """[B, γ+1]: the token a verification emits at each position: d_{r+1} for r < accepted, then
    next_token (positions after it are never read)."""
    following = g.op("Concat", g.op("Slice", ids, g.const([1]), g.const([1 << 62]), g.const([1])),
                     g.op("Unsqueeze", next_token, g.const([1])), axis=1)  # [B, γ+1]
    positions = g.op("Range", g.const(0), g.op("Squeeze", g.op("Shape", ids, start=1, end=2), g.const([0])),
                     g.const(1))
    kept = g.op("Less", g.op("Unsqueeze", positions, g.const([0])), g.op("Unsqueeze", accepted, g.const([1])))
    return g.op("Where", kept, following, g.op("Unsqueeze", next_token, g.const([1])))


def prompt_scores(g, logits: str, score_ids: str, vocab: int) -> list[str]:
    """(token_logprob [B, T], top_logprobs, top_ids [B, T, K]): each position's log-softmax at the
    token that follows it in the prompt (`score_ids`), and its K most likely tokens."""
    log_p = g.op("LogSoftmax", logits, axis=-1)
    token = g.op("Squeeze", g.op("GatherElements", log_p, g.op("Unsqueeze", score_ids, g.const([2])), axis=2),
                 g.const([2]))
    return [token, *_top(g, log_p, vocab)]


def _top(b, log_p: str, vocab: int) -> list[str]:
    """The TOP_LOGPROBS largest of log_p [B, R, V] and their ids; a vocabulary smaller than that (a
    tiny cut draft head, a test's model) is padded with impossible tokens, whose ids are clamped into it."""
    if vocab < TOP_LOGPROBS:
        log_p = b.op("Pad", log_p, b.const([0, 0, 0, 0, 0, TOP_LOGPROBS - vocab]), b.const(NEG_INF, np.float32))
        top, ids = b.op("TopK", log_p, b.const([TOP_LOGPROBS]), axis=-1, largest=1, sorted=1, outputs=2)
        return [top, b.op("Min", ids, b.const(vocab - 1))]
    return b.op("TopK", log_p, b.const([TOP_LOGPROBS]), axis=-1, largest=1, sorted=1, outputs=2)
