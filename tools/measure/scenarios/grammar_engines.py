"""Which grammar engine is fastest for structured (JSON) output under speculative decoding, on CPU.

    python -m tools.measure grammar_engines [--bundle DIR] [--repeats 20]
    python -m tools.measure grammar_engines --quick     # smoke test: small corpus, 1 repetition

Engines: llguidance, xgrammar, outlines-core (each must be pip-installed; a missing or failing one is reported).
Tokenizers: the bundle's (the demo bundle's 8192-token BPE by default) and a 32,000-token byte-level BPE that
this scenario trains from the Python stdlib's .py files (a larger vocab makes masks costlier). Schemas:
required fields (string, integer, boolean), an enum field, an array of objects (minItems/maxItems), an object
nested 3 levels deep, and "any JSON object".

For every engine x tokenizer x schema (the `cells` table):
  setup       engine's per-tokenizer preprocessing (paid once per tokenizer, not per request)
  compile     schema -> ready matcher (best of up to 3 runs; xgrammar's cache is off). llguidance builds its
              lexer lazily, so part of its compile cost lands in the first walk: hence
  first walk  the whole first (cold) walk of the instance, mask + consume per token, EOS check excluded
  mask        full next-token bitmask, median and p99 over all walks (--repeats) of a valid instance
  token       bitmask + consuming the token (the per-token cost a decoder pays), median
  speculative 4 x (consume a draft token + bitmask), then roll back 3 (keep 1): median and p99
then each engine's geometric mean over its cells (`summary`), whether the engines' masks allow the same number
of tokens at each step (`agreement`: they compile one language, but differ in details), and each engine's
install footprint (`footprint`): package dir, runtime requirements and their size, import time in a fresh
interpreter and whether importing it loads torch.
Every walk checks that each token of the instance is in the mask, is accepted, and that EOS is allowed at the end.
Every engine runs single-threaded where it has a knob (RAYON_NUM_THREADS=1, xgrammar max_threads=1,
torch.set_num_threads(1)). JSON is compact (no whitespace allowed) in all three engines so that they match
the same language. torch is imported (by xgrammar) only here, never by the speccompile runtime.
About 30 s on 2 cores.
"""

import gc
import glob
import importlib
import importlib.metadata
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from tools.measure.options import Common, bundle
from tools.measure.record import Column, Measured, Table

COMMON = Common(bundle=True, repeats=20)
log = logging.getLogger(__name__)

DRAFT = 4  # draft tokens per speculative step; all but one are rolled back
BIG_VOCAB = 32000

# Each schema comes with one valid instance; the walk replays its tokenization. additionalProperties is
# explicit so that the engines, whose defaults differ (xgrammar's strict mode), compile the same language.
SCHEMAS = {
    "required": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "active": {"type": "boolean"}},
            "required": ["name", "age", "active"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace, Countess of Lovelace", "age": 36, "active": True},
    ),
    "enum": (
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "integer"},
                "status": {"enum": ["pending", "processing", "shipped", "delivered", "cancelled", "refunded"]},
            },
            "required": ["order_id", "status"],
            "additionalProperties": False,
        },
        {"order_id": 104257, "status": "delivered"},
    ),
    "array": (
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 5,
                    "items": {
                        "type": "object",
                        "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}},
                        "required": ["sku", "qty"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["items"],
            "additionalProperties": False,
        },
        {"items": [{"sku": "A-1001", "qty": 2}, {"sku": "B-2002", "qty": 1}, {"sku": "C-3003", "qty": 12}]},
    ),
    "nested3": (
        {
            "type": "object",
            "properties": {
                "company": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "address": {
                            "type": "object",
                            "properties": {
                                "city": {"type": "string"},
                                "geo": {
                                    "type": "object",
                                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                                    "required": ["lat", "lon"],
                                    "additionalProperties": False,
                                },
                            },
                            "required": ["city", "geo"],
                            "additionalProperties": False,
                        },
                    },
                    "required": ["name", "address"],
                    "additionalProperties": False,
                }
            },
            "required": ["company"],
            "additionalProperties": False,
        },
        {"company": {"name": "Acme Widgets", "address": {"city": "Paris", "geo": {"lat": 48.8566, "lon": 2.3522}}}},
    ),
    "json_object": (
        {"type": "object"},
        {"id": 7, "title": "grammar engines", "tags": ["json", "cpu"], "meta": {"ok": True, "score": 3.5, "x": None}},
    ),
}


@dataclass
class Tok:
    """A tokenizer under test: its JSON file, mask width and EOS id."""

    name: str
    path: str
    n_vocab: int
    eos: int
    special: set = field(default_factory=set)

    def encode(self, text):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(self.path).encode(text, add_special_tokens=False).ids


# ----------------------------------------------------------------------------------------------- tokenizers


def special_ids(path):
    """Ids of special added tokens: engines must never allow them inside JSON."""
    with open(path) as f:
        return {t["id"] for t in json.load(f).get("added_tokens", []) if t.get("special")}


def demo_tokenizer(bundle):
    """The bundle's tokenizer (the demo bundle's by default)."""
    path = os.path.join(bundle, "tokenizer", "tokenizer.json")
    with open(os.path.join(bundle, "manifest.json")) as f:
        info = json.load(f)["tokenizer"]
    return Tok("demo-8k", path, info["size"], info["eos_token_ids"][0], special_ids(path))


def stdlib_texts(limit_bytes):
    """The stdlib's .py files (not site-packages), up to limit_bytes: plenty of text to learn 32k merges.

    A few test modules are deliberately not UTF-8 (and the trainer rejects them): those are skipped.
    """
    root = os.path.join(sys.base_prefix, "lib", f"python{sys.version_info.major}.{sys.version_info.minor}")
    files = sorted(glob.glob(os.path.join(root, "*.py"))) + sorted(glob.glob(os.path.join(root, "*", "*.py")))
    texts, total = [], 0
    for path in files:
        if "site-packages" in path or total >= limit_bytes:
            continue
        with open(path, "rb") as f:
            data = f.read()
        try:
            texts.append(data.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        total += len(data)
    return texts


def train_big_tokenizer(out_dir, corpus_bytes):
    """Train a byte-level BPE (GPT-2 style) so the engines see a realistic, large vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BIG_VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    start = time.perf_counter()
    tok.train_from_iterator(stdlib_texts(corpus_bytes), trainer)
    path = os.path.join(out_dir, "tokenizer.json")
    tok.save(path)
    n_vocab = tok.get_vocab_size()
    log.info(f"trained {n_vocab}-token byte-level BPE in {time.perf_counter() - start:.1f} s")
    return Tok("bpe-32k", path, n_vocab, tok.token_to_id("<|endoftext|>"), special_ids(path))


def byte_level_decoder():
    """GPT-2's byte<->unicode table, inverted: outlines-core wants each token's raw bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    byte_values = list(printable)
    for b in range(256):
        if b not in printable:
            byte_values.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(byte_values, chars)}


# ------------------------------------------------------------------------------------------------ engines
# Each engine makes matchers with one interface: fill() the bitmask, allowed(token) reads it, consume(token)
# returns success, rollback(n), reset(). The bitmask is int32 words, bit t%32 of word t//32 = token t.


class Mask:
    """Reads a bit of an int32 bitmask as unsigned (the high bit is a token too)."""

    def __init__(self, words):
        self.bits = words.reshape(-1).view(np.uint32)

    def allowed(self, token):
        return bool((int(self.bits[token >> 5]) >> (token & 31)) & 1)

    def count(self, n_vocab):
        return int(np.unpackbits(self.bits.view(np.uint8), bitorder="little")[:n_vocab].sum())


class LlgEngine:
    name = "llguidance"
    modules = ("llguidance", "llguidance.numpy")

    def setup(self, tok):
        import llguidance

        with open(tok.path) as f:
            self.tok = llguidance.LLTokenizer(f.read(), n_vocab=tok.n_vocab, eos_token=tok.eos)
        self.n_vocab = tok.n_vocab

    def compile(self, schema):
        import llguidance

        # whitespace_flexible=False: compact JSON, the same language the other two engines are given.
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
        matcher = llguidance.LLMatcher(self.tok, grammar, log_level=0)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return LlgMatcher(matcher, self.n_vocab)


class LlgMatcher:
    def __init__(self, matcher, n_vocab):
        from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

        self.m, self._fill = matcher, fill_next_token_bitmask
        self.words = allocate_token_bitmask(1, n_vocab)
        self.mask = Mask(self.words)

    def fill(self):
        self._fill(self.m, self.words)

    def consume(self, token):
        return self.m.consume_token(token)

    def rollback(self, n):
        self.m.rollback(n)

    def reset(self):
        self.m.reset()


class XgrEngine:
    name = "xgrammar"
    modules = ("torch", "transformers", "xgrammar")

    def setup(self, tok):
        import torch
        import transformers
        import xgrammar

        torch.set_num_threads(1)
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=tok.path)
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=tok.n_vocab, stop_token_ids=[tok.eos])
        # cache off: otherwise the repeated compiles below would time a dictionary lookup.
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.n_vocab = tok.n_vocab

    def compile(self, schema):
        import xgrammar

        # strict_mode=False only matters for "any object" ({"type": "object"}); in strict mode that means "{}".
        compiled = self.compiler.compile_json_schema(
            schema, any_whitespace=False, separators=(",", ":"), strict_mode=False
        )
        return XgrMatcher(xgrammar.GrammarMatcher(compiled), self.n_vocab)


class XgrMatcher:
    def __init__(self, matcher, n_vocab):
        import xgrammar

        self.m = matcher
        self.words = xgrammar.allocate_token_bitmask(1, n_vocab)
        self.mask = Mask(self.words.numpy())  # a view: fill() writes the tensor, allowed() reads it

    def fill(self):
        self.m.fill_next_token_bitmask(self.words, 0)

    def consume(self, token):
        return self.m.accept_token(token)

    def rollback(self, n):
        self.m.rollback(n)

    def reset(self):
        self.m.reset()


class OutlinesEngine:
    name = "outlines-core"
    modules = ("outlines_core", "outlines_core.json_schema")

    def setup(self, tok):
        import outlines_core

        to_byte = byte_level_decoder()
        with open(tok.path) as f:
            vocab = json.load(f)["model"]["vocab"]
        token_map = {}
        for text, token in vocab.items():
            # EOS is given separately, and special tokens are not text (they would be allowed inside strings).
            if token == tok.eos or token in tok.special:
                continue
            token_map.setdefault(bytes(to_byte[ch] for ch in text), []).append(token)
        self.vocab = outlines_core.Vocabulary(tok.eos, token_map)
        self.n_words = (tok.n_vocab + 31) // 32

    def compile(self, schema):
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        # whitespace_pattern="": compact JSON; the default "[ ]?" would allow a space around every token.
        index = outlines_core.Index(build_regex_from_schema(schema, ""), self.vocab)
        return OutlinesMatcher(outlines_core.Guide(index, max_rollback=DRAFT * 2), self.n_words)


class OutlinesMatcher:
    def __init__(self, guide, n_words):
        self.g = guide
        self.words = np.zeros((1, n_words), dtype=np.int32)
        self.ptr = self.words.ctypes.data
        self.mask = Mask(self.words)

    def fill(self):
        self.g.write_mask_into(self.ptr, self.words.size, 4)

    def consume(self, token):
        # advance() raises on a disallowed token; return_tokens=False skips building the allowed-token list.
        self.g.advance(token, return_tokens=False)
        return True

    def rollback(self, n):
        # The Guide keeps its past DFA states (plain integers); rolling back restores one of them.
        self.g.rollback_state(n)

    def reset(self):
        self.g.reset()


ENGINES = [LlgEngine, XgrEngine, OutlinesEngine]
PACKAGES = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines-core": "outlines_core"}


# ------------------------------------------------------------------------------------------------ timing


def us_since(start_ns):
    return (time.perf_counter_ns() - start_ns) / 1000.0


def time_compile(engine, schema, budget_s=1.5):
    """Best of up to 3 compiles, fewer when one is slow (outlines' any-object index takes seconds)."""
    times, matcher = [], None
    while len(times) < 3 and sum(times) < budget_s:
        start = time.perf_counter()
        matcher = engine.compile(schema)
        times.append(time.perf_counter() - start)
    return min(times) * 1000.0, matcher


def walk(matcher, tokens, tok, reps):
    """Token-by-token walk of a valid output: mask then consume each token, and finally check EOS is allowed.

    Returns per-token mask times and mask+consume times (us), and the allowed-token count of each mask of the
    first walk (to compare the engines' languages). The first repetition is included on purpose: llguidance
    builds lexer states lazily, and a first request pays that.
    """
    mask_us, tok_us, counts = [], [], []
    for rep in range(reps):
        matcher.reset()
        for pos, token in enumerate(tokens):
            start = time.perf_counter_ns()
            matcher.fill()
            mask_time = us_since(start)
            if not matcher.mask.allowed(token):  # checked outside the timed region
                raise AssertionError(f"token {pos} ({token}) of a valid instance is masked out")
            if rep == 0:
                counts.append(matcher.mask.count(tok.n_vocab))
            start = time.perf_counter_ns()
            ok = matcher.consume(token)
            consume_time = us_since(start)
            if not ok:
                raise AssertionError(f"token {pos} ({token}) of a valid instance was rejected")
            mask_us.append(mask_time)
            tok_us.append(mask_time + consume_time)
        matcher.fill()
        if not matcher.mask.allowed(tok.eos):
            raise AssertionError("EOS is not allowed after a complete valid instance")
    return mask_us, tok_us, counts


def speculate(matcher, tokens, reps):
    """Per step: consume DRAFT tokens of the walk with a mask after each, then roll back all but one."""
    step_us = []
    for _ in range(reps):
        matcher.reset()
        for pos in range(len(tokens) - DRAFT + 1):
            start = time.perf_counter_ns()
            ok = True
            for token in tokens[pos : pos + DRAFT]:
                ok = matcher.consume(token) and ok
                matcher.fill()
            matcher.rollback(DRAFT - 1)
            step_us.append(us_since(start))
            if not ok:
                raise AssertionError(f"a draft token at {pos}..{pos + DRAFT - 1} was rejected")
    return step_us


def p99(values):
    return float(np.percentile(values, 99))


def measure_cell(engine, tok, schema_name, reps):
    """One engine x tokenizer x schema: compile, walk, speculate. Returns a row dict."""
    schema, instance = SCHEMAS[schema_name]
    tokens = tok.encode(json.dumps(instance, separators=(",", ":")))
    compile_ms, matcher = time_compile(engine, json.dumps(schema))
    # GC pauses are the harness's, not the engine's: keep them out of the p99.
    gc.disable()
    try:
        mask_us, tok_us, counts = walk(matcher, tokens, tok, reps)
        spec_us = speculate(matcher, tokens, reps)
    finally:
        gc.enable()
    return {
        "compile_ms": compile_ms,
        "n_tokens": len(tokens),
        "first_walk_ms": sum(tok_us[: len(tokens)]) / 1000.0,
        "counts": counts,
        "mask_med": statistics.median(mask_us),
        "mask_p99": p99(mask_us),
        "tok_med": statistics.median(tok_us),
        "spec_med": statistics.median(spec_us),
        "spec_p99": p99(spec_us),
    }


# ------------------------------------------------------------------------------------------------ footprint


def dist_size_mb(dist_name):
    try:
        files = importlib.metadata.files(dist_name) or []
    except importlib.metadata.PackageNotFoundError:
        return 0.0
    total = 0
    for f in files:
        path = f.locate()
        if os.path.isfile(path):
            total += os.path.getsize(path)
    return total / 1e6


def dir_size_mb(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 1e6


def footprint(engine_name):
    """Size of the import package's directory, its runtime requirements (no extras) and their installed size."""
    import importlib.util

    module = PACKAGES[engine_name]
    spec = importlib.util.find_spec(module)
    pkg_mb = dir_size_mb(os.path.dirname(spec.origin)) if spec and spec.origin else 0.0
    requires = importlib.metadata.requires(module) or []
    runtime = [r for r in requires if "extra ==" not in r]
    names = [re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0] for r in runtime]
    deps_mb = sum(dist_size_mb(n) for n in names)
    return pkg_mb, runtime, deps_mb


# ------------------------------------------------------------------------------------------------ tables

CELL_COLUMNS = (Column("engine"), Column("tokenizer"), Column("schema"), Column("tokens"),
                Column("setup_ms", "ms", 0, "setup"), Column("compile_ms", "ms", 2, "compile"),
                Column("first_walk_ms", "ms", 2, "first walk"), Column("mask_med", "µs", 1, "mask median"),
                Column("mask_p99", "µs", 1, "mask p99"), Column("tok_med", "µs", 1, "token median"),
                Column("spec_med", "µs", 1, "speculative median"), Column("spec_p99", "µs", 1, "speculative p99"))
MEANS = ("compile_ms", "first_walk_ms", "mask_med", "mask_p99", "tok_med", "spec_med", "spec_p99")
SUMMARY_COLUMNS = (Column("engine"), *(c for c in CELL_COLUMNS if c.name in MEANS))
AGREEMENT_COLUMNS = (Column("tokenizer"), Column("schema"), Column("differing_steps"), Column("steps"),
                     Column("first_difference"))
FOOTPRINT_COLUMNS = (Column("engine"), Column("version"), Column("package", "MB", 1), Column("requires"),
                     Column("requirements", "MB", 0, "requirements installed"), Column("import_cost"))


def add_options(parser) -> None:
    parser.add_argument("--quick", action="store_true", help="smoke test: small training corpus, 1 repetition")


def run_engine(engine_cls, toks, reps, failures, counts) -> list[dict]:
    """All tokenizers and schemas for one engine; failures are recorded, not fatal. Fills counts[(tok, schema)]."""
    rows = []
    for tok in toks:
        engine = engine_cls()
        try:
            # Imports (seconds for torch + transformers) are not part of the per-tokenizer setup time.
            for module in engine.modules:
                importlib.import_module(module)
            start = time.perf_counter()
            engine.setup(tok)
        except Exception as exc:  # an engine that cannot load a tokenizer is a result, not a crash
            failures.append(f"{engine.name} / {tok.name} / setup: {type(exc).__name__}: {exc}")
            log.exception(failures[-1])
            continue
        setup_ms = (time.perf_counter() - start) * 1000.0
        for schema_name in SCHEMAS:
            row = {"engine": engine.name, "tokenizer": tok.name, "schema": schema_name, "setup_ms": setup_ms}
            try:
                cell = measure_cell(engine, tok, schema_name, reps)
            except Exception as exc:
                failures.append(f"{engine.name} / {tok.name} / {schema_name}: {type(exc).__name__}: {exc}")
                rows.append({**row, "tokens": None, **{name: None for name in MEANS}})
                continue
            counts.setdefault((tok.name, schema_name), {})[engine.name] = cell["counts"]
            rows.append({**row, "tokens": cell["n_tokens"], **{name: cell[name] for name in MEANS}})
            log.info(f"{engine.name} / {tok.name} / {schema_name}: mask {cell['mask_med']:.1f} us, "
                     f"speculative step {cell['spec_med']:.1f} us")
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Geometric mean per engine over its cells: one number per column, no one schema dominating.
    Cells that failed are left out."""
    means = []
    for engine_cls in ENGINES:
        cells = [r for r in rows if r["engine"] == engine_cls.name and r["compile_ms"] is not None]
        if cells:
            means.append({"engine": engine_cls.name,
                          **{name: float(np.exp(np.mean(np.log([r[name] for r in cells])))) for name in MEANS}})
    return means


def agreement(counts) -> list[dict]:
    """Do the engines allow the same number of tokens at each step? A check that they compiled one language."""
    rows = []
    for (tok_name, schema_name), per_engine in counts.items():
        names = list(per_engine)
        steps = len(per_engine[names[0]])
        differing = [i for i in range(steps) if len({per_engine[n][i] for n in names}) > 1]
        first = (f"step {differing[0]}: " + ", ".join(f"{n} {per_engine[n][differing[0]]}" for n in names)
                 if differing else None)
        rows.append({"tokenizer": tok_name, "schema": schema_name, "differing_steps": len(differing), "steps": steps,
                     "first_difference": first})
    return rows


IMPORT_PROBE = (
    "import sys, time; start = time.perf_counter(); import {module}; "
    "print(f'{{time.perf_counter() - start:.2f}}', 'torch' in sys.modules)"
)


def import_cost(module):
    """Import time in a fresh interpreter, and whether importing drags in torch (the runtime must not)."""
    import subprocess

    result = subprocess.run([sys.executable, "-c", IMPORT_PROBE.format(module=module)], capture_output=True,
                            text=True, timeout=120)
    if result.returncode != 0:
        return "import failed"
    seconds, torch_loaded = result.stdout.split()
    return f"import {seconds} s{', imports torch' if torch_loaded == 'True' else ''}"


def footprints() -> list[dict]:
    rows = []
    for name in PACKAGES:
        try:
            version = importlib.metadata.version(PACKAGES[name])
            pkg_mb, runtime, deps_mb = footprint(name)
        except Exception as exc:
            rows.append({"engine": name, "version": f"not installed ({exc})", "package": None, "requires": None,
                         "requirements": None, "import_cost": None})
            continue
        rows.append({"engine": name, "version": version, "package": pkg_mb,
                     "requires": ", ".join(runtime) if runtime else "none", "requirements": deps_mb,
                     "import_cost": import_cost(PACKAGES[name])})
    return rows


def run(args) -> Measured:
    reps = 1 if args.quick else args.repeats
    demo = demo_tokenizer(str(bundle(args)))
    with tempfile.TemporaryDirectory() as tmp:
        # Trained before RAYON_NUM_THREADS is set, so training may use both cores; it is not measured.
        big = train_big_tokenizer(tmp, 3_000_000 if args.quick else 24_000_000)
        # Each engine's Rust code has its own rayon pool, started on first use: this makes them single-threaded.
        os.environ["RAYON_NUM_THREADS"] = "1"
        rows, failures, counts = [], [], {}
        for engine_cls in ENGINES:
            rows += run_engine(engine_cls, [demo, big], reps, failures, counts)
    title = f"{reps} walk(s) per cell; speculative step = {DRAFT} x (consume + mask) + rollback({DRAFT - 1})"
    tokenizers = {t.name: {"n_vocab": t.n_vocab, "eos": t.eos} for t in (demo, big)}
    return Measured((Table.of("cells", CELL_COLUMNS, rows, title),
                     Table.of("summary", SUMMARY_COLUMNS, summary(rows), "geometric mean per engine over its cells"),
                     Table.of("agreement", AGREEMENT_COLUMNS, agreement(counts),
                              "steps of the first walk where the engines' allowed-token counts differ"),
                     Table.of("footprint", FOOTPRINT_COLUMNS, footprints(), "install footprint")),
                    {"tokenizers": tokenizers, "failures": failures})
