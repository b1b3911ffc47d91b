"""ONNX graphs of an EAGLE-3 head (eagle_head.py): its one layer over its own KV cache.

Two graphs over one weight set (their weights have the same names, so one WeightFile holds them once):

  eagle_catch_up  input_ids [B, T] (token t+1 at position t), aux_hidden [B, T, 3·Ht] (the target's
                  features at positions t), past_len [B], token_count [B]
                  -> next_token [B], confidence [B], hidden [B, H]
                  fc fuses the features; the layer runs over the T positions, writing the cache at
                  past_len .. past_len+T-1; outputs are read at each row's last real position
                  (token_count - 1; rows are right-padded to T, as the target's forward graph takes them;
                  a row may read none). Every row's past_len + T must fit max_seq, padding included.
  eagle_step      input_ids [B, 1] (the previous draft), hidden_in [B, 1, H] (the previous `hidden`),
                  past_len [B]  -> the same outputs, one position further on; no fc.

next_token is a target id (argmax over the draft vocabulary, then + d2t), confidence its probability
(softmax over the draft vocabulary), hidden the layer's output before `norm`, fed back as the next
step's hidden_in.

Their sampled variants (eagle_catch_up_sample, eagle_step_sample: build_eagle_graphs(sample=True)) take
the target's sample graph's inputs besides (temperature, top_k, top_p, uniform [B], coupled [B], noise
[B, V]; V the target's vocabulary) and return probs [B, V] in place of confidence: the head's
distribution after each row's temperature, top-k and top-p (SpecTransform over the draft vocabulary,
scattered to the target ids through d2t, zero elsewhere), from which next_token is drawn by inverse CDF
with `uniform`, or in the `coupled` rows by Gumbel-max with `noise` (core/acceptance.py's two rules).
No logits processors apply: the draft distribution need only be the one the draft was drawn from.

The cache is the target's scheme exactly (transformer.py): past_key.0 / past_value.0
[B, kv heads, max_seq, head dim] in, present_key.0 / present_value.0 out, written in place by
TensorScatter at positions past_len.., RoPE at the same positions; rolling back is a smaller past_len.

The layer (see eagle_head.py for the maths) is built from the target's own helpers over a ModelSpec
of one Llama layer whose weights are the head's under the target's canonical names (_layer_spec):
the fused QKV and gate/up projections, RMSNorm, RoPE tables and attention are the target's nodes.
Only the head's own wiring is here: the 2H-wide attention input and the residual it keeps.

The token embedding is the head's own where its checkpoint has one, else the target's, stored under
the target's weight names (embed, or a GGUF's embed_q / embed_scale): so the head's graphs may carry a
copy in their own file (write_eagle_graphs' default) or read the target's bytes where they lie
(write_eagle_graphs(borrowed=...)), an external-data reference into the target's weights file.
"""

from pathlib import Path

import numpy as np
import onnx

from speccompile.bundle import TOP_LOGPROBS
from speccompile.compiler.architectures import LLAMA
from speccompile.compiler.checkpoint import ModelSpec
from speccompile.compiler.onnx_graph import BOOL, FLOAT, INT64, GraphBuilder, WeightFile, _lazy
from speccompile.compiler.rope import SCALINGS, Rope
from speccompile.compiler.spec_accept import gumbel_scores, spec_op
from speccompile.compiler.tensors import LazyTensor, transposed
from speccompile.compiler.transformer import (
    _attention_layers,
    _embedding,
    _fused_attention,
    _linear,
    _lm_head,
    _mlp,
    _norm,
    _offsets,
    _onnx_attention,
    _sampling_inputs,
    fused_attention_supported,
    greedy_confidence,
)
from speccompile.eagle_head import Eagle3Head, draft_to_target
from speccompile.errors import SpecCompileError

CATCH_UP, STEP = "eagle_catch_up", "eagle_step"
EAGLE_KINDS = (CATCH_UP, STEP)
CATCH_UP_SAMPLE, STEP_SAMPLE = "eagle_catch_up_sample", "eagle_step_sample"
SAMPLED_KINDS = (CATCH_UP_SAMPLE, STEP_SAMPLE)
TREE_CATCH_UP, TREE_STEP = "eagle_tree_catch_up", "eagle_tree_step"  # a dynamic tree's (core/proposers/eagle_tree.py)
OUTPUTS = ("next_token", "confidence", "hidden")  # what a runtime reads back from either graph (the rest: cache)
SAMPLED_OUTPUTS = ("next_token", "probs", "hidden")  # and from a sampled one
EMBEDDING_WEIGHTS = ("embed", "embed_q", "embed_scale")  # the names _embedding stores a table under
WEIGHTS_FILE = "eagle.weights"
LAYER = "layers.0."
# RoPE scalings whose tables need only their own parameters: Eagle3Config keeps no max_position_embeddings
ROPE_TYPES = ("default", "linear", "llama3")


def build_eagle_graphs(head: Eagle3Head, embed_tokens: np.ndarray | LazyTensor | None, max_seq: int,
                       matmul_weights: str = "float32", sample: bool = False,
                       target_vocab: int | None = None, single_sequence: bool = False,
                       tree: bool = False, quantized_kernel: str = "DequantizeLinear") -> dict[str, GraphBuilder]:
    """{kind: graph} for both kinds (with `sample`, their sampled variants too), each graph named as its
    kind (the builders below take other names). `embed_tokens`: the target's table [V', H] (V' >= the
    head's vocabulary; a checkpoint's lazy tensor is stored as it is, not read here), used where the head
    has no copy of its own. `matmul_weights`: how fc, the projections and lm_head are stored
    (GraphBuilder.matmul). `target_vocab`: the sampled graphs' V (default: the head's vocab_size).
    `single_sequence`: their batch-1 ONNX Runtime variants instead, whose attention is the fused
    kernel the target's and the draft's variants run (transformer._fused_attention): the same
    weights under the same names, so one weights file holds both. `tree`: a dynamic tree's two
    graphs too (tree_graphs_supported says where). `quantized_kernel` (every builder): how int8 and
    int4 matrices are multiplied (GraphBuilder.matmul)."""
    build = {CATCH_UP: build_catch_up_graph, STEP: build_step_graph}
    layout = {"single_sequence": single_sequence, "quantized_kernel": quantized_kernel}
    graphs = {kind: build[kind](head, embed_tokens, max_seq, kind, matmul_weights, **layout) for kind in EAGLE_KINDS}
    if sample:
        vocab = target_vocab or head.config.vocab_size
        for kind, greedy in zip(SAMPLED_KINDS, EAGLE_KINDS):
            graphs[kind] = build[greedy](head, embed_tokens, max_seq, kind, matmul_weights, sample_vocab=vocab,
                                         **layout)
    if tree:
        graphs[TREE_CATCH_UP] = build_catch_up_graph(head, embed_tokens, max_seq, TREE_CATCH_UP, matmul_weights,
                                                     top=True, **layout)
        graphs[TREE_STEP] = build_tree_step_graph(head, embed_tokens, max_seq, TREE_STEP, matmul_weights, **layout)
    return graphs


def tree_graphs_supported(head: Eagle3Head) -> bool:
    """A dynamic tree's graphs report each node's TOP_LOGPROBS best tokens: a head drafting fewer has none."""
    return head.config.draft_vocab_size >= TOP_LOGPROBS


def single_sequence_supported(head: Eagle3Head, embed_tokens, max_seq: int) -> bool:
    """Whether ONNX Runtime's fused attention kernel takes the head's layer (head_dim, GQA, rotary)."""
    return fused_attention_supported(_layer_spec(head, embed_tokens, max_seq))


def build_catch_up_graph(head: Eagle3Head, embed_tokens, max_seq: int, name: str = CATCH_UP,
                         matmul_weights: str = "float32", sample_vocab: int | None = None,
                         single_sequence: bool = False, top: bool = False,
                         quantized_kernel: str = "DequantizeLinear") -> GraphBuilder:
    """The head over T positions of target features: a prompt (chunk), or the positions a verification
    accepted, whose aux_hidden the target's graph has just output under the same name and layout.
    `top`: a tree's catch-up, which also returns the best tokens at the last position (_top)."""
    spec = _layer_spec(head, embed_tokens, max_seq)
    g = GraphBuilder(name, matmul_weights, quantized_kernel)
    ids = g.input("input_ids", INT64, ["batch", "tokens"])
    aux = g.input("aux_hidden", FLOAT, ["batch", "tokens", 3 * head.config.target_hidden_size])
    past_len = g.input("past_len", INT64, ["batch"])
    token_count = g.input("token_count", INT64, ["batch"])
    fused = g.matmul(aux, "fc_w", spec.weights["fc_w"])  # [B, T, H]
    hidden = _layer(g, spec, head, ids, fused, past_len, max_seq, single_sequence)
    # a row that reads nothing (token_count 0: the proposer's rows without new features) reads position 0,
    # an answer nobody takes, rather than index -1, which not every backend wraps
    last = g.op("Unsqueeze", g.op("Max", g.op("Sub", token_count, g.const(1)), g.const(0)), g.const([1]))
    _draft(g, spec, head, g.op("GatherND", hidden, last, batch_dims=1), sample_vocab, top)  # [B, H]
    return g


def build_tree_step_graph(head: Eagle3Head, embed_tokens, max_seq: int, name: str = TREE_STEP,
                          matmul_weights: str = "float32", single_sequence: bool = False,
                          quantized_kernel: str = "DequantizeLinear") -> GraphBuilder:
    """T nodes of a dynamic token tree at once, each its token with its parent's output (hidden_in),
    at its own position (positions [B, T]: the depth's), attending to the keys `visible` [B, T, L]
    marks (L = past_len + T: the prefix the head has read and the tree's nodes written so far, in
    the order they were, then these T, written at past_len..): its ancestors and itself. Returns each
    node's best tokens (top_ids [B, T, K], target ids; top_logprobs, log-softmax over the draft
    vocabulary) and its output (node_hidden [B, T, H]), which its children read."""
    spec = _layer_spec(head, embed_tokens, max_seq)
    g = GraphBuilder(name, matmul_weights, quantized_kernel)
    ids = g.input("input_ids", INT64, ["batch", "tree_nodes"])
    fed_back = g.input("hidden_in", FLOAT, ["batch", "tree_nodes", head.config.hidden_size])
    past_len = g.input("past_len", INT64, ["batch"])
    positions = g.input("positions", INT64, ["batch", "tree_nodes"])
    visible = g.input("visible", BOOL, ["batch", "tree_nodes", "keys"])
    hidden = _layer(g, spec, head, ids, fed_back, past_len, max_seq, single_sequence, (positions, visible))
    top_ids, top_logprobs = _top(g, head, _lm_head(g, spec, hidden, head.config.draft_vocab_size))
    g.output(top_ids, "top_ids", INT64, ["batch", "tree_nodes", TOP_LOGPROBS])
    g.output(top_logprobs, "top_logprobs", FLOAT, ["batch", "tree_nodes", TOP_LOGPROBS])
    g.output(hidden, "node_hidden", FLOAT, ["batch", "tree_nodes", head.config.hidden_size])
    return g


def _top(g: GraphBuilder, head: Eagle3Head, logits: str) -> tuple[str, str]:
    """The TOP_LOGPROBS best draft tokens of logits [..., V'] as target ids, with their log-probabilities
    (log-softmax over the draft vocabulary), best first."""
    logprobs = g.op("LogSoftmax", logits, axis=-1)
    values, indices = g.op("TopK", logprobs, g.const([TOP_LOGPROBS]), axis=-1, largest=1, sorted=1, outputs=2)
    targets = g.weight("draft_to_target", draft_to_target(head, np.arange(head.config.draft_vocab_size)))
    return g.op("Gather", targets, indices), values


def build_step_graph(head: Eagle3Head, embed_tokens, max_seq: int, name: str = STEP,
                     matmul_weights: str = "float32", sample_vocab: int | None = None,
                     single_sequence: bool = False, quantized_kernel: str = "DequantizeLinear") -> GraphBuilder:
    """One more draft: the previous draft's token with the head's own previous output. `sample_vocab`
    (both builders): the sampled variant, over a target vocabulary of that size; `single_sequence`:
    the batch-1 variant (fused attention)."""
    spec = _layer_spec(head, embed_tokens, max_seq)
    g = GraphBuilder(name, matmul_weights, quantized_kernel)
    ids = g.input("input_ids", INT64, ["batch", 1])
    fed_back = g.input("hidden_in", FLOAT, ["batch", 1, head.config.hidden_size])
    past_len = g.input("past_len", INT64, ["batch"])
    hidden = _layer(g, spec, head, ids, fed_back, past_len, max_seq, single_sequence)
    _draft(g, spec, head, g.op("Squeeze", hidden, g.const([1])), sample_vocab)  # [B, H]
    return g


def _layer(g: GraphBuilder, spec: ModelSpec, head: Eagle3Head, ids: str, features: str, past_len: str,
           max_seq: int, single_sequence: bool = False, tree: tuple[str, str] | None = None) -> str:
    """The head's layer over features [B, T, H] (fused target features or the head's own output) and
    the embeddings of ids [B, T], at positions past_len..; writes the cache; returns [B, T, H]. With
    `single_sequence`, attention is ONNX Runtime's fused kernel (one sequence, every token real).
    `tree`: (positions [B, T], visible [B, T, L]) that replace the causal rule's (build_tree_step_graph)."""
    fed = _norm(g, spec, features, LAYER + "hidden_norm")
    embedded = _norm(g, spec, _embedding(g, spec.weights["embed"], ids), LAYER + "attn_norm")
    x = g.op("Concat", embedded, fed, axis=-1)  # [B, T, 2H]: the attention reads both
    # the EAGLE authors' layer keeps the un-normed features as its residual, speculators' may keep the normed
    residual = fed if head.config.norm_before_residual else features
    num_tokens = g.op("Gather", g.op("Shape", ids), g.const(1))
    layers = _attention_layers(g, spec, max_seq)
    if single_sequence:
        bias = None
        if tree is not None:  # the kernel stays causal: the bias hides the earlier keys a node does not see
            hidden = g.const(float(np.finfo(np.float32).min), np.float32)
            mask = g.op("Unsqueeze", tree[1], g.const([1]))  # [1, 1, T, L]
            bias = (tree[0], {None: g.op("Where", mask, g.const(0.0, np.float32), hidden)})
        core = _fused_attention(g, spec, past_len, num_tokens, layers, max_seq, bias)
    elif tree is not None:
        core = _onnx_attention(g, spec, past_len, num_tokens, tree[0], layers, max_seq, visible=tree[1])
    else:
        positions = g.op("Add", g.op("Unsqueeze", past_len, g.const([1])), _offsets(g, num_tokens, False, None))
        core = _onnx_attention(g, spec, past_len, num_tokens, positions, layers, max_seq)
    qkv = _linear(g, spec, x, LAYER + "qkv", parts=(LAYER + "q", LAYER + "k", LAYER + "v"))
    attended = g.op("Add", residual, _linear(g, spec, core(g, 0, qkv), LAYER + "o"))
    return g.op("Add", attended, _mlp(g, spec, LAYER, _norm(g, spec, attended, LAYER + "mlp_norm")))


def _draft(g: GraphBuilder, spec: ModelSpec, head: Eagle3Head, hidden: str, sample_vocab: int | None,
           top: bool = False) -> None:
    """Outputs next_token (a target id), confidence (sampled: probs) and hidden of the layer's output [B, H];
    `top`: also the best tokens there, as a tree step's [B, 1, K] (from the same logits)."""
    draft_vocab = head.config.draft_vocab_size
    logits = _lm_head(g, spec, hidden, draft_vocab)  # [B, draft vocabulary]
    if top:
        top_ids, top_logprobs = _top(g, head, g.op("Unsqueeze", logits, g.const([1])))
        g.output(top_ids, "top_ids", INT64, ["batch", 1, TOP_LOGPROBS])
        g.output(top_logprobs, "top_logprobs", FLOAT, ["batch", 1, TOP_LOGPROBS])
    targets_of = draft_to_target(head, np.arange(draft_vocab))
    if sample_vocab is None:
        targets = g.weight("draft_to_target", targets_of)
        g.output(g.op("Gather", targets, g.op("ArgMax", logits, axis=-1, keepdims=0)), "next_token", INT64, ["batch"])
        g.output(greedy_confidence(g, logits), "confidence", FLOAT, ["batch"])
    else:
        token, probs = _sampled(g, logits, targets_of, draft_vocab, sample_vocab)
        g.output(token, "next_token", INT64, ["batch"])
        g.output(probs, "probs", FLOAT, ["batch", sample_vocab])
    g.output(hidden, "hidden", FLOAT, ["batch", head.config.hidden_size])


def _sampled(g: GraphBuilder, logits: str, targets_of: np.ndarray, draft_vocab: int, vocab: int) -> tuple[str, str]:
    """(next_token [B], probs [B, V]) drawn from logits [B, V'] over the draft vocabulary after each row's
    temperature, top-k and top-p, as the target's sample graph draws (transformer.sampled_next). The
    transform runs over the V' draft tokens: the target tokens outside them have probability 0 either way,
    so they never enter a top-k or a top-p's nucleus before a token of the head's does."""
    params = _sampling_inputs(g)
    uniform = g.input("uniform", FLOAT, ["batch"])
    coupled = g.input("coupled", BOOL, ["batch"])
    noise = g.input("noise", FLOAT, ["batch", vocab])
    drawn_from = spec_op(g, "SpecTransform", g.op("Unsqueeze", logits, g.const([1])), *params, vocab_size=draft_vocab)
    draft_probs = g.op("Squeeze", drawn_from, g.const([1]))  # [B, V']
    # at their target ids, 0 elsewhere: each target id gathers its draft id's column, or an appended zero
    shape = g.op("Concat", g.op("Shape", draft_probs, start=0, end=1), g.const([1]), axis=0)
    padded = g.op("Concat", draft_probs, g.op("ConstantOfShape", shape, value=onnx.numpy_helper.from_array(
        np.zeros([1], np.float32))), axis=1)  # [B, V' + 1]
    probs = g.op("Gather", padded, g.weight("target_to_draft", _target_columns(targets_of, vocab)), axis=1)  # [B, V]
    gumbel_max = g.op("ArgMax", gumbel_scores(g, probs, noise), axis=-1, keepdims=0)
    return g.op("Where", coupled, gumbel_max, spec_op(g, "SpecSample", probs, uniform)), probs


def _target_columns(targets_of: np.ndarray, vocab: int) -> np.ndarray:
    """[V] int64: each target id's draft id (d2t is one-to-one), or V' (the zero column) for the rest."""
    columns = np.full(vocab, len(targets_of), np.int64)
    columns[targets_of] = np.arange(len(targets_of))
    return columns


# ---------------------------------------------------------------------------------------------
# the head as a one-layer Llama ModelSpec, for transformer.py's helpers


def _layer_spec(head: Eagle3Head, embed_tokens, max_seq: int) -> ModelSpec:
    """hp as checkpoint._hyper_parameters makes them, and the head's weights under the canonical names
    (matrices [in, out], transposed lazily: nothing is copied before the weights file is written)."""
    c = head.config
    hp = {"hidden_size": c.hidden_size, "num_layers": 1, "num_heads": c.num_attention_heads,
          "num_kv_heads": c.num_key_value_heads, "head_dim": c.head_dim, "intermediate_size": c.intermediate_size,
          "norm_eps": c.rms_norm_eps, "activation": "silu", "vocab_size": c.vocab_size, "tie_embeddings": False,
          "layer_windows": [None], "layer_ropes": [_rope(head, max_seq)], "rotary_dim": c.head_dim,
          "attn_scale": c.head_dim ** -0.5, "max_positions": max_seq}
    linear = {"q": head.q_proj, "k": head.k_proj, "v": head.v_proj, "o": head.o_proj, "gate": head.gate_proj,
              "up": head.up_proj, "down": head.down_proj}
    norms = {"attn_norm": head.input_layernorm, "hidden_norm": head.hidden_norm,
             "mlp_norm": head.post_attention_layernorm}
    weights = {**{f"{LAYER}{name}_w": _in_out(w) for name, w in linear.items()},
               **{f"{LAYER}{name}_w": _lazy(w) for name, w in norms.items()},
               "fc_w": _in_out(head.fc), "final_norm_w": _lazy(head.norm), "lm_head": _in_out(head.lm_head),
               "embed": _embedding_table(head, embed_tokens)}
    return ModelSpec(Path("eagle3"), "eagle3", LLAMA, hp, {}, weights)


def _embedding_table(head: Eagle3Head, embed_tokens):
    """The head's own table, or the target's: [V', H] with V' covering the head's vocabulary."""
    table = head.embed_tokens if head.embed_tokens is not None else embed_tokens
    c = head.config
    if table is None:
        raise SpecCompileError("the EAGLE-3 head has no embed_tokens of its own: give it the target's")
    if len(table.shape) != 2 or table.shape[1] != c.hidden_size or table.shape[0] < c.vocab_size:
        raise SpecCompileError(f"the embedding table given to the EAGLE-3 head is {list(table.shape)}; it needs "
                               f"{c.hidden_size} columns and at least {c.vocab_size} rows")
    return table if isinstance(table, LazyTensor) else _lazy(np.asarray(table, np.float32))


def _rope(head: Eagle3Head, max_seq: int) -> Rope:
    c = head.config
    params = dict(c.rope_scaling or {"rope_type": "default"})
    rope_type = params.pop("rope_type")
    if rope_type not in ROPE_TYPES:
        raise SpecCompileError(f"the EAGLE-3 head's rope scaling {rope_type!r} is not supported "
                               f"(supported: {', '.join(ROPE_TYPES)})")
    needed = SCALINGS[rope_type].required + (("original_max_position_embeddings",) if rope_type == "llama3" else ())
    missing = [key for key in needed if params.get(key) is None]
    if missing:
        raise SpecCompileError(f"the EAGLE-3 head's rope scaling {rope_type!r} needs {', '.join(missing)}")
    return Rope(rope_type, c.rope_theta, max_seq, params)


def _in_out(weight: np.ndarray) -> LazyTensor:
    """nn.Linear's [out, in] as the graphs multiply it: [in, out]."""
    return transposed(_lazy(weight))


# ---------------------------------------------------------------------------------------------
# writing


def write_eagle_graphs(directory, graphs: dict[str, GraphBuilder], weights_file: str = WEIGHTS_FILE,
                       borrowed: dict[str, tuple[str, int, int]] | None = None,
                       variants: dict[str, tuple[GraphBuilder, str]] | None = None) -> WeightFile:
    """Each graph as `directory`/<its name>.onnx over one weights file, `weights_file`. `borrowed`:
    weights the graphs read from another file of the directory instead, by name -> (file, offset,
    length) there (see borrowed_embedding), which then are not copied into `weights_file`.
    `variants`: batch-1 variants as (graph, file name), over the same weights file."""
    directory, borrowed, variants = Path(directory), borrowed or {}, variants or {}
    weight_file = WeightFile(weights_file)
    builders = [*graphs.values(), *(graph for graph, _ in variants.values())]
    for graph in builders:
        weight_file.add({name: w for name, w in graph.weights.items() if name not in borrowed})
    weight_file.write(directory / weights_file)
    locations = {**weight_file.locations, **borrowed}
    for graph in graphs.values():
        onnx.save_model(graph.model(locations), str(directory / f"{graph.name}.onnx"))
    for graph, file in variants.values():
        onnx.save_model(graph.model(locations), str(directory / file))
    return weight_file


def borrowed_embedding(graphs: dict[str, GraphBuilder], target_locations: dict[str, tuple[str, int, int]]) -> dict:
    """write_eagle_graphs' `borrowed` for a head that reads the target's table (built with the target's
    own weights["embed"], so it is stored under the same names and bytes): where the target's WeightFile
    put it. ONNX Runtime maps external data into memory on the CPU, so the two models' sessions then
    share its pages as well as its bytes on disk (a copy would cost the disk, 2 GB for an 8B Llama 3)."""
    held = {name for graph in graphs.values() for name in graph.weights}
    return {name: target_locations[name] for name in EMBEDDING_WEIGHTS if name in held}
