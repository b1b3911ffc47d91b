"""ONNX graphs of a decoder-only transformer over a fixed-capacity, position-addressed KV cache.

Two graphs per model, both batch-capable with per-sequence cache lengths:

  forward          input_ids [B, T], past_len [B], token_count [B]  ->  logits [B, V], next_token [B]
                   Prefill (past_len = 0, right-padded prompts, token_count = prompt lengths) and
                   decode/draft steps (T = 1 or 2) are the same computation; only the last real
                   position of each sequence reaches the LM head.
  verify_g{γ}      input_ids [B, γ+1] = [last accepted, d_1..d_γ], past_len [B], draft_len [B]
                   -> accepted [B], next_token [B], new_len [B]   (target only; ends in SpecAccept)
                   draft_len[b] in 0..γ: how many of row b's drafts are real (the rest pad the row
                   to γ and are never accepted; see spec_accept.py)

KV cache: past_key.{i} / past_value.{i} [B, H_kv, S_max, D] in, present_* out. New entries are
written at positions past_len .. past_len+T-1 by TensorScatter, which updates the buffer in place when
the runtime binds the same memory as input and output; attention reads positions < max(past_len)+T
and masks each query to keys at positions <= its own. So entries beyond a sequence's length are
never read, and rolling back a rejected draft is just passing a smaller past_len next time.

With `aux_layers` (the target's step and verification graphs, for an EAGLE-3 head), a graph also
outputs aux_hidden [B, T, len(aux_layers) * H]: the residual stream entering each of those layers at
every input position (see _aux_hidden). Without them the graphs are as if the option did not exist.

Each graph also has a single-sequence variant for ONNX Runtime (`single_sequence=True`, batch 1):
the same interface and cache, with each block's attention in ONNX Runtime's fused
GroupQueryAttention kernel, which reads the cache in place (see _fused_attention).
"""

import itertools
from dataclasses import dataclass

import numpy as np

from speccompile.bundle import AUX_HIDDEN, LOGPROBS, TOP_LOGPROBS, kv_cache_shape
from speccompile.compiler.checkpoint import ModelSpec
from speccompile.compiler.logits import (
    constrained,
    emitted_tokens,
    logprob_outputs,
    min_p_filtered,
    processed,
    prompt_scores,
)
from speccompile.compiler.onnx_graph import BOOL, FLOAT, INT32, INT64, ORT_DOMAIN, GraphBuilder
from speccompile.compiler.rope import Rope, inverse_frequencies
from speccompile.compiler.spec_accept import (
    OUTPUTS,
    TREE_OUTPUTS,
    accept_tokens,
    gumbel_scores,
    spec_accept_node,
    spec_accept_tree_node,
    spec_op,
)
from speccompile.compiler.tensors import cast, columns, concatenated


def build_forward_graph(spec: ModelSpec, name: str, max_seq: int, vocab_out: int, sample: bool = False,
                        matmul_weights: str = "float32", vocab_ids: np.ndarray | None = None,
                        single_sequence: bool = False, aux_layers: tuple[int, ...] = (),
                        quantized_kernel: str = "DequantizeLinear") -> GraphBuilder:
    """Greedy (`next_token` = argmax) or, with sample=True, sampled from the transformed
    distribution with a supplied uniform per sequence (outputs `next_token` and `probs`).
    `matmul_weights`: how the projection and LM-head weights are stored (see GraphBuilder.matmul).
    `vocab_ids` (sorted token ids, see draft_vocab; greedy graphs only) restricts the LM head to
    those tokens: `logits` are then over the subset, `next_token` is a token id as always.
    `single_sequence`: the batch-1 ONNX Runtime variant (see _fused_attention).
    `aux_layers`: also output `aux_hidden` at every position (see _aux_hidden).
    `quantized_kernel` (every builder): how int8 and int4 weights are multiplied (GraphBuilder.matmul)."""
    g = GraphBuilder(name, matmul_weights, quantized_kernel)
    ids = g.input("input_ids", INT64, ["batch", "tokens"])
    past_len = g.input("past_len", INT64, ["batch"])
    token_count = g.input("token_count", INT64, ["batch"])
    hidden = _decoder(g, spec, ids, past_len, max_seq, single_sequence, aux_layers=aux_layers)
    # Only each sequence's last real token needs logits: gather it before the LM head.
    last = g.op("Unsqueeze", g.op("Sub", token_count, g.const(1)), g.const([1]))
    hidden_last = g.op("GatherND", hidden, last, batch_dims=1)  # [B, H]
    if not sample:
        logits = _lm_head(g, spec, hidden_last, vocab_out, vocab_ids)
        g.output(logits, "logits", FLOAT, ["batch", vocab_out if vocab_ids is None else len(vocab_ids)])
        outputs = greedy_step(g, logits, vocab_out, vocab_ids)
        names = ("next_token", "confidence", *LOGPROBS)
    else:
        assert vocab_ids is None, "sampling graphs score the whole vocabulary (see draft_vocab.py)"
        outputs = sampled_next(g, _lm_head(g, spec, hidden_last, vocab_out), vocab_out)
        names = ("next_token", "probs", *LOGPROBS)
    for tensor, output in zip(outputs, names):
        g.output(tensor, output, *OUTPUT_SHAPES[output](vocab_out, 1))
    return g


# a per-kind graph's read-back outputs: (element type, shape) for a vocabulary of V and R scored positions
OUTPUT_SHAPES = {
    "next_token": lambda v, r: (INT64, ["batch"]), "confidence": lambda v, r: (FLOAT, ["batch"]),
    "accepted": lambda v, r: (INT64, ["batch"]), "new_len": lambda v, r: (INT64, ["batch"]),
    "probs": lambda v, r: (FLOAT, ["batch", v]), "token_logprob": lambda v, r: (FLOAT, ["batch", r]),
    "top_logprobs": lambda v, r: (FLOAT, ["batch", r, TOP_LOGPROBS]),
    "top_ids": lambda v, r: (INT64, ["batch", r, TOP_LOGPROBS]),
}


def build_verify_graph(spec: ModelSpec, name: str, gamma: int, max_seq: int, vocab_out: int, sample: bool = False,
                       single_sequence: bool = False, matmul_weights: str = "float32",
                       aux_layers: tuple[int, ...] = (), quantized_kernel: str = "DequantizeLinear") -> GraphBuilder:
    """Score [last, d_1..d_γ] and apply SpecAccept: greedy on logits, or (sample=True) the
    rejection-sampling rule on the transformed target probabilities and the draft's.
    `aux_layers`: also output `aux_hidden` at all γ+1 positions (see _aux_hidden)."""
    g = GraphBuilder(name, matmul_weights, quantized_kernel)
    ids = g.input("input_ids", INT64, ["batch", gamma + 1])
    past_len = g.input("past_len", INT64, ["batch"])
    hidden = _decoder(g, spec, ids, past_len, max_seq, single_sequence, aux_layers=aux_layers)
    logits = _lm_head(g, spec, hidden, vocab_out)  # [B, γ+1, V]: stays inside the graph
    for tensor, output in zip(accept(g, logits, ids, past_len, gamma, vocab_out, sample), (*OUTPUTS, *LOGPROBS)):
        g.output(tensor, output, *OUTPUT_SHAPES[output](vocab_out, gamma + 1))
    return g


def build_score_graph(spec: ModelSpec, name: str, max_seq: int, vocab_out: int, single_sequence: bool = False,
                      matmul_weights: str = "float32", quantized_kernel: str = "DequantizeLinear") -> GraphBuilder:
    """A prefill of input_ids [B, T] that also scores the prompt: each position's log-probability of
    score_ids [B, T] (the prompt's next tokens) and its most likely tokens (compiler/logits.py)."""
    g = GraphBuilder(name, matmul_weights, quantized_kernel)
    ids = g.input("input_ids", INT64, ["batch", "tokens"])
    past_len = g.input("past_len", INT64, ["batch"])
    hidden = _decoder(g, spec, ids, past_len, max_seq, single_sequence)
    score_ids = g.input("score_ids", INT64, ["batch", "tokens"])
    for tensor, output in zip(prompt_scores(g, _lm_head(g, spec, hidden, vocab_out), score_ids, vocab_out), LOGPROBS):
        g.output(tensor, output, *OUTPUT_SHAPES[output](vocab_out, "tokens"))
    return g


MEDUSA_CANDIDATES = 10  # each head's top-k that trees choose from (the heads' measured accuracies cover as many)


def build_tree_verify_graph(spec: ModelSpec, name: str, heads: list, max_seq: int, vocab_out: int,
                            typical: bool = False, matmul_weights: str = "float32",
                            single_sequence: bool = False, quantized_kernel: str = "DequantizeLinear") -> GraphBuilder:
    """Score a token tree [B, N] (node 0: the last accepted token) whose topology is an input
    (tree_parents, tree_depths, tree_ranks [N], tree_mask [N, N]; see core/tree.py), apply the tree
    SpecAccept, and in the same pass read the Medusa heads at each row's accepted node: the next
    iteration's tree (next_tree [B, N], rooted at next_token). One target pass per iteration.
    `single_sequence`: the batch-1 ONNX Runtime variant, the tree given to the fused kernel as
    position ids and an attention bias (_tree_bias)."""
    g = GraphBuilder(name, matmul_weights, quantized_kernel)
    ids = g.input("input_ids", INT64, ["batch", "tree_nodes"])
    past_len = g.input("past_len", INT64, ["batch"])
    hidden = _decoder(g, spec, ids, past_len, max_seq, single_sequence, tree=True)
    logits = _lm_head(g, spec, hidden, vocab_out)  # [B, N, V]
    accepted, next_token, new_len, best = accept_tree(g, logits, ids, past_len, typical, vocab_out)
    next_tree = medusa_candidates(g, spec, hidden, best, next_token, heads, vocab_out)
    for tensor, output in zip((accepted, next_token, new_len, best), TREE_OUTPUTS):
        g.output(tensor, output, INT64, ["batch"])
    g.output(next_tree, "next_tree", INT64, ["batch", "tree_nodes"])
    return g


def build_eagle_tree_verify_graph(spec: ModelSpec, name: str, max_seq: int, vocab_out: int,
                                  aux_layers: tuple[int, ...], matmul_weights: str = "float32",
                                  single_sequence: bool = False,
                                  quantized_kernel: str = "DequantizeLinear") -> GraphBuilder:
    """Score a dynamic token tree [B, N] drafted by an EAGLE-3 head (topology as an input, as
    build_tree_verify_graph's) and apply the tree SpecAccept: (accepted, next_token, new_len,
    best_node), and every node's features (aux_hidden), of which the head reads the accepted path's."""
    g = GraphBuilder(name, matmul_weights, quantized_kernel)
    ids = g.input("input_ids", INT64, ["batch", "tree_nodes"])
    past_len = g.input("past_len", INT64, ["batch"])
    hidden = _decoder(g, spec, ids, past_len, max_seq, single_sequence, tree=True, aux_layers=aux_layers)
    logits = _lm_head(g, spec, hidden, vocab_out)  # [B, N, V]
    for tensor, output in zip(accept_tree(g, logits, ids, past_len, False, vocab_out), TREE_OUTPUTS):
        g.output(tensor, output, INT64, ["batch"])
    return g


# ---------------------------------------------------------------------------------------------
# what follows the LM head: shared by the graphs of each kind and the session graph


def greedy_step(b: GraphBuilder, logits: str, vocab_out: int, vocab_ids=None) -> list[str]:
    """A greedy step on logits [B, V'] (V' the scored subset `vocab_ids` of a cut draft head, else V):
    (next_token, confidence, *LOGPROBS) of the processed logits (compiler/logits.py)."""
    subset = b.weight("vocab_ids", vocab_ids) if vocab_ids is not None else None
    scores = processed(b, logits, vocab_out, vocab_ids=subset, single=True)
    best = b.op("ArgMax", scores, axis=-1, keepdims=1)  # [B, 1]: its place in the scored vocabulary
    token, top, top_ids = logprob_outputs(b, scores, lambda branch: best,
                                          vocab_out if vocab_ids is None else len(vocab_ids), single=True)
    best = b.op("Squeeze", best, b.const([1]))
    if subset is not None:
        best, top_ids = b.op("Gather", subset, best), b.op("Gather", subset, top_ids)
    return [best, greedy_confidence(b, scores), token, top, top_ids]


def greedy_confidence(b: GraphBuilder, logits: str) -> str:
    """The greedy token's probability [B]: the largest of softmax(logits [B, V']), over the scored
    vocabulary (a cut draft head's subset, then)."""
    return b.op("ReduceMax", b.op("Softmax", logits, axis=-1), b.const([-1]), keepdims=0)


def sampled_next(b: GraphBuilder, logits: str, vocab_out: int) -> list[str]:
    """A token sampled from the processed, transformed distribution of logits [B, V]: by inverse CDF
    with a supplied uniform per sequence, or in the rows marked `coupled` by Gumbel-max with a supplied
    noise [B, V] (core/acceptance.py, the coupled rule); returns (next_token [B], probs [B, V], *LOGPROBS)."""
    params = _sampling_inputs(b)
    uniform = b.input("uniform", FLOAT, ["batch"])
    coupled = b.input("coupled", BOOL, ["batch"])
    noise = b.input("noise", FLOAT, ["batch", vocab_out])
    scores = processed(b, b.op("Unsqueeze", logits, b.const([1])), vocab_out)  # [B, 1, V]
    drawn_from = min_p_filtered(b, spec_op(b, "SpecTransform", scores, *params, vocab_size=vocab_out))
    probs = b.op("Squeeze", drawn_from, b.const([1]))
    gumbel_max = b.op("ArgMax", gumbel_scores(b, probs, noise), axis=-1, keepdims=0)
    token = b.op("Where", coupled, gumbel_max, spec_op(b, "SpecSample", probs, uniform))
    logprobs = logprob_outputs(b, scores, lambda branch: branch.op("Unsqueeze", token, branch.const([1])), vocab_out,
                               drawn_from, params[0])
    return [token, probs, *logprobs]


def accept(b: GraphBuilder, logits: str, ids: str, past_len: str, gamma: int | str, vocab_out: int,
           sample: bool) -> list[str]:
    """SpecAccept over the processed logits [B, γ+1, V] of ids [last, d_1..d_γ], of which the first
    draft_len [B] are real drafts (a graph input): (accepted, next_token, new_len, *LOGPROBS)."""
    end = b.op("Shape", ids, start=1, end=2) if isinstance(gamma, str) else b.const([gamma + 1])
    drafts = b.op("Slice", ids, b.const([1]), end, b.const([1]))
    draft_len = b.input("draft_len", INT64, ["batch"])
    positions = gamma + 1 if isinstance(gamma, int) else "positions"
    scores = processed(b, logits, vocab_out, drafts=drafts, positions=positions)
    if not sample:
        outputs = spec_accept_node(b, scores, drafts, draft_len, past_len)
        return [*outputs, *logprob_outputs(b, scores, lambda branch: emitted_tokens(branch, ids, *outputs[:2]),
                                           vocab_out)]
    draft_probs = b.input("draft_probs", FLOAT, ["batch", gamma, vocab_out])
    params = _sampling_inputs(b)
    u_accept = b.input("u_accept", FLOAT, ["batch", gamma])
    u_sample = b.input("u_sample", FLOAT, ["batch"])
    # rows verified by the coupled rule (core/acceptance.py): the greedy rule on Gumbel-perturbed scores
    coupled = b.input("coupled", BOOL, ["batch"])
    noise = b.input("verify_noise", FLOAT, ["batch", positions, vocab_out])  # [B, γ+1, V]
    target_probs = min_p_filtered(b, spec_op(b, "SpecTransform", scores, *params, vocab_size=vocab_out))
    rejection = spec_op(b, "SpecAccept", target_probs, draft_probs, drafts, draft_len, u_accept, u_sample, past_len,
                        mode="sample", outputs=3)
    draws = b.op("ArgMax", gumbel_scores(b, target_probs, noise), axis=-1, keepdims=0)  # [B, γ+1]
    drawn = accept_tokens(b, draws, drafts, draft_len, past_len)
    outputs = [b.op("Where", coupled, c, r) for c, r in zip(drawn, rejection)]
    return [*outputs, *logprob_outputs(b, scores, lambda branch: emitted_tokens(branch, ids, *outputs[:2]), vocab_out,
                                       target_probs, params[0])]


def accept_tree(b: GraphBuilder, logits: str, ids: str, past_len: str, typical: bool, vocab_out: int) -> list[str]:
    """Tree SpecAccept over logits [B, N, V] of the tree ids [B, N], of which the first 1 + draft_len
    nodes are verified: (accepted, next_token, new_len, best_node). A grammar's mask applies at each
    node (the state after the path to it); a tree takes no other processor."""
    draft_len = b.input("draft_len", INT64, ["batch"])
    logits = constrained(b, logits, vocab_out, "tree_nodes")  # the `constrain` switch
    topology = (b.input("tree_parents", INT64, ["tree_nodes"]), b.input("tree_depths", INT64, ["tree_nodes"]),
                b.input("tree_mask", BOOL, ["tree_nodes", "tree_nodes"]))
    rule = None
    if typical:
        rule = (b.input("typical_epsilon", FLOAT, ["batch"]), b.input("typical_delta", FLOAT, ["batch"]))
    return spec_accept_tree_node(b, logits, ids, draft_len, past_len, topology, rule)


def medusa_candidates(b: GraphBuilder, spec: ModelSpec, hidden: str, best: str, next_token: str, heads: list,
                      vocab_out: int, candidates: int = MEDUSA_CANDIDATES) -> str:
    """The next tree's tokens [B, N]: next_token at the root; node i the rank(i)-th candidate of head
    depth(i)-1 (ranks < `candidates`), every head reading the final-normed hidden state of the row's
    accepted node.

    Head k: h + SiLU(h W_k^T + b_k), then the target's own LM head (Medusa-1's residual block).
    The heads run in one LM-head multiplication [B, D, H] x [H, V], D the tree's depth (<= K)."""
    h = _norm(b, spec, b.op("GatherND", hidden, b.op("Unsqueeze", best, b.const([1])), batch_dims=1), "final_norm")
    blocks = []
    for k, (weight, bias) in enumerate(heads):
        z = b.op("Add", b.op("MatMul", h, b.weight(f"medusa{k}_w", np.ascontiguousarray(weight.T, np.float32))),
                 b.weight(f"medusa{k}_b", np.asarray(bias, np.float32)))
        blocks.append(b.op("Unsqueeze", b.op("Add", h, b.op("Mul", z, b.op("Sigmoid", z))), b.const([1])))
    stacked = b.op("Concat", *blocks, axis=1) if len(blocks) > 1 else blocks[0]  # [B, K, H]
    ranks = b.input("tree_ranks", INT64, ["tree_nodes"])
    depths = b.input("tree_depths", INT64, ["tree_nodes"])
    # only the heads the tree is deep enough to read reach the LM head, its costliest part
    used = b.op("Max", b.op("ReduceMax", depths, keepdims=1), b.const([1]))  # [1]: D, at least one head
    stacked = b.op("Slice", stacked, b.const([0]), used, b.const([1]))  # [B, D, H]
    head_logits = _lm_head_matmul(b, spec, stacked, vocab_out, shared=True)  # [B, D, V]
    top = b.const([candidates])  # a build-time constant: TensorRT's TopK takes no other K
    ranked = b.op("TopK", head_logits, top, axis=-1, largest=1, sorted=1, outputs=2)[1]  # [B, D, top]
    flat = b.op("Reshape", ranked, b.const([0, -1]))  # [B, D * top]
    end = b.const([1 << 62])
    slots = b.op("Add", b.op("Mul", b.op("Sub", b.op("Slice", depths, b.const([1]), end), b.const(1)), top),
                 b.op("Slice", ranks, b.const([1]), end))  # [N-1]: node i's place in flat
    return b.op("Concat", b.op("Unsqueeze", next_token, b.const([1])), b.op("Gather", flat, slots, axis=1), axis=1)


def _sampling_inputs(g: GraphBuilder) -> tuple[str, str, str]:
    """Per-sequence sampling controls: temperature (0 = greedy), top_k (0 = off), top_p (1 = off)."""
    return (g.input("temperature", FLOAT, ["batch"]), g.input("top_k", INT64, ["batch"]),
            g.input("top_p", FLOAT, ["batch"]))


def cache_shape(spec: ModelSpec, max_seq: int) -> list:
    return kv_cache_shape(spec.hp["num_kv_heads"], spec.hp["head_dim"], max_seq)


# ---------------------------------------------------------------------------------------------
# decoder body


def _decoder(g: GraphBuilder, spec: ModelSpec, ids: str, past_len: str, max_seq: int, single_sequence: bool = False,
             fused_flag: str | None = None, tree: bool = False, tree_flag: str | None = None,
             aux_layers: tuple[int, ...] = ()) -> str:
    """Embeddings, all blocks and the cache I/O; returns the last block's output [B, T, H].

    Attention runs the standard ONNX ops, or with `single_sequence` ONNX Runtime's fused kernel, or
    with `fused_flag` (a boolean scalar tensor) whichever the flag says, per call (session graphs).
    `tree`: the T tokens are a token tree (core/tree.py) whose depths and ancestor mask are inputs;
    `tree_flag` (a boolean scalar tensor): they are one when the flag says, per call (session graphs).
    `aux_layers`: also the `aux_hidden` output (_aux_hidden); none: the graph has no trace of it."""
    hp, w = spec.hp, spec.weights
    num_tokens = g.op("Gather", g.op("Shape", ids), g.const(1))  # scalar T
    positions = None
    if "pos_embed" in w or not single_sequence:
        positions = g.op("Add", g.op("Unsqueeze", past_len, g.const([1])), _offsets(g, num_tokens, tree, tree_flag))
    x = _embedding(g, w["embed"], ids)
    if spec.arch.embed_scale:  # Gemma: sqrt(hidden) rounded to the embedding's dtype, as HF multiplies
        x = g.op("Mul", x, g.const(np.float32(hp["hidden_size"] ** 0.5), np.float32))
    if "pos_embed" in w:
        x = g.op("Add", x, g.op("Gather", g.weight("pos_embed", w["pos_embed"]), positions))
    layers = _attention_layers(g, spec, max_seq)
    if single_sequence:
        assert not tree_flag, "session graphs choose the attention kernel per call: trees take the standard ops"
        tree_bias = _tree_bias(g, past_len, num_tokens, layers) if tree else None
        core = _fused_attention(g, spec, past_len, num_tokens, layers, max_seq, tree_bias)
    else:
        core = _onnx_attention(g, spec, past_len, num_tokens, positions, layers, max_seq, tree, tree_flag)
        if fused_flag is not None and fused_attention_supported(spec):
            fused = _fused_attention(g, spec, past_len, num_tokens, layers, max_seq)
            core = _either_attention(g, spec, max_seq, fused_flag, fused, core)
    entering = []  # the residual stream entering each block
    for i in range(hp["num_layers"]):
        g.scope = f"layer{i}/"
        entering.append(x)
        x = _block(g, spec, i, x, core)
    g.scope = ""
    if aux_layers:
        assert all(0 <= i < len(entering) for i in aux_layers), f"aux layers {aux_layers} of {len(entering)} layers"
        _aux_hidden(g, spec, ids, [entering[i] for i in aux_layers])
    return x


def _aux_hidden(g: GraphBuilder, spec: ModelSpec, ids: str, states: list[str]) -> str:
    """Output `aux_hidden` [B, T, len(states) * H]: at every position of ids [B, T], the residual
    stream entering each listed block, side by side in the listed order. It is HF's
    `hidden_states[i]` (embeddings for i = 0; never the final-normed last one), the features an
    EAGLE-3 head drafts from (vLLM's llama.py collects `hidden_states + residual` before block i)."""
    [tokens] = [value.type.tensor_type.shape.dim[1] for value in g.inputs if value.name == ids]
    width = len(states) * spec.hp["hidden_size"]
    # its own node name, so that the graph's other nodes are named as without it
    aux = g.op("Concat", *states, axis=-1, out=AUX_HIDDEN, node=f"{AUX_HIDDEN}/Concat")
    return g.output(aux, AUX_HIDDEN, FLOAT, ["batch", tokens.dim_param or tokens.dim_value, width])


def _embedding(g, embed, ids) -> str:
    """The rows of `ids` [B, T] -> [B, T, H]. A table in blocks along H (a GGUF's token_embd in a kept
    block format, or a low-bit model's, ModelSpec.store_embedding_at) is gathered as int8, scaled per
    block after the gather and, where its format has minimums, offset per block: the same float32
    values as the dequantized table at about a quarter of its bytes. 4-bit integers are stored
    widened to int8 (exact): TensorRT cannot gather int4 rows nor cast them."""
    blocks = getattr(embed, "blocks", None)
    if blocks is None or blocks.axis != 1:
        return g.op("Gather", g.weight("embed", embed), ids)
    q = blocks.q if blocks.bits == 8 else cast(blocks.q, np.dtype(np.int8))
    rows = g.op("Cast", g.op("Gather", g.weight("embed_q", q), ids), to=FLOAT)  # [B, T, H]
    scales = g.op("Gather", g.weight("embed_scale", blocks.scale), ids)  # [B, T, H / block]
    per_block = g.op("Reshape", rows, g.const([0, 0, -1, blocks.block]))  # [B, T, H / block, block]
    scaled = g.op("Mul", per_block, g.op("Unsqueeze", scales, g.const([3])))
    if blocks.offset is not None:
        offsets = g.op("Gather", g.weight("embed_offset", blocks.offset), ids)  # [B, T, H / block]
        scaled = g.op("Add", scaled, g.op("Unsqueeze", offsets, g.const([3])))
    return g.op("Reshape", scaled, g.const([0, 0, -1]))


@dataclass(frozen=True)
class AttentionLayer:
    """What one layer's attention needs beyond its weights: its RoPE tables (cos, sin weight names;
    None without RoPE) and its sliding window (keys a query sees, its own included; None: all)."""

    rope: tuple[str, str] | None
    window: int | None


def _attention_layers(g, spec, max_seq) -> list[AttentionLayer]:
    """Per layer; layers of one RoPE setting share one pair of tables (Gemma 3 has two settings)."""
    hp = spec.hp
    if hp["layer_ropes"] is None:
        return [AttentionLayer(None, window) for window in hp["layer_windows"]]
    distinct = []
    for rope in hp["layer_ropes"]:
        if rope not in distinct:
            distinct.append(rope)
    tables = []
    for k, rope in enumerate(distinct):
        cos, sin = rope_tables(rope, hp["rotary_dim"], max_seq)
        suffix = "" if k == 0 else f"_{k}"
        tables.append((g.weight("rope_cos" + suffix, cos), g.weight("rope_sin" + suffix, sin)))
    return [AttentionLayer(tables[distinct.index(rope)], window)
            for rope, window in zip(hp["layer_ropes"], hp["layer_windows"])]


def _windows(layers: list[AttentionLayer]) -> list:
    """The distinct sliding windows of the layers (None: full attention), each needing its own mask."""
    return sorted({layer.window for layer in layers}, key=lambda w: w or 0)


def _offsets(g, num_tokens, tree: bool, tree_flag: str | None) -> str:
    """[T]: each token's position after past_len: 0..T-1 in a sequence, its depth in a tree."""
    if tree:
        return g.input("tree_depths", INT64, ["tree_nodes"])
    steps = g.op("Range", g.const(0), num_tokens, g.const(1))
    if tree_flag is None:
        return steps
    depths = g.input("tree_depths", INT64, ["tree_nodes"])
    return _either(g, tree_flag, "offsets", lambda b: b.op("Identity", depths), lambda b: b.op("Identity", steps),
                   INT64)


def _either(g, flag: str, label: str, then, otherwise, elem_type) -> str:
    """If(flag) over two weight-free computations `then(b)` / `otherwise(b)` of one tensor each."""
    branches = []
    for name, make in (("tree", then), ("sequence", otherwise)):
        branch = g.branch(f"{label}_{name}")
        branches.append(branch.graph([(make(branch), elem_type)]))
    return g.op("If", flag, then_branch=branches[0], else_branch=branches[1])


def _attention_mask(g, past_len, num_tokens, positions, tree: bool = False, tree_flag: str | None = None,
                    windows=()) -> tuple[str, dict]:
    """Keys read: positions [0, max(past_len)+T). Query at position p sees key j iff j <= p; a tree's
    node i sees the cached prefix and, of the tree (written at past_len..past_len+T-1 in node order),
    its ancestors and itself. Returns the keys' count and {window: mask} for each of `windows`
    (None: no window): a sliding window of W also hides keys j <= p - W (HF's sliding overlay).
    A tree's keys sit at cache slots past positions, never further back, so the rule holds there."""
    kv_len = g.op("Add", g.op("ReduceMax", past_len, keepdims=1), g.op("Unsqueeze", num_tokens, g.const([0])))
    key_pos = g.op("Range", g.const(0), g.op("Squeeze", kv_len, g.const([0])), g.const(1))  # [L]

    def sequence(b):
        return b.op("LessOrEqual", key_pos, b.op("Unsqueeze", positions, b.const([2])))  # [B, T, L]

    def token_tree(b):
        mask = b.input("tree_mask", BOOL, ["tree_nodes", "tree_nodes"])
        relative = b.op("Sub", b.op("Unsqueeze", key_pos, b.const([0])), b.op("Unsqueeze", past_len, b.const([1])))
        last = b.op("Sub", b.op("Unsqueeze", num_tokens, b.const([0])), b.const([1]))
        node = b.op("Min", b.op("Max", relative, b.const([0])), last)  # [B, L]: the node a tree key holds
        in_tree = b.op("And", b.op("GreaterOrEqual", relative, b.const(0)), b.op("LessOrEqual", relative, last))
        ancestor = b.op("Transpose", b.op("Gather", mask, node, axis=1), perm=[1, 0, 2])  # [B, T, L]
        cached = b.op("Unsqueeze", b.op("Less", relative, b.const(0)), b.const([1]))  # [B, 1, L]
        return b.op("Or", cached, b.op("And", b.op("Unsqueeze", in_tree, b.const([1])), ancestor))

    if tree:
        visible = token_tree(g)
    elif tree_flag is not None:
        visible = _either(g, tree_flag, "mask", token_tree, sequence, BOOL)
    else:
        visible = sequence(g)
    masks = {}
    for window in windows:
        mask = visible
        if window is not None:
            oldest = g.op("Sub", g.op("Unsqueeze", positions, g.const([2])), g.const(window))  # [B, T, 1]
            mask = g.op("And", visible, g.op("Greater", key_pos, oldest))
        masks[window] = g.op("Unsqueeze", mask, g.const([1]))  # [B, 1, T, L]: the same for every head
    return kv_len, masks


def _block(g, spec, i, x, core):
    """One block. `core(b, i, qkv)` is attention after the fused QKV projection, emitted into builder
    b; the projections stay in the caller's graph (a session graph's weights must not sit in a branch).
    With sandwich norms (Gemma 3), the attention's and the MLP's outputs are normed before each add."""
    p = f"layers.{i}."
    h = _norm(g, spec, x, p + "attn_norm")
    qkv = _linear(g, spec, h, p + "qkv", parts=(p + "q", p + "k", p + "v"))  # [B, T, (Hq+2Hkv)*D]
    if spec.arch.qk_norm:
        qkv = _qk_normed(g, spec, i, qkv)
    attention = _linear(g, spec, core(g, i, qkv), p + "o")
    if spec.arch.sandwich_norms:
        attention = _norm(g, spec, attention, p + "attn_out_norm")
    x = g.op("Add", x, attention)
    mlp = _mlp(g, spec, p, _norm(g, spec, x, p + "mlp_norm"))
    if spec.arch.sandwich_norms:
        mlp = _norm(g, spec, mlp, p + "mlp_out_norm")
    return g.op("Add", x, mlp)


def _qk_normed(g, spec, i, qkv):
    """RMSNorm over each head of q and of k (Qwen3, Gemma 3), before RoPE; v untouched. On the packed
    projection [B, T, (Hq+2Hkv)*D], so both attention kernels take it as before."""
    hp = spec.hp
    heads, kv_heads, head_dim = hp["num_heads"], hp["num_kv_heads"], hp["head_dim"]
    split = g.op("Reshape", qkv, g.const([0, 0, heads + 2 * kv_heads, head_dim]))
    q, k, v = g.op("Split", split, g.const([heads, kv_heads, kv_heads]), axis=2, outputs=3)
    q, k = _norm(g, spec, q, f"layers.{i}.q_norm"), _norm(g, spec, k, f"layers.{i}.k_norm")
    return g.op("Reshape", g.op("Concat", q, k, v, axis=2), g.const([0, 0, -1]))


def _onnx_attention(g, spec, past_len, num_tokens, positions, layers, max_seq, tree=False, tree_flag=None,
                    visible=None):
    """Standard ONNX ops, any batch: RoPE, the cache write, and ONNX Attention (GQA from the shapes),
    after one fused QKV projection. `visible` (a model without sliding windows): the keys each token
    sees, given as a [B, T, max(past_len) + T] boolean input instead of the causal or tree rule.

    Few, large nodes on purpose: each is one fused kernel in ONNX Runtime (three projections cost
    one GEMV launch instead of three), and TensorRT maps RotaryEmbedding/Attention to fused layers.
    """
    hp = spec.hp
    heads, kv_heads, head_dim = hp["num_heads"], hp["num_kv_heads"], hp["head_dim"]
    if visible is None:
        kv_len, masks = _attention_mask(g, past_len, num_tokens, positions, tree, tree_flag, _windows(layers))
    else:
        assert _windows(layers) == [None], "a given mask is for models without sliding windows"
        kv_len = g.op("Add", g.op("ReduceMax", past_len, keepdims=1), g.op("Unsqueeze", num_tokens, g.const([0])))
        masks = {None: g.op("Unsqueeze", visible, g.const([1]))}  # [B, 1, T, L]
    rotary = {} if hp["rotary_dim"] in (None, head_dim) else {"rotary_embedding_dim": hp["rotary_dim"]}

    def core(b, i, qkv):
        layer = layers[i]
        qkv = b.op("Reshape", qkv, b.const([0, 0, heads + 2 * kv_heads, head_dim]))
        qkv = b.op("Transpose", qkv, perm=[0, 2, 1, 3])  # [B, Hq+2Hkv, T, D]
        q, k, v = b.op("Split", qkv, b.const([heads, kv_heads, kv_heads]), axis=1, outputs=3)
        if layer.rope is not None:
            q, k = (b.op("RotaryEmbedding", t, *layer.rope, positions, **rotary) for t in (q, k))
        keys = _write_cache(b, f"key.{i}", k, past_len, spec, max_seq, kv_len)
        values = _write_cache(b, f"value.{i}", v, past_len, spec, max_seq, kv_len)
        context = b.op("Attention", q, keys, values, masks[layer.window], scale=float(hp["attn_scale"]))
        context = b.op("Transpose", context, perm=[0, 2, 1, 3])
        return b.op("Reshape", context, b.const([0, 0, heads * head_dim]))

    return core


def fused_attention_supported(spec: ModelSpec) -> bool:
    """What ONNX Runtime's GroupQueryAttention CPU kernel accepts (it checks at run time, not load)."""
    hp = spec.hp
    # partial rotary: the kernel turns the first 2 × (cos table width) dimensions, a width it takes in multiples of 8
    partial = hp["rotary_dim"] not in (None, hp["head_dim"])
    rotary_ok = not partial or (hp["rotary_dim"] // 2) % 8 == 0
    return hp["head_dim"] % 16 == 0 and hp["num_heads"] % hp["num_kv_heads"] == 0 and rotary_ok


def _tree_bias(g, past_len, num_tokens, layers) -> tuple[str, dict]:
    """A tree for the fused kernel (one sequence): (position_ids [1, T]: past_len + depth, {window:
    attention bias [1, 1, T, past_len + T]}: 0 where a node sees a key, the float minimum elsewhere).
    The kernel stays causal; a node's ancestors precede it, so the bias only hides the other earlier
    nodes, and the keys beyond a layer's window."""
    depths = g.input("tree_depths", INT64, ["tree_nodes"])
    positions = g.op("Add", g.op("Unsqueeze", past_len, g.const([1])), depths)  # [1, T]
    _, masks = _attention_mask(g, past_len, num_tokens, positions, tree=True, windows=_windows(layers))
    hidden = g.const(float(np.finfo(np.float32).min), np.float32)
    return positions, {window: g.op("Where", mask, g.const(0.0, np.float32), hidden) for window, mask in masks.items()}


def _fused_attention(g, spec, past_len, num_tokens, layers, max_seq, tree_bias: tuple[str, dict] | None = None):
    """ONNX Runtime's GroupQueryAttention (com.microsoft), one sequence: RoPE, the in-place cache
    write and attention in one kernel over the packed QKV projection.

    Why a second implementation: the standard one copies each layer's live K/V prefix out of the
    fixed-capacity cache (Slice) before Attention, a cost that grows with context; this kernel reads
    the cache where it lies, and the block shrinks from 14 nodes to 3. Why one sequence: with a
    past, ONNX Runtime's kernel takes several new tokens per call only at batch 1 (verification and
    draft catch-up need several). ONNX Runtime only: TensorRT builds from the standard graphs.
    A sliding window is the kernel's local_window_size (keys a query sees, its own included, as HF counts),
    or for a tree part of the bias.
    """
    hp = spec.hp
    total = g.op("Add", past_len, g.op("Unsqueeze", num_tokens, g.const([0])))  # [1]: every token is real at batch 1
    seqlens_k = g.op("Cast", g.op("Sub", total, g.const(1)), to=INT32)  # index of the last token, per sequence
    total_len = g.op("Cast", g.op("ReduceMax", total, keepdims=0), to=INT32)
    g.domains[ORT_DOMAIN] = 1
    shape = cache_shape(spec, max_seq)

    def core(b, i, qkv):
        layer = layers[i]
        past_key, past_value = b.input(f"past_key.{i}", FLOAT, shape), b.input(f"past_value.{i}", FLOAT, shape)
        outputs = [f"{b.scope}GroupQueryAttention/out", f"present_key.{i}", f"present_value.{i}"]
        window = {}
        if tree_bias is not None:
            extra = (tree_bias[0], tree_bias[1][layer.window])
        else:
            extra = ()
            if layer.window is not None:
                window = {"local_window_size": layer.window}
        context, present_key, present_value = b.op(
            "GroupQueryAttention", qkv, "", "", past_key, past_value, seqlens_k, total_len, *(layer.rope or ("", "")),
            *extra,
            domain=ORT_DOMAIN, outputs=3, out=outputs, num_heads=hp["num_heads"], kv_num_heads=hp["num_kv_heads"],
            scale=float(hp["attn_scale"]), do_rotary=int(layer.rope is not None), rotary_interleaved=0, **window)
        for present, name in ((present_key, f"present_key.{i}"), (present_value, f"present_value.{i}")):
            b.output(present, name, FLOAT, shape)
        return context  # [1, T, Hq*D] already

    return core


def _either_attention(g, spec, max_seq, fused_flag: str, fused, standard):
    """Per call, the fused kernel where `fused_flag` holds (batch 1), the standard ops otherwise: an
    If whose two branches hold no weights, so the projections around it stay in the main graph,
    where ONNX Runtime pre-packs them once (it does not pre-pack weights a branch reads)."""
    shape = cache_shape(spec, max_seq)

    def core(b, i, qkv):
        assert b is g, "session graphs choose the attention kernel at the top level"
        branches = []
        for label, make in (("fused", fused), ("standard", standard)):
            branch = g.branch(label)
            context = make(branch, i, qkv)
            yields = [context, branch.yields[f"present_key.{i}"], branch.yields[f"present_value.{i}"]]
            branches.append(branch.graph([(tensor, FLOAT) for tensor in yields]))
        outputs = [f"{g.scope}attention/context", f"present_key.{i}", f"present_value.{i}"]
        g.op("If", fused_flag, outputs=3, out=outputs, then_branch=branches[0], else_branch=branches[1])
        for name in outputs[1:]:
            g.output(name, name, FLOAT, shape)
        return outputs[0]

    return core


def _write_cache(b, name, new, past_len, spec, max_seq, kv_len):
    """Write new K or V at positions past_len.. in place; return the readable prefix [B, H, L, D]."""
    shape = cache_shape(spec, max_seq)
    past = b.input(f"past_{name}", FLOAT, shape)
    present = b.op("TensorScatter", past, new, past_len, axis=-2, out=f"present_{name}")
    b.output(present, f"present_{name}", FLOAT, shape)
    return b.op("Slice", present, b.const([0]), kv_len, b.const([2]))


# ---------------------------------------------------------------------------------------------
# rotary embeddings (HF "rotate_half" convention = ONNX RotaryEmbedding with interleaved=0)


def rope_tables(rope: Rope, head_dim: int, max_seq: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [S, D/2] of position × inverse frequency (as the model's RoPE scaling gives it),
    times the scaling's attention factor, computed in fp32 as HF does.

    RotaryEmbedding rotates the pairs (x_j, x_{j+D/2}): [x1*cos - x2*sin, x2*cos + x1*sin], which is
    HF's x*cos + rotate_half(x)*sin with cos/sin repeated over both halves. Both are linear in cos and
    sin, so HF's scaling of cos and sin (YaRN's mscale) can live in the tables.
    """
    inv_freq, attention = inverse_frequencies(rope, head_dim, max_seq)
    freqs = np.arange(max_seq, dtype=np.float32)[:, None] * inv_freq[None, :]
    return (np.cos(freqs) * attention).astype(np.float32), (np.sin(freqs) * attention).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# norms, projections, MLP


def _linear(g, spec, x, prefix, parts=None):
    """x [B, T, K] @ W (+ b). With `parts`, W is those projections side by side: one MatMul instead of several
    (their outputs are split or reshaped by the caller). Parts kept in different source blocks (a
    GGUF's Q8_0 v beside Q5_0 q and k) multiply in one MatMul per run of alike parts, so that each
    keeps its own numbers."""
    w = spec.weights
    names = parts or (prefix,)
    runs = [list(run) for _, run in itertools.groupby(names, key=lambda n: _blocks_kind(w[n + "_w"]))]
    if len(runs) == 1:
        weight = w[names[0] + "_w"] if parts is None else concatenated([w[n + "_w"] for n in names], axis=1)
        y = g.matmul(x, prefix + "_w", weight, rank=3)
    else:
        products = [g.matmul(x, f"{prefix}{k}_w", concatenated([w[n + "_w"] for n in run], axis=1), rank=3)
                    for k, run in enumerate(runs)]
        y = g.op("Concat", *products, axis=-1)
    has_bias = [n + "_b" in w for n in names]
    assert all(has_bias) or not any(has_bias), f"{prefix}: bias on some of {names} only"
    if all(has_bias):
        bias = concatenated([w[n + "_b"] for n in names])
        y = g.op("Add", y, g.weight(prefix + "_b", bias))
    return y


def _blocks_kind(weight) -> tuple | None:
    blocks = getattr(weight, "blocks", None)
    return None if blocks is None else (blocks.bits, blocks.block, blocks.axis)


def _norm(g, spec, x, prefix):
    w = spec.weights
    scale = g.weight(prefix + "_w", w[prefix + "_w"])
    eps = float(spec.hp["norm_eps"])
    if spec.arch.block == "gpt2":
        return g.op("LayerNormalization", x, scale, g.weight(prefix + "_b", w[prefix + "_b"]), axis=-1, epsilon=eps)
    return g.op("RMSNormalization", x, scale, axis=-1, epsilon=eps)


def _mlp(g, spec, p, h):
    if spec.arch.block == "llama":  # down(act(gate(h)) * up(h)), act SiLU or (Gemma) GELU-tanh
        gate_up = _linear(g, spec, h, p + "gate_up", parts=(p + "gate", p + "up"))
        gate, up = g.op("Split", gate_up, axis=-1, num_outputs=2, outputs=2)
        if spec.hp["activation"] == "gelu_pytorch_tanh":
            gate = _gelu_tanh(g, gate)
        else:
            gate = g.op("Mul", gate, g.op("Sigmoid", gate))
        return _linear(g, spec, g.op("Mul", gate, up), p + "down")
    return _linear(g, spec, _gelu_tanh(g, _linear(g, spec, h, p + "up")), p + "down")


def _gelu_tanh(g, x):
    # GPT-2's gelu_new: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    cube = g.op("Mul", g.op("Mul", x, x), x)
    inner = g.op("Add", x, g.op("Mul", cube, g.const(0.044715, np.float32)))
    tanh = g.op("Tanh", g.op("Mul", inner, g.const(np.sqrt(2.0 / np.pi), np.float32)))
    return g.op("Mul", g.op("Mul", x, g.const(0.5, np.float32)), g.op("Add", tanh, g.const(1.0, np.float32)))


def _lm_head(g, spec, hidden, vocab_out, vocab_ids=None, shared: bool = False):
    """Final norm and LM head; `shared`: read from a branch, the weight being the main body's own."""
    return _lm_head_matmul(g, spec, _norm(g, spec, hidden, "final_norm"), vocab_out, vocab_ids, shared)


def _lm_head_matmul(g, spec, hidden, vocab_out, vocab_ids=None, shared: bool = False):
    head, name = spec.weights["lm_head"], "lm_head"
    if vocab_ids is not None:  # its own weight: the model's other graphs keep the whole head
        head, name = columns(head, vocab_ids), f"lm_head_top{len(vocab_ids)}"
    elif head.shape[1] != vocab_out:  # draft and target may pad their embeddings differently
        head = columns(head, slice(0, vocab_out))
    return g.matmul(hidden, name, head, shared=shared)
