"""The speculative ops, as ONNX model-local functions in the `speccompile` domain.

  SpecAccept     acceptance + KV-rollback bookkeeping at the end of the verification graph
                 (mode "greedy": on target logits; mode "sample": on target/draft probabilities;
                 modes "tree" and "tree_typical": a token tree's longest kept path, see core/tree.py)
  SpecTransform  temperature, top-k, top-p -> probabilities (greedy rows become one-hot)
  SpecSample     inverse-CDF sampling from probabilities with a supplied uniform

Each body uses standard ops only, so ONNX Runtime runs it with no custom library; each node also
carries `plugin_namespace` and `plugin_version`, so TensorRT's parser can serve it with our plugin
(plugins/) instead of inlining the body. The numpy references are `speccompile.core.acceptance` and
`speccompile.core.sampling`; the tests hold the bodies to them position by position.

Each row b proposes only its first k = draft_len[b] drafts (0 <= k <= γ): a batch verified in one
pass shares γ, its rows need not. The slots after them are padding, whatever they hold.

Greedy rule. The target scored [last, d_1 .. d_γ] at positions L .. L+γ, so its argmax t_j at
input j is its own choice for the token after input j.
  accepted  n = min(number of leading j in 1..γ with d_j == t_{j-1}, k)
  next        = t_n  (the correction at the first mismatch, or the target's own token after d_k)
  new_len     = L + n + 1  (last and d_1..d_n stay in the cache; entries past them are dead and
                            will be overwritten, which is the O(1) rollback)

Sampling rule (Leviathan et al.; Chen et al.): accept d_j (j <= k) iff u_j q_j(d_j) < p_j(d_j); at
the first rejection n sample from normalise(max(0, p_n - q_n)); after k acceptances sample from p_k.
Why it emits exactly p, and why the pads cannot matter (the target is causal), is next to the numpy
reference (`speccompile.core.acceptance`). The coupled rule needs no mode of its own: it is the
greedy rule on the target's Gumbel-perturbed log-probabilities (`gumbel_scores`), so a verification
graph that samples holds a greedy SpecAccept beside the sampling one and picks per row.
"""

import numpy as np
import onnx

from speccompile.compiler.onnx_graph import OPSET, FunctionBuilder

DOMAIN = "speccompile"
PLUGIN_NAMESPACE = "speccompile"
PLUGIN_VERSION = "1"
ATTRIBUTES = ["plugin_namespace", "plugin_version", "mode"]
OUTPUTS = ["accepted", "next_token", "new_len"]
GREEDY_INPUTS = ["target_logits", "draft_tokens", "draft_len", "past_len"]
SAMPLE_INPUTS = ["target_probs", "draft_probs", "draft_tokens", "draft_len", "u_accept", "u_sample", "past_len"]
# token trees (core/tree.py): the topology is an input (parents [N], depths [N], ancestor-or-self mask [N, N])
TREE_OUTPUTS = [*OUTPUTS, "best_node"]
TREE_INPUTS = ["target_logits", "tree_tokens", "draft_len", "past_len", "tree_parents", "tree_depths", "tree_mask"]
TYPICAL_INPUTS = [*TREE_INPUTS, "epsilon", "delta"]
FLOAT32_MIN = float(np.finfo(np.float32).min)


# ---------------------------------------------------------------------------------------------
# shared pieces of the bodies


def _leading_run(f: FunctionBuilder, accepted_each: str, out: str | None = "accepted") -> str:
    """Number of leading True values per row of a [B, γ] bool tensor.

    A position counts while no rejection has occurred at or before it. (CumSum runs in float:
    TensorRT's CumSum takes float types only.)
    """
    rejected = f.op("Cast", f.op("Not", accepted_each), to=onnx.TensorProto.FLOAT)
    rejections_so_far = f.op("CumSum", rejected, f.const(1))
    in_run = f.op("Cast", f.op("Equal", rejections_so_far, f.const(0.0, np.float32)), to=onnx.TensorProto.INT64)
    return f.op("ReduceSum", in_run, f.const([1]), keepdims=0, out=out)


def _proposed(f: FunctionBuilder, draft_tokens: str = "draft_tokens", draft_len: str = "draft_len") -> str:
    """[B, γ] bool: slot j of row b holds a real draft, j < draft_len[b]."""
    gamma = f.op("Squeeze", f.op("Shape", draft_tokens, start=1, end=2), f.const([0]))
    slots = f.op("Range", f.const(0), gamma, f.const(1))  # [γ]
    return f.op("Less", f.op("Unsqueeze", slots, f.const([0])), f.op("Unsqueeze", draft_len, f.const([1])))


def _new_len(f: FunctionBuilder, past_len: str, accepted: str, out: str | None = "new_len") -> str:
    return f.op("Add", f.op("Add", past_len, accepted), f.const(1), out=out)


def accept_tokens(b, target_tokens: str, draft_tokens: str, draft_len: str, past_len: str,
                  out: list | None = None) -> list[str]:
    """The greedy rule on the target's own tokens t [B, γ+1] (its choice after each input): the
    body of greedy SpecAccept, in standard ops with any builder (the coupled rule runs it on the
    target's Gumbel-max draws). Returns (accepted, next_token, new_len), named `out` if given."""
    accepted_out, next_out, new_len_out = out or (None, None, None)
    # t_0 .. t_{γ-1} are the target's choices at the positions the drafts d_1..d_γ occupy.
    target_choice = b.op("Slice", target_tokens, b.const([0]), b.const([-1]), b.const([1]))
    proposed = _proposed(b, draft_tokens, draft_len)
    accepted = _leading_run(b, b.op("And", b.op("Equal", draft_tokens, target_choice), proposed), out=accepted_out)
    # next = t_n: the correction at the first mismatch, or the target's own token after the last real draft.
    next_col = b.op("GatherElements", target_tokens, b.op("Unsqueeze", accepted, b.const([1])), axis=1)
    next_token = b.op("Squeeze", next_col, b.const([1]), out=next_out)
    return [accepted, next_token, _new_len(b, past_len, accepted, out=new_len_out)]


def inverse_cdf(f: FunctionBuilder, weights: str, uniform: str, out: str) -> str:
    """Token t with c_{t-1} <= u * c_{V-1} < c_t (c: inclusive prefix sums of weights [B, V])."""
    cdf = f.op("CumSum", weights, f.const(1))
    total = f.op("Slice", cdf, f.const([-1]), f.const([np.iinfo(np.int64).max]), f.const([1]))  # [B, 1]
    threshold = f.op("Mul", f.op("Unsqueeze", uniform, f.const([1])), total)
    below = f.op("Cast", f.op("LessOrEqual", cdf, threshold), to=onnx.TensorProto.INT64)
    count = f.op("ReduceSum", below, f.const([1]), keepdims=0)
    last_index = f.op("Sub", f.op("Squeeze", f.op("Shape", weights, start=1, end=2), f.const([0])), f.const(1))
    return f.op("Min", count, last_index, out=out)


def gumbel_scores(b, probs: str, noise: str) -> str:
    """log p + G with G = -log(-log u), u the noise (uniforms in [0, 1), shaped like probs, or
    broadcast to it): its argmax is a sample from p (the Gumbel-max trick), and a token of
    probability 0 scores -inf. Standard ops only: with any builder, outside our functions too."""
    gumbel = b.op("Neg", b.op("Log", b.op("Neg", b.op("Log", noise))))
    return b.op("Add", b.op("Log", probs), gumbel)


# ---------------------------------------------------------------------------------------------
# SpecAccept


def spec_accept_greedy_function() -> onnx.FunctionProto:
    f = FunctionBuilder(DOMAIN, "SpecAccept", GREEDY_INPUTS, ATTRIBUTES)
    target_tokens = f.op("ArgMax", "target_logits", axis=-1, keepdims=0)  # t_j: the target's token after input j
    accept_tokens(f, target_tokens, "draft_tokens", "draft_len", "past_len", out=OUTPUTS)
    return f.function(OUTPUTS, OPSET)


def spec_accept_sample_function() -> onnx.FunctionProto:
    f = FunctionBuilder(DOMAIN, "SpecAccept", SAMPLE_INPUTS, ATTRIBUTES)  # mode "sample"
    proposed = _proposed(f)
    # a pad slot may hold any integer: gather at token 0 there (the slot is rejected anyway)
    drafts = f.op("Unsqueeze", f.op("Where", proposed, "draft_tokens", f.const(0)), f.const([2]))  # [B, γ, 1]
    p_head = f.op("Slice", "target_probs", f.const([0]), f.const([-1]), f.const([1]))  # p_0..p_{γ-1}
    p_of_draft = f.op("Squeeze", f.op("GatherElements", p_head, drafts, axis=2), f.const([2]))
    q_of_draft = f.op("Squeeze", f.op("GatherElements", "draft_probs", drafts, axis=2), f.const([2]))
    # accept d_j with probability min(1, p/q):  u q < p  (no division, so q = 0 cannot blow up)
    accepted = _leading_run(f, f.op("And", f.op("Less", f.op("Mul", "u_accept", q_of_draft), p_of_draft), proposed))
    p_n, q_n = _rows_at(f, "target_probs", accepted), _rows_at(f, _padded_draft_probs(f), accepted)
    # q_k := 0 at k = the row's number of real drafts, so that the token after them samples from p_k.
    real_drafts = f.op("ReduceSum", f.op("Cast", proposed, to=onnx.TensorProto.INT64), f.const([1]), keepdims=1)
    rejected = f.op("Greater", real_drafts, f.op("Unsqueeze", accepted, f.const([1])))  # [B, 1]: n < k
    q_n = f.op("Where", rejected, q_n, f.const(0.0, np.float32))
    residual = residual_weights(f, p_n, q_n)
    inverse_cdf(f, residual, "u_sample", out="next_token")
    _new_len(f, "past_len", accepted)
    return f.function(OUTPUTS, OPSET)


def _padded_draft_probs(f: FunctionBuilder) -> str:
    """draft_probs [B, γ, V] with a row of zeros appended at position γ: [B, γ+1, V]."""
    last_p = f.op("Slice", "target_probs", f.const([-1]), f.const([np.iinfo(np.int64).max]), f.const([1]))
    return f.op("Concat", "draft_probs", f.op("Mul", last_p, f.const(0.0, np.float32)), axis=1)


def _rows_at(f: FunctionBuilder, probs: str, position: str) -> str:
    """probs [B, R, V] at each row's position [B]: [B, V]."""
    like = f.op("Shape", f.op("Slice", "target_probs", f.const([0]), f.const([1]), f.const([1])))  # [B, 1, V]
    index = f.op("Expand", f.op("Unsqueeze", position, f.const([1, 2])), like)
    return f.op("Squeeze", f.op("GatherElements", probs, index, axis=1), f.const([1]))


def residual_weights(f: FunctionBuilder, p_n: str, q_n: str) -> str:
    """max(0, p - q): the mass p has where the draft under-proposed (unnormalised; inverse_cdf
    normalises). p == q leaves nothing; rejection then had probability 0, but p keeps it valid."""
    residual = f.op("Max", f.op("Sub", p_n, q_n), f.const(0.0, np.float32))
    has_mass = f.op("Greater", f.op("ReduceSum", residual, f.const([1]), keepdims=1), f.const(0.0, np.float32))
    return f.op("Where", has_mass, residual, p_n)


def spec_accept_tree_function(typical: bool = False) -> onnx.FunctionProto:
    """Modes "tree" (greedy) and "tree_typical" (see core/tree.py for both rules and the reference)."""
    f = FunctionBuilder(DOMAIN, "SpecAccept", TYPICAL_INPUTS if typical else TREE_INPUTS, ATTRIBUTES)
    target_tokens = f.op("ArgMax", "target_logits", axis=-1, keepdims=0)  # [B, N]
    if typical:
        ok = _typical_ok(f)
    else:  # node i holds the target's own choice after its parent
        ok = f.op("Equal", "tree_tokens", f.op("Gather", target_tokens, "tree_parents", axis=1))
    nodes = f.op("Range", f.const(0), f.op("Squeeze", f.op("Shape", "tree_tokens", start=1, end=2), f.const([0])),
                 f.const(1))  # [N]
    # node i of row b is verified when i <= draft_len[b]; the root is always kept
    real = f.op("LessOrEqual", f.op("Unsqueeze", nodes, f.const([0])), f.op("Unsqueeze", "draft_len", f.const([1])))
    kept = f.op("Or", f.op("And", ok, real), f.op("Equal", nodes, f.const(0)))  # [B, N]
    # a node's path is kept when no ancestor (itself included) is not: all over j of (not mask[i, j]) or kept[j]
    not_ancestor = f.op("Not", f.op("Unsqueeze", "tree_mask", f.const([0])))  # [1, N, N]
    either = f.op("Or", not_ancestor, f.op("Unsqueeze", kept, f.const([1])))  # [B, N, N]
    path_kept = f.op("Cast", f.op("ReduceMin", f.op("Cast", either, to=onnx.TensorProto.INT64), f.const([2]),
                                  keepdims=0), to=onnx.TensorProto.BOOL)  # [B, N]
    depth = f.op("Cast", f.op("Unsqueeze", "tree_depths", f.const([0])), to=onnx.TensorProto.FLOAT)
    score = f.op("Where", path_kept, depth, f.const(-1.0, np.float32))
    best = f.op("ArgMax", score, axis=1, keepdims=0, out="best_node")  # the first deepest kept node
    accepted = f.op("Gather", "tree_depths", best, out="accepted")
    next_col = f.op("GatherElements", target_tokens, f.op("Unsqueeze", best, f.const([1])), axis=1)
    f.op("Squeeze", next_col, f.const([1]), out="next_token")
    _new_len(f, "past_len", accepted)
    return f.function(TREE_OUTPUTS, OPSET)


def _typical_ok(f: FunctionBuilder) -> str:
    """[B, N] bool: p(token_i) > min(ε, δ·exp(-H(p))), p the target's distribution after i's parent."""
    probs = f.op("Softmax", "target_logits", axis=-1)  # [B, N, V]
    log_probs = f.op("LogSoftmax", "target_logits", axis=-1)
    entropy = f.op("Neg", f.op("ReduceSum", f.op("Mul", probs, log_probs), f.const([-1]), keepdims=0))  # [B, N]
    per_row = lambda x: f.op("Unsqueeze", x, f.const([1]))  # noqa: E731
    threshold = f.op("Min", per_row("epsilon"), f.op("Mul", per_row("delta"), f.op("Exp", f.op("Neg", entropy))))
    parent_probs = f.op("Gather", probs, "tree_parents", axis=1)  # [B, N, V]
    p_token = f.op("GatherElements", parent_probs, f.op("Unsqueeze", "tree_tokens", f.const([2])), axis=2)
    return f.op("Greater", f.op("Squeeze", p_token, f.const([2])), f.op("Gather", threshold, "tree_parents", axis=1))


# ---------------------------------------------------------------------------------------------
# SpecTransform and SpecSample


def spec_transform_function(vocab_size: int) -> onnx.FunctionProto:
    """logits [B, R, V], temperature [B], top_k [B], top_p [B] -> probs [B, R, V] (see core.sampling).

    V is baked in as a constant: TensorRT wants TopK's K known at build time.
    """
    f = FunctionBuilder(DOMAIN, "SpecTransform", ["logits", "temperature", "top_k", "top_p"], ATTRIBUTES)
    vocab = f.const([vocab_size])

    def per_row(x):  # [B] -> [B, 1, 1]
        return f.op("Unsqueeze", x, f.const([1, 2]))

    temperature = per_row("temperature")
    greedy = f.op("Equal", temperature, f.const(0.0, np.float32))
    z = f.op("Div", "logits", f.op("Where", greedy, f.const(1.0, np.float32), temperature))
    # top-k: keep z >= the k-th largest z (k <= 0 or k >= V: keep all)
    sorted_z = f.op("TopK", z, vocab, axis=-1, largest=1, sorted=1, outputs=2)[0]
    top_k = per_row("top_k")
    k = f.op("Where", f.op("And", f.op("Greater", top_k, f.const(0)), f.op("Less", top_k, vocab)), top_k, vocab)
    kth = f.op("GatherElements", sorted_z, _expand_rows(f, f.op("Sub", k, f.const(1)), sorted_z), axis=2)
    z = f.op("Where", f.op("GreaterOrEqual", z, kth), z, f.const(FLOAT32_MIN, np.float32))
    probs = f.op("Softmax", z, axis=-1)
    # top-p: keep probs >= that of the m-th most likely token, m the smallest count reaching top_p
    sorted_p = f.op("TopK", probs, vocab, axis=-1, largest=1, sorted=1, outputs=2)[0]
    top_p = per_row("top_p")
    short = f.op("Cast", f.op("Less", f.op("CumSum", sorted_p, f.const(2)), top_p), to=onnx.TensorProto.INT64)
    needed = f.op("Min", f.op("Add", f.op("ReduceSum", short, f.const([2]), keepdims=1), f.const(1)), vocab)
    threshold = f.op("GatherElements", sorted_p, f.op("Sub", needed, f.const(1)), axis=2)
    threshold = f.op("Where", f.op("Less", top_p, f.const(1.0, np.float32)), threshold, f.const(0.0, np.float32))
    kept = f.op("Where", f.op("GreaterOrEqual", probs, threshold), probs, f.const(0.0, np.float32))
    probs = f.op("Div", kept, f.op("ReduceSum", kept, f.const([2]), keepdims=1))
    # temperature 0: one-hot on the argmax, so greedy rows go through the same sampling rule
    argmax = f.op("ArgMax", "logits", axis=-1, keepdims=1)
    token_ids = f.op("Range", f.const(0), f.op("Squeeze", vocab, f.const([0])), f.const(1))
    one_hot = f.op("Cast", f.op("Equal", token_ids, argmax), to=onnx.TensorProto.FLOAT)
    f.op("Where", greedy, one_hot, probs, out="probs")
    return f.function(["probs"], OPSET)


def _expand_rows(f: FunctionBuilder, per_batch: str, like: str) -> str:
    """[B, 1, 1] index -> [B, R, 1], R rows of `like` [B, R, V]."""
    shape = f.op("Concat", f.op("Shape", like, start=0, end=2), f.const([1]), axis=0)
    return f.op("Expand", per_batch, shape)


def spec_sample_function() -> onnx.FunctionProto:
    f = FunctionBuilder(DOMAIN, "SpecSample", ["probs", "uniform"], ATTRIBUTES)
    inverse_cdf(f, "probs", "uniform", out="token")
    return f.function(["token"], OPSET)


# ---------------------------------------------------------------------------------------------
# adding the ops to a graph

# (op, mode) -> body. A graph holds one SpecAccept: greedy in target_verify_g*, sample in
# target_verify_sample_g*, tree and tree_typical in the tree graphs; the plugin tells them apart by
# the `mode` attribute.
FUNCTIONS = {
    ("SpecAccept", "greedy"): spec_accept_greedy_function,
    ("SpecAccept", "sample"): spec_accept_sample_function,
    ("SpecAccept", "tree"): spec_accept_tree_function,
    ("SpecAccept", "tree_typical"): lambda: spec_accept_tree_function(typical=True),
    ("SpecTransform", ""): spec_transform_function,
    ("SpecSample", ""): spec_sample_function,
}


def spec_op(builder, name: str, *inputs: str, mode: str = "", outputs: int = 1, out=None, vocab_size: int = 0):
    """Add a call of speculative op `name` (and its function definition, once) to `builder`."""
    if name not in {fn.name for fn in builder.functions}:
        make = FUNCTIONS[name, mode]
        builder.add_function(make(vocab_size) if name == "SpecTransform" else make())
    return builder.op(name, *inputs, outputs=outputs, out=out, domain=DOMAIN, plugin_namespace=PLUGIN_NAMESPACE,
                      plugin_version=PLUGIN_VERSION, mode=mode or "default")


def spec_accept_node(builder, target_logits: str, draft_tokens: str, draft_len: str, past_len: str) -> list[str]:
    """Greedy SpecAccept; its outputs are named `accepted`, `next_token`, `new_len`."""
    return spec_op(builder, "SpecAccept", target_logits, draft_tokens, draft_len, past_len, mode="greedy", outputs=3,
                   out=OUTPUTS)


def spec_accept_tree_node(builder, target_logits: str, tree_tokens: str, draft_len: str, past_len: str,
                          topology: tuple[str, str, str], typical: tuple[str, str] | None = None) -> list[str]:
    """Tree SpecAccept; topology = (parents, depths, mask) tensors, typical = (epsilon, delta) for the
    typical rule. Outputs: `accepted`, `next_token`, `new_len`, `best_node`."""
    return spec_op(builder, "SpecAccept", target_logits, tree_tokens, draft_len, past_len, *topology, *(typical or ()),
                   mode="tree_typical" if typical else "tree", outputs=4, out=TREE_OUTPUTS)
