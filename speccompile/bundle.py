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
from dataclasses import dataclass
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
}
GRAPH_KINDS = tuple(GRAPH_OUTPUTS)
# each read-back output's element type, and whether it has a value per sequence ([B]), per vocabulary
# entry ([B, V]), per tree node ([B, N]), per scored position ([B, R]: 1 for a step, all T of a
# verification or a score) or per position and top token ([B, R, TOP_LOGPROBS]); confidence: the
# probability of the greedy token (softmax over the scored vocabulary), by which a draft stops
# proposing (core/scheduler.py, p_min)
OUTPUT_TYPES = {"next_token": ("int64", None), "confidence": ("float32", None), "probs": ("float32", "vocab"),
                "accepted": ("int64", None), "new_len": ("int64", None), "best_node": ("int64", None),
                "next_tree": ("int64", "tree"), "token_logprob": ("float32", "positions"),
                "top_logprobs": ("float32", "top"), "top_ids": ("int64", "top")}


def output_array(name: str, batch: int, vocab_size: int, tree_size: int = 0, positions: int = 1):
    """(shape, numpy dtype name) of a read-back output for a batch."""
    dtype, width = OUTPUT_TYPES[name]
    shapes = {None: (batch,), "vocab": (batch, vocab_size), "tree": (batch, tree_size),
              "positions": (batch, positions), "top": (batch, positions, TOP_LOGPROBS)}
    return shapes[width], dtype


@dataclass(frozen=True)
class GraphId:
    """What a graph is: its model, its kind and, for a verification, its γ. Its name, the manifest's
    key and its file's stem (`target_forward`, `target_verify_sample_g4`), is derived from these
    here, once; nothing parses a name back."""

    model: str  # "target" | "draft"
    kind: str  # one of GRAPH_KINDS
    gamma: int | None = None  # chain verifications only (a tree's topology is an input of its graph)

    def __post_init__(self):
        assert self.kind in GRAPH_KINDS, f"graph kind {self.kind!r} not in {GRAPH_KINDS}"
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

    @property
    def positions_scored(self) -> str:
        """How many positions reach the LM head: "last" (each row's last real token) or "all"."""
        return "last" if self.kind in ("forward", "sample") else "all"

    @classmethod
    @functools.cache
    def tree_verification(cls, typical: bool = False) -> "GraphId":
        """A token tree with the greedy or the typical rule; its topology is an input, any size."""
        return cls("target", "verify_tree_typical" if typical else "verify_tree")

    @property
    def verifies(self) -> bool:
        return self.kind.startswith("verify")

    @property
    def sampling(self) -> bool:
        return self.kind in ("sample", "verify_sample")

    @property
    def tree(self) -> bool:
        return self.kind.startswith("verify_tree")

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


def kv_cache_bytes_per_sequence(model: dict, max_seq: int) -> int:
    """K and V of every layer of a manifest model entry, for one sequence at max_seq."""
    return 2 * model["num_layers"] * model["num_kv_heads"] * model["head_dim"] * max_seq * 4


@dataclass
class Bundle:
    path: Path
    manifest: dict

    @property
    def gammas(self) -> list[int]:
        return list(self.manifest["gammas"])

    @property
    def default_gamma(self) -> int:
        return self.manifest["default_gamma"]

    @property
    def max_seq(self) -> int:
        return self.manifest["max_seq"]

    @property
    def max_batch(self) -> int:
        return self.manifest["max_batch"]

    @property
    def vocab_size(self) -> int:
        return self.manifest["vocab_size"]

    def graph(self, name: str) -> dict:
        return self.manifest["graphs"][name]

    def graph_path(self, name: str) -> Path:
        return self.path / self.graph(name)["file"]

    def model(self, role: str) -> dict:
        return self.manifest["models"][role]

    @property
    def medusa(self) -> dict | None:
        """A Medusa bundle's heads and token tree (`tree`: its paths, see core/tree.py), else None."""
        return self.manifest.get("medusa")

    @property
    def has_draft(self) -> bool:
        """False for a draft-free bundle (built without --draft): its requests speculate with prompt lookup."""
        return "draft" in self.manifest["models"]


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
        unvouched = _unvouched_files(path, manifest["files"])
        if unvouched:
            _verify_files(path, {name: manifest["files"][name] for name in unvouched})
            _check_graphs(path, manifest, unvouched)
            write_stamp(path, manifest["files"])
    return Bundle(path, manifest)


def verify_bundle(path) -> Bundle:
    """Hash every file of the bundle against its manifest (whatever the stamp says), then stamp it."""
    path = Path(path)
    manifest = _read_manifest(path)
    _verify_files(path, manifest["files"])
    _check_graphs(path, manifest, manifest["files"])
    write_stamp(path, manifest["files"])
    return Bundle(path, manifest)


def _check_graphs(path: Path, manifest: dict, names) -> None:
    for name in names:
        if name.endswith(".onnx"):
            check_graph(path, manifest, name)


def _read_manifest(path: Path) -> dict:
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise SpecCompileError(f"{path}: not a speccompile bundle (no {MANIFEST})")
    if manifest_file.is_symlink() or manifest_file.stat().st_size > MANIFEST_MAX_BYTES:
        raise SpecCompileError(f"{path}: {MANIFEST} is a link or larger than {MANIFEST_MAX_BYTES >> 20} MiB: "
                               "not a bundle speccompile wrote")
    manifest = read_json_object(manifest_file)
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise SpecCompileError(
            f"{path}: bundle format version {version!r} is not supported "
            f"(this speccompile reads version {FORMAT_VERSION}); rebuild the bundle"
        )
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


def _check_contained(path: Path, manifest: dict) -> None:
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        raise SpecCompileError(f"{path}: {MANIFEST} has no valid file list")
    for name in files:
        inside(path, name)
    unlisted = sorted(set(referenced_files(manifest)) - set(files))
    if unlisted:
        raise SpecCompileError(f"{path}: the bundle reads {unlisted[0]}, which its manifest does not list (and so "
                               "does not hash): refused")
    tokenizer = inside(path, referenced_files(manifest)[-1])
    if tokenizer.is_file() and tokenizer.stat().st_size > TOKENIZER_MAX_BYTES:
        raise SpecCompileError(f"{path}: its tokenizer is {tokenizer.stat().st_size:,} bytes, over the "
                               f"{TOKENIZER_MAX_BYTES:,} a tokenizer may be: refused")
    for entry in tokenizer.parent.iterdir():  # the tokenizer reads its config and chat template too
        name = f"{manifest['tokenizer']['dir']}/{entry.name}"
        if name not in files:
            raise SpecCompileError(f"{path}: its tokenizer directory holds {entry.name}, which the manifest does "
                                   "not list (and so does not hash): refused")


# the ops speccompile's graphs are made of (compiler/), by domain; a graph with any other is refused
STANDARD_OPS = frozenset(
    "Add And ArgMax Attention Cast Concat Constant ConstantOfShape Cos CumSum DequantizeLinear Div Equal Erf Exp "
    "Expand Gather GatherElements GatherND Gelu Greater GreaterOrEqual Identity If LayerNormalization Less "
    "LessOrEqual Log LogSoftmax MatMul Max Min Mul Neg Not Or Pad Pow RMSNormalization Range ReduceMax ReduceMean "
    "ReduceMin ReduceSum Relu Reshape RotaryEmbedding Shape Sigmoid Sin Slice Softmax Split Sqrt Squeeze Sub Tanh "
    "TensorScatter TopK Transpose Unsqueeze Where".split())
RUNTIME_OPS = frozenset({"GroupQueryAttention", "MatMulNBits"})  # ONNX Runtime's com.microsoft kernels
SPEC_FUNCTIONS = ("SpecAccept", "SpecTransform", "SpecSample")  # the speccompile domain: local functions


def check_graph(path: Path, manifest: dict, name: str) -> None:
    """Refuse a graph file whose external data lies outside the bundle's listed files, or whose ops
    are not speccompile's, before a session opens it (its structure is read, not its weights)."""
    import onnx

    try:
        model = onnx.load(str(inside(path, name)), load_external_data=False)
    except Exception as e:  # noqa: BLE001 (protobuf's own errors: a file that is not an ONNX model)
        raise SpecCompileError(f"{path}: {name} is not an ONNX model ({type(e).__name__}): refused") from None
    functions = {f.name for f in model.functions if f.domain == "speccompile"
                 and f.name.rstrip("0123456789").rstrip("_") in SPEC_FUNCTIONS}
    for tensor in _initializers(model.graph):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            location = next((e.value for e in tensor.external_data if e.key == "location"), "")
            if location not in manifest["files"]:
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


def _initializers(graph):
    import onnx

    yield from graph.initializer
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _initializers(attribute.g)


def referenced_files(manifest: dict) -> list[str]:
    """Every file the runtime may read, as the manifest names them; the tokenizer's last."""
    try:
        names = []
        for entry in manifest["graphs"].values():
            names += [entry["file"]] + ([entry["single_sequence"]["file"]] if "single_sequence" in entry else [])
        for model in manifest["models"].values():
            names += [model["weights_file"]] + ([model["session"]["file"]] if "session" in model else [])
        names += [entry["file"] for entry in manifest.get("engines", {}).values()]
        return names + [f"{manifest['tokenizer']['dir']}/tokenizer.json"]
    except (KeyError, TypeError, AttributeError):
        raise SpecCompileError(f"{MANIFEST} does not describe a bundle (its graphs, models or tokenizer)") from None


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
