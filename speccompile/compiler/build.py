"""`build_bundle`: HF draft + target checkpoints -> a bundle directory, as a flat list of phases.

    load target -> load draft -> compatibility gate -> export graphs -> check graphs -> write bundle
    (-> TensorRT engines, with backend="tensorrt": compiler/tensorrt_build.py)

The bundle is assembled in a temporary sibling directory and renamed into place only when complete,
so a failed build leaves nothing behind.
"""

import collections
import errno
import logging
import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path

import numpy as np
import onnx

from speccompile.bundle import (
    AUX_KINDS,
    FORMAT_VERSION,
    HEAD_KINDS,
    HEAD_ROLE,
    MEDUSA_TREE_KINDS,
    TREE_KINDS,
    GraphEntry,
    GraphId,
    Manifest,
    MedusaEntry,
    ModelEntry,
    SessionEntry,
    SourceFormat,
    TensorSpec,
    TokenizerEntry,
    VariantEntry,
    sha256_file,
    write_manifest,
)
from speccompile.compiler.checkpoint import ModelSpec, check_max_seq, load_checkpoint
from speccompile.compiler.draft_vocab import FREQUENCIES_FILE, corpus_frequencies, read_frequencies, select_vocab
from speccompile.compiler.eagle_graph import WEIGHTS_FILE as EAGLE_WEIGHTS
from speccompile.compiler.eagle_graph import (
    borrowed_embedding,
    build_eagle_graphs,
    single_sequence_supported,
    tree_graphs_supported,
    write_eagle_graphs,
)
from speccompile.compiler.onnx_graph import MATMUL_WEIGHTS, OPSET, ORT_ONLY_WEIGHTS, WeightFile
from speccompile.compiler.session_graph import KINDS, build_session_graph
from speccompile.compiler.tensorrt_build import (
    TensorRTOptions,
    build_tensorrt_engines,
    require_tensorrt_build,
)
from speccompile.compiler.tokenizer import check_compatible, eos_token_ids, load_tokenizer, save_tokenizer
from speccompile.compiler.transformer import (
    MEDUSA_CANDIDATES,
    build_eagle_tree_verify_graph,
    build_forward_graph,
    build_score_graph,
    build_tree_verify_graph,
    build_verify_graph,
    fused_attention_supported,
)
from speccompile.compiler.trt_rules import check_tensorrt_compatible
from speccompile.eagle_head import CONFIG as EAGLE_CONFIG
from speccompile.eagle_head import (
    Eagle3Head,
    aux_layer_ids,
    check_fits,
    head_tensors,
    load_eagle3_head,
    with_draft_vocab,
)
from speccompile.errors import SpecCompileError, read_json_object
from speccompile.progress import Progress

DTYPES = {onnx.TensorProto.FLOAT: "float32", onnx.TensorProto.INT64: "int64", onnx.TensorProto.BOOL: "bool",
          onnx.TensorProto.INT32: "int32", onnx.TensorProto.UINT8: "uint8"}
PHASES = ["load target", "load draft", "check compatibility", "export graphs", "check graphs", "write bundle"]
BACKENDS = ("onnxruntime", "tensorrt", "onnx")  # onnx: portable graphs, for TensorRT or another runtime later
logger = logging.getLogger(__name__)


def build_bundle(target_dir, draft_dir, out_dir, gammas=(4,), max_seq: int = 1024, max_batch: int = 8,
                 force: bool = False, draft_weights: str | None = None, draft_vocab: int | None = None,
                 draft_vocab_corpus=None, single_sequence: bool = True, target_weights: str | None = None,
                 medusa_dir=None, backend: str = "onnxruntime", tensorrt: TensorRTOptions | None = None,
                 eagle_aux_layers: tuple[int, ...] | None = None, eagle_dir=None, eagle_weights: str | None = None,
                 eagle_vocab: int | None = None) -> Path:
    """`target_weights` / `draft_weights`: how each model's projection and LM-head weights are stored:
    "float32", "float16", "bfloat16" (both computed in fp32), "int8" (weight-only, per output
    column) or "int4" (weight-only, blocks of 128 along the input; see GraphBuilder.matmul). The
    target's precision is the compiled target's numerics: speculative output equals autoregressive
    decoding of the target *as compiled*. A GGUF's tensors in the block formats of gguf.KEPT_BLOCKS
    (Q4_0-Q8_0, Q4_K-Q6_K) keep their own blocks at int8 and int4 (4-bit ones only for TensorRT),
    and their values, exactly, at a float precision; the default target precision is float32 for a
    checkpoint directory and int8 for a GGUF (its blocks kept, other formats at int8).
    The draft's (and an EAGLE-3 head's) default follows the target's: int4 for an int4 target (the
    same bits where a draft shares the target's weights, so that it agrees with it as compiled), int8
    otherwise (a float target's draft too: its steps are what speculation pays for).
    `draft_vocab`: score only the K most frequent tokens in the draft's LM head (see draft_vocab.py),
    by the counts in the draft checkpoint's token_frequencies.json or of `draft_vocab_corpus`.
    `single_sequence`: also write each graph's batch-1 ONNX Runtime variant (fused attention; see
    transformer._fused_attention), which the ONNX Runtime backend runs whenever a batch has one
    sequence. Without `draft_dir`, a draft-free bundle: the target's graphs alone, whose requests
    speculate with prompt lookup (core/proposers.py). `medusa_dir` (instead of a draft): Medusa heads
    (`speccompile distill --medusa K`) and the target's token-tree verification graphs that read them
    (transformer.build_tree_verify_graph): one target pass per iteration verifies the heads' tree
    and proposes the next one.
    `backend`: "onnxruntime", the ONNX graphs alone, those of each kind in ONNX Runtime's kernels as
    its session graphs (int8 and int4 weights stored once: quantized_kernel()); "onnx", the graphs of
    each kind in standard ops, within TensorRT's parser rules (low-bit weights then stored twice);
    "tensorrt", portable graphs and a TensorRT engine per graph, made as `tensorrt` says (default:
    TensorRTOptions()). Whether
    TensorRT and its plugin library are here is checked before any checkpoint is read, and whether
    TensorRT takes the weights' formats before any graph is exported.
    `eagle_aux_layers`: three of the target's layer ids, for an EAGLE-3 head: the target's step and
    chain-verification graphs (and its session graph) also output aux_hidden, the residual stream
    entering those layers at every position (transformer._aux_hidden; bundle.AUX_HIDDEN), and the
    manifest's target records them. None: the bundle is what it was without the option.
    `eagle_dir`: an EAGLE-3 head (either published layout; eagle_head.py), checked against the target:
    the target's graphs output the features of the layers the head names (or EAGLE-3's default for the
    target's depth; eagle_aux_layers is then left out), and the head's graphs, greedy and sampled
    (compiler/eagle_graph.py), are written beside them, reading the target's token embedding from its
    weights file where the head has none of its own. With or without a draft; not with Medusa heads,
    nor (yet) with TensorRT engines. `eagle_weights`: how the head's matrices are stored (as
    draft_weights). `eagle_vocab`: the head drafts only the K most frequent of the tokens it can
    draft (as draft_vocab cuts a draft's LM head, its greedy and sampled graphs alike), by the counts
    in the head's token_frequencies.json (`distill --eagle3` writes it) or of `draft_vocab_corpus`."""
    out_dir, tensorrt = Path(out_dir), tensorrt or TensorRTOptions()
    engines = _builds_engines(backend, tensorrt)
    gammas = _check_options(out_dir, list(gammas), max_seq, max_batch, force, draft_vocab or eagle_vocab,
                            draft_vocab_corpus)
    for option, value in (("--target-weights", target_weights or "float32"),
                          ("--draft-weights", draft_weights or "int8"), ("--eagle-weights", eagle_weights or "int8")):
        if value not in MATMUL_WEIGHTS:
            raise SpecCompileError(f"{option} must be one of {', '.join(MATMUL_WEIGHTS)}, got {value!r}")
    if engines and ORT_ONLY_WEIGHTS & {target_weights, draft_weights, eagle_weights}:
        raise SpecCompileError("w8a8 graphs run on ONNX Runtime only (TensorRT's parser has no MatMulInteger): "
                               "build TensorRT engines at int8")
    _check_eagle_options(eagle_dir, eagle_aux_layers, medusa_dir, engines, eagle_vocab)
    if engines:
        require_tensorrt_build(tensorrt)
    progress = Progress(len(PHASES), logger)

    progress.step("load target")
    target = load_checkpoint(target_dir)
    aux_layers = _check_aux_layers(eagle_aux_layers, target)
    target_tok = load_tokenizer(target.files)
    progress.step("load draft")
    if draft_dir is not None and medusa_dir is not None:
        raise SpecCompileError("--medusa heads propose instead of a draft model: pass --draft or --medusa, not both")
    draft = load_checkpoint(draft_dir) if draft_dir is not None else None
    medusa = _load_medusa(medusa_dir, target) if medusa_dir is not None else None
    head = _load_eagle(eagle_dir, target) if eagle_dir is not None else None
    if eagle_vocab is not None:
        head = _cut_eagle_vocab(head, eagle_dir, eagle_vocab, draft_vocab_corpus, target_tok,
                                eos_token_ids(target, target_tok))
    aux_layers = aux_layer_ids(head, target.hp["num_layers"]) if head is not None else aux_layers
    progress.step("check compatibility")
    if draft is None:
        logger.info("  no draft: the bundle's requests speculate with "
                    + ("its Medusa heads" if medusa else "prompt lookup"))
        vocab_out = check_compatible(target, target, target_tok, None)
    else:
        draft_tok = load_tokenizer(draft.files, required=False)
        if draft_tok is None:
            logger.warning(f"{draft.path} has no tokenizer; assuming the target's")
        vocab_out = check_compatible(target, draft, target_tok, draft_tok)
        _warn_draft_size(target, draft)
    for spec in [target] + ([draft] if draft else []):
        check_max_seq(spec, max_seq)
    target_weights = target_weights or ("int8" if target.source.format == "gguf" else "float32")
    draft_weights, eagle_weights = (stored or following_precision(target_weights) for stored in (draft_weights,
                                                                                              eagle_weights))
    for spec, stored in ((target, target_weights), (draft, draft_weights)):
        if spec is not None and spec.source.format == "gguf":
            spec.compile_at(stored, tensorrt=engines)
            _warn_int4_of_low_bit_blocks(spec, stored)
        if spec is not None:
            spec.store_embedding_at(stored)
    vocab_ids = None
    if draft_vocab is not None:
        if draft is None:
            raise SpecCompileError("--draft-vocab cuts the draft's LM head: it needs --draft")
        eos_ids = eos_token_ids(target, target_tok)
        vocab_ids = _draft_vocab_ids(draft, draft_vocab, draft_vocab_corpus, vocab_out, eos_ids, target_tok)

    progress.step("export graphs")
    weights = {"target": target_weights, "draft": draft_weights}
    heads = medusa[1] if medusa else None
    tree = head is not None and tree_graphs_supported(head)  # the head drafts dynamic trees too
    # TensorRT's parser rules apply to a bundle made for TensorRT or as portable ONNX (--backend onnx),
    # unless a precision only ONNX Runtime runs rules them out
    portable = (engines or backend == "onnx") and not ORT_ONLY_WEIGHTS & {target_weights, draft_weights, eagle_weights}
    kernel = quantized_kernel(portable)
    graphs = _export_graphs(target, draft, gammas, max_seq, vocab_out, weights, vocab_ids, heads=heads,
                            aux_layers=aux_layers, eagle_tree=tree, quantized_kernel=kernel)
    variants = _export_graphs(target, draft, gammas, max_seq, vocab_out, weights, vocab_ids, single_sequence=True,
                              heads=heads, aux_layers=aux_layers, eagle_tree=tree,
                              quantized_kernel=kernel) if single_sequence else {}
    eagle_graphs = _eagle_graphs(head, target, max_seq, vocab_out, eagle_weights, tree, kernel) \
        if head is not None else {}
    eagle_variants = _eagle_variants(head, target, max_seq, vocab_out, eagle_weights, tree, kernel) \
        if head is not None and single_sequence else {}
    for name, (builder, _) in {**graphs, **eagle_graphs}.items():
        batch_1 = variants[name][0] if name in variants else eagle_variants.get(name)
        variant = f", batch-1 variant {len(batch_1.nodes)}" if batch_1 is not None else ""
        logger.info(f"  {name}: {len(builder.nodes)} nodes{variant}")

    _remove_leftovers(out_dir)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.build-{os.getpid()}-", suffix=".partial",
                                    dir=out_dir.parent))
    try:
        sessions = _session_graphs(target, draft, max_seq, vocab_out, weights, vocab_ids, heads, aux_layers, tree)
        weight_files = _write_graphs(staging, graphs, variants, sessions)
        if head is not None:
            _write_eagle_graphs(staging, head, eagle_graphs, weight_files["target"], eagle_variants)
        progress.step("check graphs")
        for builder, _ in sessions.values():
            _check_onnx(staging / f"{builder.name}.onnx", builder.name)
        needs_plugin = {name: _check_graph(staging / f"{name}.onnx", name, portable)
                        for name in {**graphs, **eagle_graphs}}
        for name in [*variants, *eagle_variants]:
            _check_onnx(staging / variant_file(name), name + SINGLE_SEQUENCE)
        for name, reasons in needs_plugin.items():
            if reasons:
                logger.info(f"  {name}: TensorRT parses it only with the speccompile plugin "
                            f"({len(reasons)} body constraint(s))")
        progress.step("write bundle")
        save_tokenizer(target_tok, staging / "tokenizer")
        scored = {"target": vocab_out, "draft": vocab_out if vocab_ids is None else len(vocab_ids)}
        models = {role: _model_entry(spec, weight_files[role], weights[role], scored[role], sessions[role],
                                     aux_layers if role == "target" else ())
                  for role, spec, _ in _models(target, draft, vocab_ids)}
        models |= {HEAD_ROLE: _eagle_entry(head, eagle_dir, target, eagle_weights)} if head is not None else {}
        batch_1 = {*variants, *eagle_variants}
        graph_entries = {name: _graph_entry(staging, graph, needs_plugin[name], name in batch_1)
                         for name, (_, graph) in {**graphs, **eagle_graphs}.items()}
        heads_entry = _medusa_entry(medusa[0], medusa_dir) if medusa else None
        manifest = _manifest(staging, models, graph_entries, gammas, max_seq, max_batch, vocab_out,
                             _tokenizer_entry(target, target_tok), heads_entry)
        write_manifest(staging, manifest)  # every file was just hashed and stamped: the first open need not
        _move_into_place(staging, out_dir, force)
    except OSError as e:
        shutil.rmtree(staging, ignore_errors=True)
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SpecCompileError(f"no space left on {out_dir.parent} for the bundle ({e.strerror}); "
                                   "what the build wrote is removed") from None
        raise
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info(f"bundle written to {out_dir} ({_size_mb(out_dir):.1f} MB)")
    if engines:
        build_tensorrt_engines(out_dir, tensorrt)
    return out_dir


def quantized_kernel(portable: bool) -> str:
    """How the graphs of each kind multiply int8 and int4 weights (GraphBuilder.matmul). Portable graphs
    (TensorRT, other runtimes): DequantizeLinear -> MatMul, in standard ops, whose weights are a second
    copy beside the session graphs' (2.46 GB for a 1.1B int8 target's 1.43 GB). Graphs only ONNX Runtime
    runs: MatMulNBits, as the session graphs run them, so that every graph of a model reads the same
    bytes (the weights once on disk) and computes the same numbers (ONNX Runtime fuses the portable pair
    into this very kernel)."""
    return "DequantizeLinear" if portable else "MatMulNBits"


def following_precision(target_weights: str) -> str:
    """A draft's or head's default precision beside a target stored as `target_weights`: an int4 or
    w8a8 target's own (a layer-skip draft then computes as its target does), else int8."""
    return target_weights if target_weights in ("int4", "w8a8") else "int8"


def _builds_engines(backend: str, tensorrt: TensorRTOptions) -> bool:
    """Whether the build makes TensorRT engines too. TensorRT's options without them are refused: they
    would change nothing, and the bundle would not be the one asked for."""
    if backend not in BACKENDS:
        raise SpecCompileError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if backend != "tensorrt" and tensorrt != TensorRTOptions():
        raise SpecCompileError("--plugin-lib, --timing-cache, --hardware-compat and --version-compat make TensorRT "
                               "engines: pass --backend tensorrt with them")
    return backend == "tensorrt"


def _check_options(out_dir: Path, gammas: list[int], max_seq: int, max_batch: int, force: bool,
                   draft_vocab: int | None = None, draft_vocab_corpus=None) -> list[int]:
    if not gammas or any(not isinstance(g, int) or g < 1 for g in gammas):
        raise SpecCompileError(f"--gamma values must be positive integers, got {gammas}")
    if max_seq < 2 or max_batch < 1:
        raise SpecCompileError(f"--max-seq must be >= 2 and --max-batch >= 1 (got {max_seq}, {max_batch})")
    if max(gammas) + 2 > max_seq:
        raise SpecCompileError(f"γ={max(gammas)} does not fit in --max-seq {max_seq}")
    if out_dir.exists() and any(out_dir.iterdir()) and not force:
        raise SpecCompileError(f"{out_dir} already exists and is not empty (pass --force to replace it)")
    if not out_dir.parent.is_dir():
        raise SpecCompileError(f"parent directory of {out_dir} does not exist")
    # An error, not a warning: the corpus is only counted for --draft-vocab (or --eagle-vocab), and a
    # build that silently drops it would take minutes to produce a bundle other than the one asked for.
    if draft_vocab_corpus is not None and draft_vocab is None:
        raise SpecCompileError("--draft-vocab-corpus only chooses the tokens of --draft-vocab K (or --eagle-vocab K): "
                               "pass one of them too")
    return list(dict.fromkeys(gammas))  # unique, in the order given


EAGLE_AUX_LAYERS = 3  # an EAGLE-3 head reads the target's residual stream at three layers (low, middle, high)


def _check_aux_layers(layers, target: ModelSpec) -> tuple[int, ...]:
    """The layer ids as a tuple (() for None), if they are three layers of the target. Any order and
    repeats are taken: aux_hidden concatenates them as listed, as the head was trained to read them."""
    if layers is None:
        return ()
    count = target.hp["num_layers"]
    layers = tuple(layers)
    if len(layers) != EAGLE_AUX_LAYERS or not all(type(i) is int and 0 <= i < count for i in layers):
        raise SpecCompileError(f"EAGLE-3 aux layers must be {EAGLE_AUX_LAYERS} layer ids of the target's {count} "
                               f"(0..{count - 1}), got {list(layers)}")
    return layers


def _check_eagle_options(eagle_dir, aux_layers, medusa_dir, engines: bool, eagle_vocab: int | None = None) -> None:
    """What an EAGLE-3 head cannot be built with, refused before anything is read."""
    if eagle_dir is None:
        if eagle_vocab is not None:
            raise SpecCompileError("--eagle-vocab cuts an EAGLE-3 head's vocabulary: it needs --eagle")
        return
    if medusa_dir is not None:
        raise SpecCompileError("--eagle and --medusa both add heads that propose from the target: pass one of them")
    if aux_layers is not None:
        raise SpecCompileError("--eagle reads the target layers its head names (or EAGLE-3's default): "
                               "eagle_aux_layers is for a bundle without a head")
    if engines:
        raise SpecCompileError("--eagle: the EAGLE-3 head runs on ONNX Runtime only, not with --backend tensorrt")


def _load_eagle(eagle_dir, target: ModelSpec) -> Eagle3Head:
    """The head, refused in one line unless it fits the target (its width, vocabulary and layers)."""
    head = load_eagle3_head(eagle_dir)
    hp = target.hp
    check_fits(head, {"hidden_size": hp["hidden_size"], "vocab_size": hp["vocab_size"],
                      "num_hidden_layers": hp["num_layers"]})
    logger.info(f"  EAGLE-3 head from {eagle_dir}: reads target layers {list(aux_layer_ids(head, hp['num_layers']))}, "
                f"drafts over {head.config.draft_vocab_size} tokens")
    return head


def _cut_eagle_vocab(head: Eagle3Head, eagle_dir, size: int, corpus, tokenizer, eos_ids: list[int]) -> Eagle3Head:
    """The head drafting only the `size` most frequent tokens it can draft (end-of-sequence ones kept)."""
    drafts = head.config.draft_vocab_size
    if not 0 < size < drafts:
        raise SpecCompileError(f"--eagle-vocab must be between 1 and {drafts - 1} (the head drafts {drafts} tokens), "
                               f"got {size}")
    vocab = head.config.vocab_size
    if corpus is not None:
        logger.info(f"  counting tokens of {corpus} for the EAGLE-3 head's vocabulary")
        counts = corpus_frequencies(corpus, tokenizer, vocab)
    else:
        counts = read_frequencies(eagle_dir)
        if counts is None:
            raise SpecCompileError(f"--eagle-vocab needs token frequencies: {eagle_dir} has no {FREQUENCIES_FILE} "
                                   f"(speccompile distill --eagle3 writes it); pass --draft-vocab-corpus PATH to "
                                   "count them")
    draftable = head.t2d.astype(bool)
    counts = np.where(draftable, np.pad(counts[:vocab], (0, max(0, vocab - len(counts)))), -1)
    ids = select_vocab(counts, size, vocab, [i for i in eos_ids if 0 <= i < vocab and draftable[i]])
    logger.info(f"  EAGLE-3 head's vocabulary: {len(ids)} of its {drafts} tokens, "
                f"{counts[ids].sum() / max(1, counts[draftable].sum()):.1%} of counted text")
    return with_draft_vocab(head, ids)


def _eagle_graphs(head: Eagle3Head, target: ModelSpec, max_seq: int, vocab_out: int, weights: str,
                  tree: bool, kernel: str) -> dict:
    """name -> (GraphBuilder, GraphId) of the head's graphs (greedy and sampled), its matrices stored
    as `weights`, over the target's own embedding tensor where the head has none (so that it is
    stored under the target's names and bytes); the sampled ones' probs span the bundle's
    vocabulary, vocab_out, as the verification's draft_probs do; `tree`: a dynamic tree's graphs too;
    `kernel`: see quantized_kernel()."""
    built = build_eagle_graphs(head, target.weights["embed"], max_seq, matmul_weights=weights, sample=True,
                               target_vocab=vocab_out, tree=tree, quantized_kernel=kernel)
    ids = {graph.name: graph for sample in (False, True)
           for graph in (GraphId.eagle_catch_up(sample), GraphId.eagle_step(sample))}
    ids |= {graph.name: graph for graph in (GraphId.eagle_tree("tree_catch_up"), GraphId.eagle_tree("tree_step"))}
    return {name: (builder, ids[name]) for name, builder in built.items()}


def _eagle_variants(head: Eagle3Head, target: ModelSpec, max_seq: int, vocab_out: int, weights: str,
                    tree: bool, kernel: str) -> dict:
    """name -> GraphBuilder of the head's graphs' batch-1 variants (fused attention), where ONNX
    Runtime's kernel takes the head's layer (none otherwise)."""
    if not single_sequence_supported(head, target.weights["embed"], max_seq):
        return {}
    return build_eagle_graphs(head, target.weights["embed"], max_seq, matmul_weights=weights, sample=True,
                              target_vocab=vocab_out, single_sequence=True, tree=tree, quantized_kernel=kernel)


def _write_eagle_graphs(staging: Path, head: Eagle3Head, graphs: dict, target_weights: WeightFile,
                        variants: dict) -> None:
    """The head's graphs, their batch-1 variants and its weights file; a head without its own embedding
    reads the target's where the target's weights file holds it (no second copy: 2 GB for an 8B Llama 3)."""
    builders = {name: builder for name, (builder, _) in graphs.items()}
    borrowed = borrowed_embedding(builders, target_weights.locations) if head.embed_tokens is None else None
    write_eagle_graphs(staging, builders, EAGLE_WEIGHTS, borrowed,
                       {name: (builder, variant_file(name)) for name, builder in variants.items()})


def _eagle_entry(head: Eagle3Head, eagle_dir, target: ModelSpec, matmul_weights: str) -> ModelEntry:
    """The head as a model of the bundle: one layer; its vocabulary the target's (it drafts target ids),
    the tokens it scores its draft vocabulary; its parameters its own (not the maps, not a borrowed table)."""
    c = head.config
    params = sum(array.size for name, array in head_tensors(head).items() if name not in ("d2t", "t2d"))
    return ModelEntry(
        source=str(Path(eagle_dir).resolve()), source_format=SourceFormat("safetensors", {}, {}), model_type="eagle3",
        num_params=params, num_layers=1, num_heads=c.num_attention_heads, num_kv_heads=c.num_key_value_heads,
        head_dim=c.head_dim, hidden_size=c.hidden_size, vocab_size=target.hp["vocab_size"],
        weights_file=EAGLE_WEIGHTS, matmul_weights=matmul_weights, scored_vocab=c.draft_vocab_size,
        config=read_json_object(Path(eagle_dir) / EAGLE_CONFIG))


def _warn_draft_size(target: ModelSpec, draft: ModelSpec) -> None:
    """A warning, not an error: the bundle is still exact (the target decides every token), and a
    draft's steps can be cheaper than its size says (int8 weights, --draft-vocab), but a draft larger
    than its target is most often the two checkpoints swapped."""
    if draft.num_params > target.num_params:
        logger.warning(f"the draft ({draft.num_params:,} parameters) is larger than the target "
            f"({target.num_params:,}): speculative decoding will likely be slower than the target alone "
            f"(were --target and --draft swapped?)")


def _draft_vocab_ids(draft: ModelSpec, size: int, corpus, vocab_out: int, eos_ids: list[int], tokenizer):
    if corpus is not None:
        logger.info(f"  counting tokens of {corpus} for the draft vocabulary")
        counts = corpus_frequencies(corpus, tokenizer, vocab_out)
    else:
        counts = read_frequencies(draft.files)
        if counts is None:
            raise SpecCompileError(f"--draft-vocab needs token frequencies: {draft.path} has no {FREQUENCIES_FILE} "
                                   f"(speccompile distill writes it); pass --draft-vocab-corpus PATH to count them")
    ids = select_vocab(counts, size, vocab_out, eos_ids)
    logger.info(f"  draft vocabulary: {len(ids)} of {vocab_out} tokens, "
                f"{counts[ids].sum() / max(1, counts.sum()):.1%} of counted text")
    return ids


def _load_medusa(medusa_dir, target: ModelSpec) -> tuple[dict, list]:
    from speccompile.medusa_heads import load_medusa_heads

    config, heads = load_medusa_heads(medusa_dir)
    hp = target.hp
    if config["hidden_size"] != hp["hidden_size"] or config["vocab_size"] != hp["vocab_size"]:
        raise SpecCompileError(f"--medusa {medusa_dir}: heads for hidden size {config['hidden_size']} and "
                               f"{config['vocab_size']} tokens do not fit this target ({hp['hidden_size']}, "
                               f"{hp['vocab_size']})")
    logger.info(f"  Medusa heads: {len(heads)} from {medusa_dir}")
    return config, heads


def _medusa_entry(config: dict, medusa_dir) -> MedusaEntry:
    """What the runtime needs of the heads: how many, and how often each rank of each is right
    (core/tree.py grows the token tree from these; the runtime sizes it by measured cost)."""
    return MedusaEntry(config["num_heads"], tuple(tuple(row) for row in config["top_k_accuracy"]),
                       tuple((tuple(path), p) for path, p in config.get("path_probability", [])),
                       MEDUSA_CANDIDATES, str(Path(medusa_dir).resolve()))


def _export_graphs(target: ModelSpec, draft: ModelSpec, gammas, max_seq, vocab_out, matmul_weights: dict[str, str],
                   vocab_ids=None, single_sequence: bool = False, heads: list | None = None,
                   aux_layers: tuple[int, ...] = (), eagle_tree: bool = False,
                   quantized_kernel: str = "DequantizeLinear") -> dict:
    """name -> (GraphBuilder, GraphId); with single_sequence, the batch-1 variants under the same names,
    for the models ONNX Runtime's fused attention kernel accepts. Graphs hold lazy weights only.
    `heads`: Medusa heads, read by token-tree verification graphs. `aux_layers`: output by the
    target's graphs of AUX_KINDS (bundle.py). `eagle_tree`: the verification of an EAGLE-3 head's
    dynamic trees too. `quantized_kernel`: see quantized_kernel()."""
    graphs = {}
    for role, spec, ids in _models(target, draft, vocab_ids):
        if single_sequence and not fused_attention_supported(spec):
            continue
        layout = {"matmul_weights": matmul_weights[role], "quantized_kernel": quantized_kernel,
                  "single_sequence": single_sequence}
        for graph in (GraphId.step(role, sample=False), GraphId.step(role, sample=True)):
            graphs[graph.name] = (build_forward_graph(spec, graph.name, max_seq, vocab_out, sample=graph.sampling,
                                                      vocab_ids=None if graph.sampling else ids,
                                                      aux_layers=_aux_of(graph, aux_layers), **layout), graph)
    if single_sequence and not fused_attention_supported(target):
        return graphs
    layout = {"matmul_weights": matmul_weights["target"], "quantized_kernel": quantized_kernel,
              "single_sequence": single_sequence}
    for gamma in gammas:
        for graph in (GraphId.verification(gamma, sample=False), GraphId.verification(gamma, sample=True)):
            graphs[graph.name] = (build_verify_graph(target, graph.name, gamma, max_seq, vocab_out,
                                                     sample=graph.sampling, aux_layers=_aux_of(graph, aux_layers),
                                                     **layout), graph)
    graphs[GraphId.score().name] = (build_score_graph(target, GraphId.score().name, max_seq, vocab_out, **layout),
                                    GraphId.score())
    if heads:
        for graph in (GraphId.tree_verification(typical=False), GraphId.tree_verification(typical=True)):
            graphs[graph.name] = (build_tree_verify_graph(target, graph.name, heads, max_seq, vocab_out,
                                                          typical=graph.kind == "verify_tree_typical", **layout),
                                  graph)
    if eagle_tree:
        graph = GraphId.eagle_tree("verify_eagle_tree")
        graphs[graph.name] = (build_eagle_tree_verify_graph(target, graph.name, max_seq, vocab_out, aux_layers,
                                                            **layout), graph)
    return graphs


def _aux_of(graph: GraphId, aux_layers: tuple[int, ...]) -> tuple[int, ...]:
    """The aux layers a graph outputs: the target's, in its graphs of AUX_KINDS."""
    return aux_layers if graph.model == "target" and graph.kind in AUX_KINDS else ()


SINGLE_SEQUENCE = "_b1"  # file suffix of the batch-1 ONNX Runtime variants


def variant_file(name: str) -> str:
    return f"{name}{SINGLE_SEQUENCE}.onnx"


def _session_graphs(target: ModelSpec, draft: ModelSpec, max_seq, vocab_out, matmul_weights: dict[str, str],
                    vocab_ids=None, heads: list | None = None, aux_layers: tuple[int, ...] = (),
                    eagle_tree: bool = False) -> dict:
    """role -> (the model's session graph, {kind: id}): what the ONNX Runtime backend runs (session_graph.py).
    The target's outputs aux_hidden where its graphs of AUX_KINDS do, and verifies an EAGLE-3 head's
    dynamic trees where the head drafts them (`eagle_tree`)."""
    sessions = {}
    trees = (MEDUSA_TREE_KINDS if heads else ()) + (("verify_eagle_tree",) if eagle_tree else ())
    for role, spec, ids in _models(target, draft, vocab_ids):
        kinds = ["forward", "sample"]
        if role == "target":
            kinds = [k for k in KINDS if k not in HEAD_KINDS and (k not in TREE_KINDS or k in trees)]
        builder = build_session_graph(spec, f"{role}_session", max_seq, vocab_out, kinds, matmul_weights[role], ids,
                                      heads=heads if role == "target" else None,
                                      aux_layers=aux_layers if role == "target" else ())
        sessions[role] = (builder, {kind: KINDS[kind] for kind in kinds})
    return sessions


def _models(target: ModelSpec, draft: ModelSpec | None, vocab_ids) -> list[tuple[str, ModelSpec, list | None]]:
    """(role, spec, the draft's scored vocabulary) of each model the bundle holds."""
    return [("target", target, None)] + ([("draft", draft, vocab_ids)] if draft is not None else [])


def _write_graphs(staging: Path, graphs: dict, variants: dict, sessions: dict) -> dict[str, WeightFile]:
    """One weights file per model, shared by all of that model's graphs, variants and session graph."""
    weight_files = {role: WeightFile(f"{role}.weights") for role in sessions}
    for builder, graph in [*graphs.values(), *variants.values()]:
        weight_files[graph.model].add(builder.weights)
    for role, (builder, _) in sessions.items():
        weight_files[role].add(builder.weights)
    for weight_file in weight_files.values():
        weight_file.write(staging / weight_file.filename)
    for name, (builder, graph) in graphs.items():
        onnx.save_model(builder.model(weight_files[graph.model].locations), str(staging / f"{name}.onnx"))
    for name, (builder, graph) in variants.items():
        onnx.save_model(builder.model(weight_files[graph.model].locations), str(staging / variant_file(name)))
    for role, (builder, _) in sessions.items():
        onnx.save_model(builder.model(weight_files[role].locations), str(staging / f"{builder.name}.onnx"))
    return weight_files


def _check_onnx(path: Path, name: str) -> None:
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as e:
        raise AssertionError(f"exported graph {name} fails onnx.checker: {e}") from None


def _check_graph(path: Path, name: str, portable: bool = True) -> list[str]:
    """onnx.checker, then (for a `portable` bundle, one without ONNX-Runtime-only precisions)
    TensorRT's parser rules; returns what only the plugin makes parsable."""
    _check_onnx(path, name)
    return check_tensorrt_compatible(onnx.load(str(path), load_external_data=False), name) if portable else []


def _io_spec(values) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec(v.name, DTYPES[v.type.tensor_type.elem_type],
                            tuple(d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim)) for v in values)


def _graph_entry(staging: Path, graph: GraphId, needs_plugin: list[str], has_variant: bool) -> GraphEntry:
    model = onnx.load(str(staging / f"{graph.name}.onnx"), load_external_data=False)
    return GraphEntry(graph, f"{graph.name}.onnx", _io_spec(model.graph.input), _io_spec(model.graph.output),
                      *_op_summary(model), tensorrt_needs_plugin=tuple(needs_plugin),
                      single_sequence=_variant_entry(staging, graph.name) if has_variant else None)


def _variant_entry(staging: Path, name: str) -> VariantEntry:
    model = onnx.load(str(staging / variant_file(name)), load_external_data=False)
    return VariantEntry(variant_file(name), *_op_summary(model))


# GGUF formats whose values are near float (an int4 build of them is an ordinary quantization)
NEAR_FLOAT_FORMATS = ("F16", "BF16", "Q8_0")


def _warn_int4_of_low_bit_blocks(spec: ModelSpec, stored: str) -> None:
    """int4 of tensors the file holds in low-bit blocks the build does not keep (2-3-bit K-quants, IQ
    codebooks; 5-6-bit blocks in a TensorRT build) quantizes twice: symmetric blocks of 128 over the
    file's own. Done to Gemma 3 270M's Q4_K and Q5_0 matrices, it cost +0.56 nats a token against the
    file's own model (docs/performance.md, "On real weights")."""
    low_bit = sorted(kind for kind in spec.source.converted if kind not in NEAR_FLOAT_FORMATS)
    if stored == "int4" and low_bit:
        logger.warning(f"{spec.path}: its {', '.join(low_bit)} tensors are quantized again to int4 (symmetric "
                       "blocks of 128), a coarser model than the file's; int8, the default for a GGUF, stays "
                       "closer to it")


def _op_summary(model: onnx.ModelProto) -> tuple[dict[str, int], int]:
    """(op counts, by op; nodes) of a graph's top level."""
    ops = collections.Counter(n.op_type for n in model.graph.node)
    return dict(sorted(ops.items())), len(model.graph.node)


def _model_entry(spec: ModelSpec, weight_file: WeightFile, matmul_weights: str, scored_vocab: int,
                 session: tuple, aux_layers: tuple[int, ...] = ()) -> ModelEntry:
    hp, (builder, kinds) = spec.hp, session
    return ModelEntry(
        source=str(spec.path.resolve()),
        # safetensors, or a GGUF's formats: which were kept as blocks and which dequantized
        source_format=SourceFormat(spec.source.format, dict(spec.source.kept), dict(spec.source.converted)),
        model_type=spec.model_type, num_params=spec.num_params, num_layers=hp["num_layers"],
        num_heads=hp["num_heads"], num_kv_heads=hp["num_kv_heads"], head_dim=hp["head_dim"],
        hidden_size=hp["hidden_size"], vocab_size=hp["vocab_size"], weights_file=weight_file.filename,
        matmul_weights=matmul_weights, scored_vocab=scored_vocab, config=spec.config,
        session=SessionEntry(f"{builder.name}.onnx", kinds), eagle_aux_layers=aux_layers,
    )


def _tokenizer_entry(target: ModelSpec, tokenizer) -> TokenizerEntry:
    return TokenizerEntry("tokenizer", tuple(eos_token_ids(target, tokenizer)), tokenizer.bos_token_id, len(tokenizer))


def _manifest(staging: Path, models: dict[str, ModelEntry], graphs: dict[str, GraphEntry], gammas, max_seq: int,
              max_batch: int, vocab_out: int, tokenizer: TokenizerEntry, medusa: MedusaEntry | None) -> Manifest:
    """The manifest of the bundle in `staging`, every file written: each is hashed now."""
    files = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())
    return Manifest(
        speccompile_version=version("speccompile"),  # as installed: what `speccompile --version` says
        opset=OPSET, dtype="float32", gammas=tuple(gammas), default_gamma=gammas[0], max_seq=max_seq,
        max_batch=max_batch, vocab_size=vocab_out, models=models, tokenizer=tokenizer, graphs=graphs,
        files={name: sha256_file(staging / name) for name in files}, medusa=medusa, format_version=FORMAT_VERSION,
    )


def _move_into_place(staging: Path, out_dir: Path, force: bool) -> None:
    """The bundle appears at out_dir by one rename, whole or not at all. A build into a directory
    that another build filled meanwhile (it was empty when this one began) says so, unless --force."""
    try:
        os.rename(staging, out_dir)  # an empty out_dir is replaced; a non-empty one refuses (ENOTEMPTY)
        return
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not out_dir.is_dir():
            raise
        if not force:
            shutil.rmtree(staging, ignore_errors=True)
            raise SpecCompileError(f"{out_dir} was written by another build while this one ran (pass --force to "
                                   "replace it); this build's files are removed") from None
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    os.replace(out_dir, old)
    os.replace(staging, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def _remove_leftovers(out_dir: Path) -> None:
    """What builds into out_dir killed before they finished left beside it (their staging
    directories, a replaced bundle not yet removed): each names its process, which is gone."""
    for leftover in out_dir.parent.glob(f".{out_dir.name}.*"):
        owner = _owner(leftover.name, out_dir.name)
        if owner is not None and not _alive(owner):
            logger.info(f"  removing {leftover.name}, left by build process {owner}, which ended before finishing")
            shutil.rmtree(leftover, ignore_errors=True)


def _owner(name: str, bundle: str) -> int | None:
    """The process id a leftover's name records (.NAME.build-PID-XXXX.partial, .NAME.old-PID), if any."""
    rest = name[len(bundle) + 2 :]
    for prefix, end in (("build-", "-"), ("old-", None)):
        if rest.startswith(prefix):
            digits = rest[len(prefix) :].split(end)[0] if end else rest[len(prefix) :]
            return int(digits) if digits.isdigit() else None
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 1e6
