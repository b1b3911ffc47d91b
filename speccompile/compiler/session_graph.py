"""One ONNX Runtime graph per model that serves every call of the loop: one copy of the weights in memory.

Why: each ONNX Runtime session keeps its own pre-packed copy of the weights it reads, and a bundle
has up to 2 + 2·(number of γ) graphs per model, each also in a batch-1 variant. With a session per
graph, a 1.1B float32 target grew by 4.4 GB with every graph a process ran (prefill, each γ,
sampling, batch size > 1). ONNX Runtime's Python API has no shared pre-packed weight container,
and two ways around it were measured and rejected on that target: turning pre-packing off, and
one model holding every graph as a branch of an If (the weights then sit in an outer scope, which
ONNX Runtime reads but does not pre-pack): both keep one copy, but verification of 5 tokens took
1312 ms instead of 370, and an int8 decode step 2.6 s instead of 94 ms.

So the graph itself serves every call, with all weights in its main body:

    input_ids [B, T], past_len [B], token_count [B], kind [], fused []  (+ the kind's own inputs)
      -> next_token [B], probs [B, V], accepted [B], new_len [B]   (those `kind` makes; others empty)
         (+ aux_hidden [B, T, n·H] for every kind, where the target's graphs have it)

- `kind` says which call this is (KINDS): a forward step (greedy or sampled: the LM head reads each
  row's last real token) or a verification of T = γ+1 tokens (any γ: the LM head reads all T, and
  SpecAccept takes γ from the shape). Only what follows the LM head differs by kind; it holds no
  weights, so it sits in If branches. A draft with a cut vocabulary has two LM heads, both in the
  main body: the one the call does not use multiplies zero rows.
- `fused` picks the attention kernel per call (transformer._either_attention): ONNX Runtime's fused
  GroupQueryAttention for a batch of one sequence, the standard ops otherwise. That If holds no
  weights either: the projections around it stay in the main body.
- Optional inputs (sampling controls, draft probabilities, draft_len) have zero defaults: a call feeds
  only what its kind reads. A verification always feeds draft_len; were it left out, the default 0
  would make every row a plain decoding step (nothing accepted): slow, never wrong.

The graphs of each kind are still written (TensorRT builds from them, and they are the reference
the tests compare against); the ONNX Runtime backend runs this one.
"""

import numpy as np
from onnx import helper, numpy_helper

from speccompile.bundle import (
    GRAPH_KINDS,
    GRAPH_OUTPUTS,
    LOGPROBS,
    MEDUSA_TREE_KINDS,
    OUTPUT_TYPES,
    TOP_LOGPROBS,
    TREE_KINDS,
)
from speccompile.compiler.checkpoint import ModelSpec
from speccompile.compiler.logits import grammar_mask, prompt_scores
from speccompile.compiler.onnx_graph import BOOL, FLOAT, INT64, GraphBuilder
from speccompile.compiler.spec_accept import OUTPUTS, TREE_OUTPUTS
from speccompile.compiler.transformer import (
    _decoder,
    _lm_head,
    accept,
    accept_tree,
    greedy_step,
    medusa_candidates,
    sampled_next,
)

KINDS = {kind: k for k, kind in enumerate(GRAPH_KINDS)}  # the `kind` input's values, recorded in the manifest
ALWAYS_FED = {"input_ids", "past_len", "token_count", "kind", "fused"}


def read_back(kinds: list[str]) -> dict[str, int]:
    """Every output these kinds read back (all but the cache), and its element type."""
    return {output: FLOAT if OUTPUT_TYPES[output][0] == "float32" else INT64
            for kind in kinds for output in GRAPH_OUTPUTS[kind]}


def build_session_graph(spec: ModelSpec, name: str, max_seq: int, vocab_out: int, kinds: list[str],
                        matmul_weights: str = "float32", vocab_ids: np.ndarray | None = None,
                        heads: list | None = None, aux_layers: tuple[int, ...] = ()) -> GraphBuilder:
    """`heads`: the Medusa heads of Medusa's tree kinds (verify_tree*). Tree kinds (a Medusa tree's,
    an EAGLE-3 head's) must come after every other kind the graph serves, in KINDS.
    `aux_layers`: also output aux_hidden [B, T, len(aux_layers) * H] as the graphs of each kind do
    (transformer._aux_hidden): made before the LM head, so one output at the top level serves every
    kind, over all T input positions, whichever positions the kind's LM head reads."""
    g = GraphBuilder(name, matmul_weights, quantized_kernel="MatMulNBits")
    ids = g.input("input_ids", INT64, ["batch", "tokens"])
    past_len = g.input("past_len", INT64, ["batch"])
    token_count = g.input("token_count", INT64, ["batch"])
    kind = g.input("kind", INT64, [])
    fused = g.input("fused", BOOL, [])
    grammar_mask(g, vocab_out, "mask_positions")  # one position for a step, γ+1 or a tree's nodes for the others
    trees = [k for k in kinds if k in TREE_KINDS]
    assert heads or not set(trees) & set(MEDUSA_TREE_KINDS), "Medusa's tree kinds read its heads"
    # the tree kinds are the last kinds: one comparison tells a tree call (positions, mask) from the others
    tree_flag = g.op("GreaterOrEqual", kind, g.const(min(KINDS[k] for k in trees))) if trees else None
    hidden = _decoder(g, spec, ids, past_len, max_seq, fused_flag=fused, tree_flag=tree_flag, aux_layers=aux_layers)
    rows = _head_rows(g, hidden, token_count, kind)  # [B, L, H]
    subset = vocab_ids is not None
    # the greedy forward kind of a cut-vocabulary draft scores its subset; every other call the whole head
    on_subset = g.const([0])
    if subset:
        greedy_step = g.op("Cast", g.op("Equal", kind, g.const(KINDS["forward"])), to=INT64)
        on_subset = g.op("Mul", _row_count(g, rows), greedy_step)
    logits = _lm_head(g, spec, g.op("Slice", rows, on_subset, g.const([1 << 62]), g.const([1])), vocab_out)
    logits_subset = _lm_head(g, spec, g.op("Slice", rows, g.const([0]), on_subset, g.const([1])), vocab_out,
                             vocab_ids) if subset else None
    outputs_of = read_back(kinds)
    tails = {k: _tail(g, spec, k, logits, logits_subset, vocab_ids, ids, past_len, vocab_out, rows, heads, outputs_of)
             for k in kinds}
    outputs = _dispatch(g, kind, [tails[k] for k in kinds], [KINDS[k] for k in kinds], "", outputs_of)
    shapes = {"probs": ["batch", vocab_out], "next_tree": ["batch", "tree_nodes"], "token_logprob": ["batch", "scored"],
              "top_logprobs": ["batch", "scored", TOP_LOGPROBS], "top_ids": ["batch", "scored", TOP_LOGPROBS]}
    for tensor, (output, elem_type) in zip(outputs, outputs_of.items()):
        g.output(tensor, output, elem_type, shapes.get(output, ["batch"]))
    for value in g.inputs:  # inputs only some kinds read: zero defaults, so other calls need not feed them
        if value.name not in ALWAYS_FED and not value.name.startswith("past_"):
            dtype = helper.tensor_dtype_to_np_dtype(value.type.tensor_type.elem_type)
            for k, dim in enumerate(value.type.tensor_type.shape.dim):  # free dims: a default of ones is small
                dim.dim_param = dim.dim_param or f"{value.name}_{k}"
            rank = len(value.type.tensor_type.shape.dim)
            g.constants[value.name] = numpy_helper.from_array(np.zeros([1] * rank, dtype), value.name)
    return g


def _row_count(g: GraphBuilder, rows: str) -> str:
    return g.op("Shape", rows, start=1, end=2)  # [1]: L


def _head_rows(g: GraphBuilder, hidden: str, token_count: str, kind: str) -> str:
    """The positions that reach the LM head: each row's last real token (forward kinds) or all T
    (verification: T = γ+1, and every row's tokens are real)."""
    num_tokens = g.op("Shape", hidden, start=1, end=2)  # [1]: T
    verifying = g.op("GreaterOrEqual", kind, g.const(KINDS["verify"]))
    count = g.op("Where", verifying, num_tokens, g.const([1]))  # [1]: L
    first = g.op("Sub", token_count, count)  # [B]
    steps = g.op("Range", g.const(0), g.op("Squeeze", count, g.const([0])), g.const(1))  # [L]
    index = g.op("Add", g.op("Unsqueeze", first, g.const([1])), steps)  # [B, L]
    return g.op("GatherND", hidden, g.op("Unsqueeze", index, g.const([2])), batch_dims=1)  # [B, L, H]


def _tail(g, spec, kind, logits, logits_subset, vocab_ids, ids, past_len, vocab_out, rows, heads, outputs_of):
    """The If branch of one kind: what follows the LM head, yielding every output of `outputs_of`."""
    b = g.branch(kind)
    made = {}
    if kind in TREE_KINDS:
        made.update(zip(TREE_OUTPUTS, accept_tree(b, logits, ids, past_len, kind == "verify_tree_typical",
                                                               vocab_out)))
        if kind in MEDUSA_TREE_KINDS:  # the heads' next tree; an EAGLE-3 head drafts its own
            made["next_tree"] = medusa_candidates(b, spec, rows, made["best_node"], made["next_token"], heads,
                                                  vocab_out)
    elif kind == "forward":
        scores = logits_subset if logits_subset is not None else logits
        made.update(zip(GRAPH_OUTPUTS[kind], greedy_step(b, b.op("Squeeze", scores, b.const([1])), vocab_out,
                                                          vocab_ids)))
    elif kind == "sample":
        made.update(zip(GRAPH_OUTPUTS[kind], sampled_next(b, b.op("Squeeze", logits, b.const([1])), vocab_out)))
    elif kind == "score":
        made.update(zip(LOGPROBS, prompt_scores(b, logits, b.input("score_ids", INT64, ["batch", "tokens"]),
                                                vocab_out)))
    else:
        made.update(zip((*OUTPUTS, *LOGPROBS), accept(b, logits, ids, past_len, "gamma", vocab_out,
                                                       kind == "verify_sample")))
    yields = []
    for output, elem_type in outputs_of.items():
        if output not in made:  # If needs the same outputs from every branch; the runtime reads only its kind's
            empty = np.zeros([0], helper.tensor_dtype_to_np_dtype(elem_type))
            made[output] = b.op("Constant", value=numpy_helper.from_array(empty, f"{b.scope}{output}/empty"))
        yields.append((made[output], elem_type))
    return b, yields


def _dispatch(g, kind, tails: list, kind_ids: list[int], path: str, outputs_of: dict) -> list[str]:
    """A balanced tree of If on `kind` over the tails; returns its outputs (`outputs_of` order)."""
    assert len(tails) >= 2, "a session graph serves at least two kinds"
    mid = len(tails) // 2
    halves = []
    for part, label in ((slice(0, mid), "0"), (slice(mid, None), "1")):
        if len(tails[part]) == 1:
            branch, yields = tails[part][0]
            halves.append(branch.graph(yields))
        else:  # a nested If, built inside a branch of its own
            holder = g.branch(f"dispatch{path}{label}")
            inner = _dispatch(holder, kind, tails[part], kind_ids[part], path + label, outputs_of)
            halves.append(holder.graph(list(zip(inner, outputs_of.values()))))
    below = g.op("Less", kind, g.const(kind_ids[mid]))
    out = [f"dispatch{path}/{o}" for o in outputs_of]  # a branch builder prefixes its scope
    return g.op("If", below, outputs=len(outputs_of), out=out, then_branch=halves[0], else_branch=halves[1])
