"""The bundle format, which the compiler writes and the runtime reads: manifest.json, ONNX graphs,
weights, tokenizer, and their integrity check on open.

Integrity is the sha256 of every file, recorded in the manifest at build time. Hashing a real-size
bundle costs seconds to minutes (an 8B float32 bundle is 32 GB to read), so it is not paid at every
open: after a full check, a stamp file records each file's size, inode and change time (ctime),
which every write, copy or replacement of a file changes and no user can set back, plus the
manifest's own hash. An open whose stamp matches costs a few `stat` calls and one hash of the
manifest; a file the stamp does not vouch for is hashed again, and refused if it changed.
`speccompile verify` always hashes everything.
"""

import functools
import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from speccompile.errors import SpecCompileError, read_json_object

MANIFEST = "manifest.json"
FORMAT_VERSION = 6  # 2: verification graphs take draft_len [B]; 3: greedy steps output their confidence;
# 4: sampling graphs take coupled [B] and Gumbel noise (the coupled rule); 5: logits processors and
# log-probabilities in every graph, and the target's prompt-scoring graph; 6: grammar masks (`forbidden`)
# in every graph, Medusa trees' included
STAMP = ".verified.json"  # not in the manifest's file list: it describes the files, it is not one of them
STAMP_CHECKS = 2  # what a stamp vouches for: 1, the files' hashes; 2, also their graphs' data and ops (check_graph)
TOP_LOGPROBS = 20  # the most likely tokens a graph reports with their log-probabilities (OpenAI's largest top_logprobs)
# each position's log-probability of the token emitted there, and the TOP_LOGPROBS most likely (compiler/logits.py)
LOGPROBS = ("token_logprob", "top_logprobs", "top_ids")


# what a graph computes (see compiler/transformer.py) -> the outputs a runtime reads back; everything
# else a graph returns is the KV cache, which the runtime binds in place
GRAPH_OUTPUTS = {
    "forward": ("next_token", "confidence", *LOGPROBS),
    "sample": ("next_token", "probs", *LOGPROBS),
    "verify": ("accepted", "next_token", "new_len", *LOGPROBS),
    "verify_sample": ("accepted", "next_token", "new_len", *LOGPROBS),
    # the target over a chunk of prompt: each position's log-probability of the next prompt token (echo)
    "score": LOGPROBS,
    # a token tree with Medusa heads (core/tree.py): also which node ended the accepted path, and the
    # heads' candidates for the next iteration's tree (its root is next_token)
    "verify_tree": ("accepted", "next_token", "new_len", "best_node", "next_tree"),
    "verify_tree_typical": ("accepted", "next_token", "new_len", "best_node", "next_tree"),
    # an EAGLE-3 head (compiler/eagle_graph.py), over the target's features (catch_up) or its own last
    # output (step): its draft (a target id), the draft's probability, and the head's output [B, H] that
    # its next step reads back in. Last here: a session graph numbers its kinds by their order in this
    # dict (session_graph.KINDS), recorded in manifests, and the head's graphs have no session graph
    "catch_up": ("next_token", "confidence", "hidden"),
    "step": ("next_token", "confidence", "hidden"),
    # the same two drawing their draft from the head's distribution after a row's temperature, top-k and
    # top-p, over the target's vocabulary (zero outside the head's), which they return: a sampled request's
    # drafts, verified exactly with it (an EAGLE-3 head built before them has none: sampled requests then
    # get no EAGLE drafts)
    "catch_up_sample": ("next_token", "probs", "hidden"),
    "step_sample": ("next_token", "probs", "hidden"),
    # EAGLE-2's dynamic token tree (core/proposers/eagle_tree.py), drafted by the head and verified by the
    # target in one pass: the catch-up's draft with the head's TOP_LOGPROBS best tokens there (the
    # tree's first level); a step over several nodes of the tree at once, each attending to the keys
    # `visible` says, returning each node's best tokens and its output; and the target's verification
    # of a tree whose topology is an input, as Medusa's, without the heads (its features read back)
    "tree_catch_up": ("next_token", "confidence", "hidden", "top_ids", "top_logprobs"),
    "tree_step": ("top_ids", "top_logprobs", "node_hidden"),
    "verify_eagle_tree": ("accepted", "next_token", "new_len", "best_node"),
}
GRAPH_KINDS = tuple(GRAPH_OUTPUTS)
# what each kind is, as data (a kind is never tested by its spelling): a step scores each row's last
# token; a chain verification has a γ; a tree verification takes its topology as an input
STEP_KINDS = ("forward", "sample")
CHAIN_KINDS = ("verify", "verify_sample")
TREE_KINDS = ("verify_tree", "verify_tree_typical", "verify_eagle_tree")
MEDUSA_TREE_KINDS = ("verify_tree", "verify_tree_typical")  # the trees whose graph holds the Medusa heads
SAMPLING_KINDS = ("sample", "verify_sample", "catch_up_sample", "step_sample")
HEAD_KINDS = ("catch_up", "step", "catch_up_sample", "step_sample", "tree_catch_up", "tree_step")  # the head's only
EAGLE_TREE_KINDS = ("tree_catch_up", "tree_step", "verify_eagle_tree")  # a head's dynamic trees (all or none)
HEAD_ROLE = "eagle"  # an EAGLE-3 head: one layer drafting from the target's features
ROLES = ("target", "draft", HEAD_ROLE)
# each read-back output's element type, and whether it has a value per sequence ([B]), per vocabulary
# entry ([B, V]), per tree node ([B, N]), per scored position ([B, R]: 1 for a step, all T of a
# verification or a score) or per position and top token ([B, R, TOP_LOGPROBS]); confidence: the
# probability of the greedy token (softmax over the scored vocabulary), by which a draft stops
# proposing (core/scheduler.py, p_min); hidden: the EAGLE-3 head's output per sequence ([B, H], "state")
OUTPUT_TYPES = {"next_token": ("int64", None), "confidence": ("float32", None), "probs": ("float32", "vocab"),
                "accepted": ("int64", None), "new_len": ("int64", None), "best_node": ("int64", None),
                "next_tree": ("int64", "tree"), "token_logprob": ("float32", "positions"),
                "top_logprobs": ("float32", "top"), "top_ids": ("int64", "top"), "aux_hidden": ("float32", "hidden"),
                "hidden": ("float32", "state"), "node_hidden": ("float32", "hidden")}
# An output only a bundle built for an EAGLE-3 head has (ModelEntry.eagle_aux_layers), in the target's
# graphs of AUX_KINDS and its session graph: at every input position (all T of a prefill chunk or a
# step, all γ+1 of a verification), the residual stream entering each of those layers, side by side in
# their order: [B, T, len(eagle_aux_layers) * hidden_size]. Not in GRAPH_OUTPUTS, which every bundle's
# graphs have: Manifest.read_back says which graphs return it.
AUX_HIDDEN = "aux_hidden"
AUX_KINDS = (*STEP_KINDS, *CHAIN_KINDS, "verify_eagle_tree")


def output_array(name: str, batch: int, vocab_size: int, tree_size: int = 0, positions: int = 1, hidden: int = 0):
    """(shape, numpy dtype name) of a read-back output for a batch. For aux_hidden, `positions` is
    the call's input width T (every position, whatever the kind) and `hidden` the output's last
    dimension, len(eagle_aux_layers) * hidden_size (ModelEntry.aux_hidden_width); for the EAGLE-3
    head's `hidden`, `hidden` is the head's hidden_size."""
    dtype, width = OUTPUT_TYPES[name]
    shapes = {None: (batch,), "vocab": (batch, vocab_size), "tree": (batch, tree_size),
              "positions": (batch, positions), "top": (batch, positions, TOP_LOGPROBS),
              "hidden": (batch, positions, hidden), "state": (batch, hidden)}
    return shapes[width], dtype


@dataclass(frozen=True)
class GraphId:
    """What a graph is: its model, its kind and, for a verification, its γ. Its name, the manifest's
    key and its file's stem (`target_forward`, `target_verify_sample_g4`), is derived from these
    here, once; nothing parses a name back."""

    model: str  # one of ROLES
    kind: str  # one of GRAPH_KINDS
    gamma: int | None = None  # chain verifications only (a tree's topology is an input of its graph)

    def __post_init__(self):
        assert self.kind in GRAPH_KINDS, f"graph kind {self.kind!r} not in {GRAPH_KINDS}"
        assert (self.model == "eagle") == (self.kind in HEAD_KINDS), f"a {self.model} graph of kind {self.kind}"
        assert (self.gamma is not None) == (self.verifies and not self.tree), f"{self.kind} graph with γ={self.gamma}"

    # Both are cached: the speculative loop asks for its graphs at every step.
    @classmethod
    @functools.cache
    def step(cls, model: str, sample: bool) -> "GraphId":
        """A prefill, decode or draft step: greedy (`forward`) or sampled."""
        return cls(model, "sample" if sample else "forward")

    @classmethod
    @functools.cache
    def verification(cls, gamma: int, sample: bool) -> "GraphId":
        return cls("target", "verify_sample" if sample else "verify", int(gamma))

    @classmethod
    @functools.cache
    def score(cls) -> "GraphId":
        """The target's log-probabilities over a chunk of prompt (echo), writing its cache as a prefill does."""
        return cls("target", "score")

    @classmethod
    @functools.cache
    def eagle_catch_up(cls, sample: bool = False) -> "GraphId":
        """The EAGLE-3 head over target features: a prompt chunk's, or the positions a verification kept;
        its draft greedy or sampled."""
        return cls("eagle", "catch_up_sample" if sample else "catch_up")

    @classmethod
    @functools.cache
    def eagle_step(cls, sample: bool = False) -> "GraphId":
        """One more draft of the EAGLE-3 head, from its own last output and draft: greedy or sampled."""
        return cls("eagle", "step_sample" if sample else "step")

    @property
    def positions_scored(self) -> str:
        """How many positions reach the LM head: "last" (each row's last real token) or "all"."""
        return "last" if self.kind in STEP_KINDS or (self.kind in HEAD_KINDS and self.kind != "tree_step") else "all"

    @classmethod
    @functools.cache
    def eagle_tree(cls, kind: str) -> "GraphId":
        """One of a dynamic tree's graphs (EAGLE_TREE_KINDS): the head's or the target's."""
        return cls("target" if kind == "verify_eagle_tree" else "eagle", kind)

    @classmethod
    @functools.cache
    def tree_verification(cls, typical: bool = False) -> "GraphId":
        """A token tree with the greedy or the typical rule; its topology is an input, any size."""
        return cls("target", "verify_tree_typical" if typical else "verify_tree")

    @property
    def verifies(self) -> bool:
        return self.kind in CHAIN_KINDS or self.tree

    @property
    def sampling(self) -> bool:
        return self.kind in SAMPLING_KINDS

    @property
    def tree(self) -> bool:
        return self.kind in TREE_KINDS

    @property
    def name(self) -> str:
        return f"{self.model}_{self.kind}" + (f"_g{self.gamma}" if self.gamma is not None else "")

    @property
    def outputs(self) -> tuple[str, ...]:
        return GRAPH_OUTPUTS[self.kind]


def kv_cache_shape(num_kv_heads: int, head_dim: int, max_seq: int, batch="batch") -> list:
    """One layer's K (or V) cache: [batch, KV heads, max_seq, head dim], float32, addressed by
    position (graphs declare `batch` symbolic; a runtime allocates it for the batch it runs)."""
    return [batch, num_kv_heads, max_seq, head_dim]


def kv_cache_bytes_per_sequence(model: "ModelEntry", max_seq: int) -> int:
    """K and V of every layer of a model of the bundle, for one sequence at max_seq."""
    return 2 * model.num_layers * model.num_kv_heads * model.head_dim * max_seq * 4


# ---------------------------------------------------------------------------------------------
# The manifest, as typed records. This module alone reads and writes its JSON: `from_json` checks
# every field it takes (a bundle is untrusted input, refused in one line that says where it is
# wrong), `to_json` gives back the same JSON, key for key.


def _refused(what: str) -> SpecCompileError:
    return SpecCompileError(f"{MANIFEST} does not describe a bundle speccompile wrote: {what}")


JSON_NAMES = {int: "an integer", str: "a string", bool: "true or false", list: "a list", dict: "an object",
              type(None): "null", object: "a value"}
NUMBER = (int, float)


def _checked(value, kind, where: str):
    """`value` if it is of `kind` (a type or a tuple of them; a JSON true is no number)."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        named = "a number" if kinds == NUMBER else " or ".join(JSON_NAMES[k] for k in kinds)
        raise _refused(f"{where} is not {named}")
    return value


class _Object:
    """One JSON object of a manifest, read field by field."""

    def __init__(self, data, where: str):
        self.data, self.where = _checked(data, dict, where), where

    def take(self, key: str, kind=object, optional: bool = False):
        """The field's value, of `kind`; None for an optional field that is absent."""
        if key not in self.data:
            if optional:
                return None
            raise _refused(f"{self.where} has no {key!r}")
        return _checked(self.data[key], kind, f"{self.where}.{key}")

    def items(self, key: str, kind, optional: bool = False) -> tuple | None:
        """A list field whose items are all of `kind`, as a tuple; None for an optional field that is absent."""
        where, values = f"{self.where}.{key}", self.take(key, list, optional)
        return None if values is None else tuple(_checked(item, kind, f"{where}[{i}]") for i, item in enumerate(values))

    def mapping(self, key: str, read, optional: bool = False) -> dict | None:
        """An object field: name -> read(value, where) for each of its entries."""
        entries = self.take(key, dict, optional)
        if entries is None:
            return None
        return {name: read(value, f"{self.where}.{key}[{name!r:.60}]") for name, value in entries.items()}

    def record(self, key: str, record, optional: bool = False):
        """An object field read as `record` (a class with from_json(data, where))."""
        if key not in self.data and optional:
            return None
        return record.from_json(self.take(key, dict), f"{self.where}.{key}")


def _of(kind):
    """A mapping's reader for plain values of `kind`."""
    return lambda value, where: _checked(value, kind, where)


@dataclass(frozen=True)
class TensorSpec:
    """A graph input or output: its name, numpy dtype name and shape (a str: a symbolic dimension)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]

    @classmethod
    def from_json(cls, data, where: str) -> "TensorSpec":
        o = _Object(data, where)
        return cls(o.take("name", str), o.take("dtype", str), o.items("shape", (int, str)))

    def to_json(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


def _specs(value, where: str) -> tuple[TensorSpec, ...]:
    return tuple(TensorSpec.from_json(item, f"{where}[{i}]") for i, item in enumerate(_checked(value, list, where)))


@dataclass(frozen=True)
class VariantEntry:
    """A graph's batch-1 ONNX Runtime variant (fused attention; see compiler/transformer.py)."""

    file: str
    op_counts: dict[str, int]
    nodes: int
    batch: int = 1
    backend: str = "onnxruntime"

    @classmethod
    def from_json(cls, data, where: str) -> "VariantEntry":
        o = _Object(data, where)
        return cls(o.take("file", str), o.mapping("op_counts", _of(int)), o.take("nodes", int), o.take("batch", int),
                   o.take("backend", str))

    def to_json(self) -> dict:
        return {"file": self.file, "batch": self.batch, "backend": self.backend, "op_counts": self.op_counts,
                "nodes": self.nodes}


@dataclass(frozen=True)
class GraphEntry:
    """One graph of the bundle: what it is (its GraphId, whose name is its key in the manifest), its
    file, inputs and outputs, op counts, what only the TensorRT plugin makes parsable, and its batch-1
    variant where it has one."""

    id: GraphId
    file: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    op_counts: dict[str, int]
    nodes: int
    tensorrt_needs_plugin: tuple[str, ...] = ()
    single_sequence: VariantEntry | None = None

    @classmethod
    def from_json(cls, data, where: str) -> "GraphEntry":
        o = _Object(data, where)
        return cls(_graph_id(o), o.take("file", str), _specs(o.take("inputs"), f"{where}.inputs"),
                   _specs(o.take("outputs"), f"{where}.outputs"), o.mapping("op_counts", _of(int)),
                   o.take("nodes", int), o.items("tensorrt_needs_plugin", str),
                   o.record("single_sequence", VariantEntry, optional=True))

    def to_json(self) -> dict:
        data = {"file": self.file, "model": self.id.model, "kind": self.id.kind, "gamma": self.id.gamma,
                "inputs": [spec.to_json() for spec in self.inputs],
                "outputs": [spec.to_json() for spec in self.outputs], "op_counts": self.op_counts,
                "nodes": self.nodes, "tensorrt_needs_plugin": list(self.tensorrt_needs_plugin)}
        return data | ({"single_sequence": self.single_sequence.to_json()} if self.single_sequence else {})

    @property
    def files(self) -> list[str]:
        return [self.file] + ([self.single_sequence.file] if self.single_sequence else [])


def _graph_id(o: _Object) -> GraphId:
    """The GraphId a graph entry records, if it is one speccompile makes (GraphId asserts the rest)."""
    model, kind, gamma = o.take("model", str), o.take("kind", str), o.take("gamma", (int, type(None)))
    if model not in ROLES or kind not in GRAPH_KINDS or (gamma is not None) != (kind in CHAIN_KINDS) \
            or (gamma is not None and gamma < 1) or (model == "eagle") != (kind in HEAD_KINDS):
        raise _refused(f"{o.where} is no graph speccompile makes (model {model!r:.40}, kind {kind!r:.40}, "
                       f"γ {gamma!r})")
    return GraphId(model, kind, gamma)


@dataclass(frozen=True)
class SourceFormat:
    """What a model was read from: "safetensors" or "gguf", and a GGUF's tensor formats by what the
    build did with them (kept as blocks, or converted), tensors per format (compiler/checkpoint.Source)."""

    format: str
    kept: dict[str, int]
    converted: dict[str, int]

    @classmethod
    def from_json(cls, data, where: str) -> "SourceFormat":
        o = _Object(data, where)
        return cls(o.take("format", str), o.mapping("kept", _of(int)), o.mapping("converted", _of(int)))

    def to_json(self) -> dict:
        return {"format": self.format, "kept": self.kept, "converted": self.converted}


@dataclass(frozen=True)
class SessionEntry:
    """A model's session graph (compiler/session_graph.py): its file and the `kind` input's value per
    graph kind it runs."""

    file: str
    kinds: dict[str, int]

    @classmethod
    def from_json(cls, data, where: str) -> "SessionEntry":
        o = _Object(data, where)
        kinds = o.mapping("kinds", _of(int))
        if not set(kinds) <= set(GRAPH_KINDS) - set(HEAD_KINDS):
            raise _refused(f"{where}.kinds names a graph kind speccompile does not make")
        return cls(o.take("file", str), kinds)

    def to_json(self) -> dict:
        return {"file": self.file, "kinds": self.kinds}


@dataclass(frozen=True)
class ModelEntry:
    """One model of the bundle (target, draft or EAGLE-3 head): where it came from, its shape, its weights
    file and precision, the tokens its LM head scores, its checkpoint's config.json verbatim, and its
    session graph (absent from bundles built before session graphs, and from the head's). The head's
    vocab_size is the target's (it drafts target ids), its scored_vocab its draft vocabulary."""

    source: str
    source_format: SourceFormat
    model_type: str
    num_params: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    weights_file: str
    matmul_weights: str
    scored_vocab: int  # fewer than vocab_size with --draft-vocab
    config: dict
    session: SessionEntry | None = None
    # the target's layers whose incoming residual stream its graphs of AUX_KINDS (and its session
    # graph) output as aux_hidden, for an EAGLE-3 head; () in a bundle built without them
    eagle_aux_layers: tuple[int, ...] = ()

    SHAPE = ("num_params", "num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "vocab_size")

    @classmethod
    def from_json(cls, data, where: str) -> "ModelEntry":
        o = _Object(data, where)
        layers = o.items("eagle_aux_layers", int, optional=True)
        entry = cls(o.take("source", str), o.record("source_format", SourceFormat), o.take("model_type", str),
                    *(o.take(key, int) for key in cls.SHAPE), weights_file=o.take("weights_file", str),
                    matmul_weights=o.take("matmul_weights", str), scored_vocab=o.take("scored_vocab", int),
                    config=o.take("config", dict), session=o.record("session", SessionEntry, optional=True),
                    eagle_aux_layers=layers or ())
        if layers is not None and (not layers or not all(0 <= i < entry.num_layers for i in layers)):
            raise _refused(f"{where}.eagle_aux_layers {list(layers)!r:.60} are not layers 0..{entry.num_layers - 1} "
                           "of the model")
        return entry

    def to_json(self) -> dict:
        data = {"source": self.source, "source_format": self.source_format.to_json(), "model_type": self.model_type,
                **{key: getattr(self, key) for key in self.SHAPE}, "weights_file": self.weights_file,
                "matmul_weights": self.matmul_weights, "scored_vocab": self.scored_vocab, "config": self.config}
        data |= {"session": self.session.to_json()} if self.session else {}
        return data | ({"eagle_aux_layers": list(self.eagle_aux_layers)} if self.eagle_aux_layers else {})

    @property
    def aux_hidden_width(self) -> int:
        """The last dimension of the aux_hidden output: 0 without eagle_aux_layers."""
        return len(self.eagle_aux_layers) * self.hidden_size


@dataclass(frozen=True)
class TokenizerEntry:
    """The bundle's tokenizer: its directory and the ids the runtime stops at or starts with."""

    dir: str
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    size: int

    @classmethod
    def from_json(cls, data, where: str) -> "TokenizerEntry":
        o = _Object(data, where)
        return cls(o.take("dir", str), o.items("eos_token_ids", int), o.take("bos_token_id", (int, type(None))),
                   o.take("size", int))

    def to_json(self) -> dict:
        return {"dir": self.dir, "eos_token_ids": list(self.eos_token_ids), "bos_token_id": self.bos_token_id,
                "size": self.size}


@dataclass(frozen=True)
class MedusaEntry:
    """A Medusa bundle's heads: how many, how often each rank of each is right, the measured
    probabilities of rank paths ([path, probability] pairs), the candidates each head proposes, and
    the heads' directory (core/tree.py grows the token tree from these)."""

    num_heads: int
    top_k_accuracy: tuple[tuple[float, ...], ...]
    path_probability: tuple[tuple[tuple[int, ...], float], ...]
    candidates: int
    source: str

    @classmethod
    def from_json(cls, data, where: str) -> "MedusaEntry":
        o = _Object(data, where)
        accuracy = tuple(tuple(_checked(p, NUMBER, f"{where}.top_k_accuracy[{k}]") for p in row)
                         for k, row in enumerate(o.items("top_k_accuracy", list)))
        paths = tuple(_path_probability(pair, f"{where}.path_probability[{i}]")
                      for i, pair in enumerate(o.items("path_probability", list)))
        return cls(o.take("num_heads", int), accuracy, paths, o.take("candidates", int), o.take("source", str))

    def to_json(self) -> dict:
        return {"num_heads": self.num_heads, "top_k_accuracy": [list(row) for row in self.top_k_accuracy],
                "path_probability": [[list(path), p] for path, p in self.path_probability],
                "candidates": self.candidates, "source": self.source}


def _path_probability(pair: list, where: str) -> tuple[tuple[int, ...], float]:
    if len(pair) != 2:
        raise _refused(f"{where} is not a [path, probability] pair")
    path = tuple(_checked(rank, int, where) for rank in _checked(pair[0], list, where))
    return path, _checked(pair[1], NUMBER, where)


@dataclass(frozen=True)
class EngineEntry:
    """A graph's TensorRT engine: its file, and the TensorRT version and GPU it runs on (any Ampere+
    GPU with hardware_compatible, later TensorRT versions with version_compatible)."""

    file: str
    tensorrt_version: str
    gpu: str
    compute_capability: str
    profiles: int
    hardware_compatible: bool
    version_compatible: bool

    @classmethod
    def from_json(cls, data, where: str) -> "EngineEntry":
        o = _Object(data, where)
        return cls(o.take("file", str), o.take("tensorrt_version", str), o.take("gpu", str),
                   o.take("compute_capability", str), o.take("profiles", int), o.take("hardware_compatible", bool),
                   o.take("version_compatible", bool))

    def to_json(self) -> dict:
        return {"file": self.file, "tensorrt_version": self.tensorrt_version, "gpu": self.gpu,
                "compute_capability": self.compute_capability, "profiles": self.profiles,
                "hardware_compatible": self.hardware_compatible, "version_compatible": self.version_compatible}


@dataclass(frozen=True)
class Manifest:
    """manifest.json: what the bundle holds. `files`: every file of the bundle -> its sha256 (the
    integrity check on open); `engines`: TensorRT engines by graph name, empty until built."""

    speccompile_version: str
    opset: int
    dtype: str
    gammas: tuple[int, ...]
    default_gamma: int
    max_seq: int
    max_batch: int
    vocab_size: int
    models: dict[str, ModelEntry]
    tokenizer: TokenizerEntry
    graphs: dict[str, GraphEntry]
    files: dict[str, str]
    medusa: MedusaEntry | None = None
    engines: dict[str, EngineEntry] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @classmethod
    def from_json(cls, data) -> "Manifest":
        """The manifest a JSON object describes, or a SpecCompileError in one line saying what is wrong."""
        o = _Object(data, "manifest")
        version = o.data.get("format_version")
        if version != FORMAT_VERSION:
            raise SpecCompileError(f"bundle format version {version!r:.40} is not supported (this speccompile "
                                   f"reads version {FORMAT_VERSION}); rebuild the bundle")
        files = o.take("files", dict)
        if not all(isinstance(sha, str) for sha in files.values()):
            raise SpecCompileError(f"{MANIFEST} has no valid file list")
        manifest = cls(o.take("speccompile_version", str), o.take("opset", int), o.take("dtype", str),
                       o.items("gammas", int), o.take("default_gamma", int), o.take("max_seq", int),
                       o.take("max_batch", int), o.take("vocab_size", int), o.mapping("models", ModelEntry.from_json),
                       o.record("tokenizer", TokenizerEntry), o.mapping("graphs", GraphEntry.from_json), files,
                       o.record("medusa", MedusaEntry, optional=True),
                       o.mapping("engines", EngineEntry.from_json, optional=True) or {})
        manifest._check_consistent()
        return manifest

    def _check_consistent(self) -> None:
        """What the types do not say: the graphs are named for what they are, of models the bundle
        holds, and its γ values are the ones it compiled."""
        if "target" not in self.models or not set(self.models) <= set(ROLES):
            raise _refused(f"its models are not a target and at most a draft and an EAGLE-3 head: "
                           f"{sorted(self.models)!r:.80}")
        for name, graph in self.graphs.items():
            if graph.id.name != name:
                raise _refused(f"graph {name!r:.60} records itself as {graph.id.name}")
            if graph.id.model not in self.models:
                raise _refused(f"graph {name} is the {graph.id.model}'s, a model it does not hold")
        self._check_aux_hidden()
        self._check_eagle()
        if min(self.max_seq, self.max_batch, self.vocab_size) < 1:
            raise _refused(f"its max_seq {self.max_seq}, max_batch {self.max_batch} or vocab_size {self.vocab_size} "
                           "is not positive")
        if not self.gammas or min(self.gammas) < 1 or self.default_gamma not in self.gammas:
            raise _refused(f"its γ values {list(self.gammas)!r:.60} are not all positive or lack its default γ "
                           f"{self.default_gamma}")

    def _check_aux_hidden(self) -> None:
        """aux_hidden is where the target's eagle_aux_layers say (read_back), of their width, and nowhere else."""
        for role, model in self.models.items():
            if role != "target" and model.eagle_aux_layers:
                raise _refused(f"its {role} records eagle_aux_layers, which only the target's graphs output")
        for name, graph in self.graphs.items():
            widths = [spec.shape[-1:] for spec in graph.outputs if spec.name == AUX_HIDDEN]
            expected = [(self.models[graph.id.model].aux_hidden_width,)] if AUX_HIDDEN in self.read_back(graph.id) \
                else []
            if widths != expected:
                raise _refused(f"graph {name}'s aux_hidden outputs {widths!r:.60} are not what its model's "
                               f"eagle_aux_layers make ({expected})")

    def _check_eagle(self) -> None:
        """An EAGLE-3 head reads the target's features: it comes with the target's eagle_aux_layers, as
        one layer without a session graph, and with both its graphs, which read features of the width
        the target's graphs output and return the head's own width. (Features without a head are a
        bundle of their own: what a head is trained on.)"""
        head, target = self.models.get("eagle"), self.models["target"]
        if head is None:
            return
        if not target.eagle_aux_layers:
            raise _refused("it holds an EAGLE-3 head, but its target records no eagle_aux_layers to feed it")
        if head.num_layers != 1 or head.session is not None:
            raise _refused(f"its EAGLE-3 head has {head.num_layers} layers or a session graph (one layer, none)")
        sampled = [GraphId.eagle_catch_up(True), GraphId.eagle_step(True)]
        if sum(graph.name in self.graphs for graph in sampled) == 1:
            raise _refused("its EAGLE-3 head has one of its sampled graphs without the other")
        trees = [GraphId.eagle_tree(kind).name in self.graphs for kind in EAGLE_TREE_KINDS]
        if any(trees) and not all(trees):
            raise _refused("its EAGLE-3 head has some of the dynamic tree's graphs without the others")
        for graph in [GraphId.eagle_catch_up(), GraphId.eagle_step()] + [g for g in sampled if g.name in self.graphs]:
            entry = self.graphs.get(graph.name)
            if entry is None:
                raise _refused(f"it holds an EAGLE-3 head without its graph {graph.name}")
            features = [spec.shape[-1] for spec in entry.inputs if spec.name == AUX_HIDDEN]
            outputs = [spec.shape[-1] for spec in entry.outputs if spec.name == "hidden"]
            if features != ([target.aux_hidden_width] if graph in (GraphId.eagle_catch_up(), sampled[0]) else []) \
                    or outputs != [head.hidden_size]:
                raise _refused(f"graph {graph.name} reads features of width {features!r:.40} or returns a hidden "
                               f"state of width {outputs!r:.40}: not the target's {target.aux_hidden_width} and "
                               f"the head's {head.hidden_size}")

    def read_back(self, graph: GraphId) -> tuple[str, ...]:
        """The outputs a runtime may read back from `graph` (all else it returns is the KV cache): its
        kind's (GraphId.outputs), and aux_hidden from the target's graphs of AUX_KINDS when the bundle
        was built with eagle_aux_layers (the target's session graph returns it too, for every kind)."""
        aux = graph.model == "target" and graph.kind in AUX_KINDS and self.models["target"].eagle_aux_layers
        return graph.outputs + ((AUX_HIDDEN,) if aux else ())

    def to_json(self) -> dict:
        data = {"format_version": self.format_version, "speccompile_version": self.speccompile_version,
                "opset": self.opset, "dtype": self.dtype, "gammas": list(self.gammas),
                "default_gamma": self.default_gamma, "max_seq": self.max_seq, "max_batch": self.max_batch,
                "vocab_size": self.vocab_size, "models": {role: m.to_json() for role, m in self.models.items()},
                "tokenizer": self.tokenizer.to_json(),
                "graphs": {name: graph.to_json() for name, graph in self.graphs.items()}, "files": self.files}
        if self.medusa:
            data["medusa"] = self.medusa.to_json()
        if self.engines:
            data["engines"] = {name: engine.to_json() for name, engine in self.engines.items()}
        return data

    def referenced_files(self) -> list[str]:
        """Every file the runtime may read, as the manifest names them; the tokenizer's last."""
        names = [file for graph in self.graphs.values() for file in graph.files]
        for model in self.models.values():
            names += [model.weights_file] + ([model.session.file] if model.session else [])
        names += [engine.file for engine in self.engines.values()]
        return names + [f"{self.tokenizer.dir}/tokenizer.json"]


def write_manifest(path, manifest: Manifest) -> None:
    """Write the bundle's manifest.json at `path` in one rename, and stamp its files as checked: the
    writer has just hashed every file it lists (and checked its graphs)."""
    path = Path(path)
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest.to_json(), indent=1))
    tmp.replace(path / MANIFEST)
    write_stamp(path, manifest.files)


@dataclass
class Bundle:
    path: Path
    manifest: Manifest

    @property
    def gammas(self) -> list[int]:
        return list(self.manifest.gammas)

    @property
    def default_gamma(self) -> int:
        return self.manifest.default_gamma

    @property
    def max_seq(self) -> int:
        return self.manifest.max_seq

    @property
    def max_batch(self) -> int:
        return self.manifest.max_batch

    @property
    def vocab_size(self) -> int:
        return self.manifest.vocab_size

    def graph(self, name: str) -> GraphEntry:
        return self.manifest.graphs[name]

    def graph_path(self, name: str) -> Path:
        return self.path / self.graph(name).file

    def model(self, role: str) -> ModelEntry:
        return self.manifest.models[role]

    def read_ahead(self) -> None:
        """Ask the kernel to read every model's weights file into the page cache in the background: on
        a cold start ONNX Runtime otherwise faults them in page by page on the threads that pre-pack
        them. A hint that returns at once; nothing where the OS has no posix_fadvise."""
        if not hasattr(os, "posix_fadvise"):
            return
        for model in self.manifest.models.values():
            descriptor = os.open(inside(self.path, model.weights_file), os.O_RDONLY)
            try:
                os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(descriptor)

    @property
    def medusa(self) -> dict | None:
        """A Medusa bundle's heads and token tree as JSON data (core/tree.py reads their lists), else None."""
        return self.manifest.medusa.to_json() if self.manifest.medusa else None

    @property
    def has_draft(self) -> bool:
        """False for a draft-free bundle (built without --draft): its requests speculate with prompt lookup."""
        return "draft" in self.manifest.models

    @property
    def has_eagle(self) -> bool:
        """Whether the bundle holds an EAGLE-3 head (built with --eagle): its requests may ask for proposer eagle."""
        return "eagle" in self.manifest.models

    @property
    def eagle_trees(self) -> bool:
        """Whether its EAGLE-3 head has the graphs of dynamic token trees (EAGLE_TREE_KINDS)."""
        return self.has_eagle and GraphId.eagle_tree("tree_step").name in self.manifest.graphs

    @property
    def eagle_samples(self) -> bool:
        """Whether its EAGLE-3 head has the sampled graphs, which draft for sampled requests."""
        return self.has_eagle and GraphId.eagle_step(True).name in self.manifest.graphs

    @property
    def has_engines(self) -> bool:
        """Whether TensorRT engines were built for the bundle (build --backend tensorrt)."""
        return bool(self.manifest.engines)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def open_bundle(path, verify: bool = True) -> Bundle:
    """The bundle at `path`; with `verify`, its files checked against the manifest's sha256: only the
    files the stamp of the last check no longer vouches for are hashed (all of them without a stamp)."""
    path = Path(path)
    manifest = _read_manifest(path)
    if verify:
        unvouched = _unvouched_files(path, manifest.files)
        if unvouched:
            _verify_files(path, {name: manifest.files[name] for name in unvouched})
            _check_graphs(path, manifest, unvouched)
            write_stamp(path, manifest.files)
    return Bundle(path, manifest)


def verify_bundle(path) -> Bundle:
    """Hash every file of the bundle against its manifest (whatever the stamp says), then stamp it."""
    path = Path(path)
    manifest = _read_manifest(path)
    _verify_files(path, manifest.files)
    _check_graphs(path, manifest, manifest.files)
    write_stamp(path, manifest.files)
    return Bundle(path, manifest)


def _check_graphs(path: Path, manifest: Manifest, names) -> None:
    for name in names:
        if name.endswith(".onnx"):
            check_graph(path, manifest, name)


def _read_manifest(path: Path) -> Manifest:
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise SpecCompileError(f"{path}: not a speccompile bundle (no {MANIFEST})")
    if manifest_file.is_symlink() or manifest_file.stat().st_size > MANIFEST_MAX_BYTES:
        raise SpecCompileError(f"{path}: {MANIFEST} is a link or larger than {MANIFEST_MAX_BYTES >> 20} MiB: "
                               "not a bundle speccompile wrote")
    try:
        manifest = Manifest.from_json(read_json_object(manifest_file))
    except SpecCompileError as e:
        raise SpecCompileError(f"{path}: {e}") from None
    _check_contained(path, manifest)
    return manifest


# A bundle is untrusted input: someone else may have made it. Before any of its files is opened, every
# file it names must be listed in its manifest (and so hashed), lie inside its directory (no "..", no
# absolute path, no link out of it), and the tokenizer be of a sane size. Graphs are read next
# (check_graph): their external data must be listed files too, and their ops the ones speccompile emits.
MANIFEST_MAX_BYTES = 16 << 20
TOKENIZER_MAX_BYTES = 128 << 20  # the largest real tokenizer.json files are tens of MB


def inside(root: Path, name: str) -> Path:
    """root/name, if `name` is a relative path that stays inside root, links resolved; else a
    SpecCompileError naming it. Nothing is opened."""
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise SpecCompileError(f"{root}: the bundle names a file {name!r}, which is not a plain relative path")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise SpecCompileError(f"{root}: the bundle names {name!r}, a path outside its directory: refused")
    base = root.resolve()
    resolved = (base / relative).resolve()
    if resolved != base and base not in resolved.parents:
        raise SpecCompileError(f"{root}: the bundle's {name!r} links outside its directory: refused")
    return root / relative


def _check_contained(path: Path, manifest: Manifest) -> None:
    files = manifest.files
    for name in files:
        inside(path, name)
    unlisted = sorted(set(manifest.referenced_files()) - set(files))
    if unlisted:
        raise SpecCompileError(f"{path}: the bundle reads {unlisted[0]}, which its manifest does not list (and so "
                               "does not hash): refused")
    tokenizer = inside(path, manifest.referenced_files()[-1])
    if tokenizer.is_file() and tokenizer.stat().st_size > TOKENIZER_MAX_BYTES:
        raise SpecCompileError(f"{path}: its tokenizer is {tokenizer.stat().st_size:,} bytes, over the "
                               f"{TOKENIZER_MAX_BYTES:,} a tokenizer may be: refused")
    for entry in tokenizer.parent.iterdir():  # the tokenizer reads its config and chat template too
        name = f"{manifest.tokenizer.dir}/{entry.name}"
        if name not in files:
            raise SpecCompileError(f"{path}: its tokenizer directory holds {entry.name}, which the manifest does "
                                   "not list (and so does not hash): refused")


# the ops speccompile's graphs are made of (compiler/), by domain; a graph with any other is refused
STANDARD_OPS = frozenset(
    "Abs Add And ArgMax Attention Cast Concat Constant ConstantOfShape Cos CumSum DequantizeLinear Div Equal Erf "
    "Exp Expand Gather GatherElements GatherND Gelu Greater GreaterOrEqual Identity If LayerNormalization Less "
    "LessOrEqual Log LogSoftmax MatMul MatMulInteger Max Min Mul Neg Not Or Pad Pow RMSNormalization Range "
    "ReduceMax ReduceMean ReduceMin ReduceSum Relu Reshape RotaryEmbedding Round Shape Sigmoid Sin Slice Softmax "
    "Split Sqrt Squeeze Sub Tanh TensorScatter TopK Transpose Unsqueeze Where".split())
RUNTIME_OPS = frozenset({"GroupQueryAttention", "MatMulNBits"})  # ONNX Runtime's com.microsoft kernels
SPEC_FUNCTIONS = ("SpecAccept", "SpecTransform", "SpecSample")  # the speccompile domain: local functions
FUNCTION_COPIES = 100  # definitions of one function a model may hold (an If branch may need its own)


def function_copies(name: str) -> tuple[str, ...]:
    """The names a function's definitions take in one model: its own, then NAME_1, NAME_2, ... (a copy
    of different body, added by an If branch; compiler/onnx_graph.BranchBuilder)."""
    return (name, *(f"{name}_{k}" for k in range(1, FUNCTION_COPIES)))


SPEC_FUNCTION_NAMES = frozenset(copy for name in SPEC_FUNCTIONS for copy in function_copies(name))


def check_graph(path: Path, manifest: Manifest, name: str) -> None:
    """Refuse a graph file whose external data lies outside the bundle's listed files, or whose ops
    are not speccompile's, before a session opens it (its structure is read, not its weights)."""
    import onnx

    try:
        model = onnx.load(str(inside(path, name)), load_external_data=False)
    except Exception as e:  # noqa: BLE001 (protobuf's own errors: a file that is not an ONNX model)
        raise SpecCompileError(f"{path}: {name} is not an ONNX model ({type(e).__name__}): refused") from None
    functions = {f.name for f in model.functions if f.domain == "speccompile" and f.name in SPEC_FUNCTION_NAMES}
    for tensor in graph_initializers(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in tensor.external_data if e.key == "location"), "")
            if location not in manifest.files:
                raise SpecCompileError(f"{path}: {name} reads {tensor.name}'s data from {location!r}, which the "
                                       "bundle does not list: refused")
            inside(path, location)
    for node in [*_nodes(model.graph.node), *(n for f in model.functions for n in _nodes(f.node))]:
        domain = node.domain or ""
        allowed = {"": STANDARD_OPS, "ai.onnx": STANDARD_OPS, "com.microsoft": RUNTIME_OPS,
                   "speccompile": functions}.get(domain, ())
        if node.op_type not in allowed:
            raise SpecCompileError(f"{path}: {name} holds an op speccompile does not emit ({domain or 'ai.onnx'}."
                                   f"{node.op_type}): refused")


def _nodes(nodes):
    """Every node, those inside If branches included."""
    import onnx

    for node in nodes:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _nodes(attribute.g.node)


def graph_initializers(graph):
    """Every initializer of a graph, those of its If branches included."""
    import onnx

    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from graph_initializers(attribute.g)


def _verify_files(path: Path, files: dict[str, str]) -> None:
    for name, expected in files.items():
        file = path / name
        if not file.is_file():
            raise SpecCompileError(f"{path}: bundle file {name} is missing")
        if sha256_file(file) != expected:
            raise SpecCompileError(
                f"{path}: bundle file {name} does not match its sha256 in {MANIFEST} (corrupt or modified)")


RACY_NS = 2_000_000_000  # a file changed within this long before its stamp may change again unseen


def _file_stamps(path: Path, names) -> dict[str, list[int]]:
    stamps = {}
    for name in names:
        try:
            st = os.stat(path / name)
        except OSError:
            continue  # missing: never vouched for, so it is checked (and reported) by hashing
        stamps[name] = [st.st_size, st.st_ino, st.st_ctime_ns]
    return stamps


def write_stamp(path: Path, files: dict[str, str]) -> None:
    """Record that `files` were hashed and matched the manifest, as they are now on disk, with the
    manifest's own hash. A read-only bundle just goes unstamped: each open then hashes it."""
    stamp = {"written_ns": time.time_ns(), "manifest_sha256": sha256_file(path / MANIFEST),
             "checks": STAMP_CHECKS, "files": _file_stamps(path, files)}
    try:
        tmp = path / (STAMP + ".tmp")
        tmp.write_text(json.dumps(stamp))
        tmp.replace(path / STAMP)
    except OSError:
        pass


def _unvouched_files(path: Path, files: dict[str, str]) -> list[str]:
    """The files to hash: those whose size, inode or ctime differ from the stamp, and those changed
    so shortly before it that a later write could share their ctime (timestamps are coarser than
    writes: the "racy" case git handles the same way). Every file when the stamp is missing or the
    manifest is not the one it was made for."""
    try:
        stamp_file = inside(path, STAMP)
        if not stamp_file.is_file():  # none, or not a regular file (never read: a pipe would block)
            return list(files)
        stamp = json.loads(stamp_file.read_text())
        written, recorded = int(stamp["written_ns"]), stamp["files"]
        if stamp["manifest_sha256"] != sha256_file(path / MANIFEST) or stamp.get("checks") != STAMP_CHECKS:
            return list(files)
    except (OSError, ValueError, KeyError, TypeError, SpecCompileError):
        return list(files)
    now = _file_stamps(path, files)
    return [name for name in files
            if name not in now or recorded.get(name) != now[name] or now[name][2] > written - RACY_NS]
