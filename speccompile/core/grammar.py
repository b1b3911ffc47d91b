"""Structured output: what a request's text must match (a JSON schema, any JSON object, a regular
expression, a choice of strings, or a grammar), and each request's grammar state, over llguidance.

Why llguidance (python -m tools.measure grammar_engines measures them): it computes a next-token mask
straight into a caller's int32 bitmask, rolls back any number of tokens in place (what rejected
drafts need), compiles JSON schemas, regular expressions, Lark and GBNF grammars lazily (no up-front
automaton over the vocabulary), bounds the work of every step by fuel limits (a hostile schema fails
instead of hanging), and is one wheel without dependencies: xgrammar needs torch, which the runtime
never imports; outlines-core compiles a whole index per schema before the first token.

Under speculation a constraint applies to every position the target scores and the draft proposes:
position r of a verification is masked by the grammar's state after the drafts d_1..d_r before it,
and the draft model's step k by its state after its own k drafts. So acceptance, the correction and
the bonus token all come from the masked target distribution, and the output is exactly the target's
constrained distribution: greedy identical to constrained decoding one token at a time.

Masks go to the graphs as bitmasks of *forbidden* tokens (int32 [B, R, ceil(V/32)], bit t % 32 of
word t // 32; compiler/logits.py unpacks them where the logits are), so that zeros, the graphs'
default, constrain nothing.

A `GrammarState` keeps the matcher at the request's committed tokens plus a lookahead: the drafts it
was last asked about, with the masks computed along them. Asking about drafts that share a prefix
with the lookahead (the draft model's step k+1 after its step k, then the verification of all of
them) reuses those masks; a rejected draft rolls the matcher back to where the kept tokens diverge.
"""

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from speccompile.errors import SpecCompileError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON as models most often write it (Python's json.dumps separators), with no other whitespace:
# flexible whitespace would let a model pad its output with newlines until max_tokens. A schema's own
# "x-guidance" options override these (llguidance's JSON compile options).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHED_GRAMMARS = 64  # compiled matchers kept per engine (a server sees the same schemas again and again)


@dataclass(frozen=True)
class Constraint:
    """What the generated text must match: `kind` (KINDS) and its source text (a schema as JSON,
    a regular expression, the choices as a JSON list, a Lark or GBNF grammar; "" for json_object)."""

    kind: str
    source: str = ""

    def __post_init__(self):
        if self.kind not in KINDS:
            raise SpecCompileError(f"a constraint is one of {', '.join(KINDS)}, not {self.kind!r}")

    @classmethod
    def of(cls, json_schema=None, grammar=None, regex=None, choice=None, json_object: bool = False):
        """The constraint the API's keywords name (at most one of them), or None."""
        given = {name: value for name, value in (("json_schema", json_schema), ("grammar", grammar),
                                                 ("regex", regex), ("choice", choice)) if value is not None}
        if json_object:
            given["json_object"] = True
        if len(given) > 1:
            raise SpecCompileError(f"give one constraint, not {' and '.join(given)}")
        if not given:
            return None
        (kind, value), = given.items()
        if kind == "json_schema":
            return cls(kind, _schema_text(value))
        if kind == "json_object":
            return cls(kind)
        if kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) for c in value):
                raise SpecCompileError("choice must be a non-empty list of strings")
            return cls(kind, json.dumps(list(value)))
        if not isinstance(value, str) or not value.strip():
            raise SpecCompileError(f"{kind} must be a non-empty string")
        return cls(kind, value)

    def llguidance_grammar(self) -> str:
        """The constraint as llguidance's grammar text (may raise SpecCompileError)."""
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import gbnf_to_lark

        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.source, overrides=None, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "choice":
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(self.source)))
        if "::=" in self.source:  # GBNF (llama.cpp's grammars)
            try:
                return LLMatcher.grammar_from_lark(gbnf_to_lark(self.source))
            except Exception as e:  # noqa: BLE001 (its converter raises what it meets)
                raise SpecCompileError(f"the GBNF grammar does not convert: {e}") from None
        return LLMatcher.grammar_from_lark(self.source)


SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "unevaluatedProperties")


def closed_objects(schema):
    """The schema with every object that lists its properties and says nothing of others closed to
    them (additionalProperties: false), as OpenAI's strict structured outputs and xgrammar's strict
    mode (vLLM's default) read a schema: a model asked for {name, age} must not go on inventing keys."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in SUBSCHEMAS:
        if key in out:
            out[key] = [closed_objects(s) for s in out[key]] if isinstance(out[key], list) else closed_objects(out[key])
    if "properties" in out and not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & out.keys():
        out["additionalProperties"] = False
    return out


def _schema_text(schema) -> str:
    if isinstance(schema, (str, bytes)):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as e:
            raise SpecCompileError(f"json_schema is not JSON: {e}") from None
    if not isinstance(schema, dict):
        raise SpecCompileError(f"json_schema must be a JSON object (a schema), not {type(schema).__name__}")
    try:
        return json.dumps(closed_objects(schema))  # property order is the order the output must follow
    except (TypeError, ValueError, RecursionError) as e:
        raise SpecCompileError(f"json_schema cannot be written as JSON: {e}") from None


class GrammarEngine:
    """Compiles constraints for one tokenizer and vocabulary; made once per runtime, on the first
    constrained request. Compiled matchers are cached by constraint; each request gets its own copy."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_ids: set[int]):
        from llguidance import LLTokenizer

        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        eos = sorted(eos_ids) or None
        try:
            self.tokenizer = LLTokenizer(Path(tokenizer_json).read_text(), n_vocab=vocab_size, eos_token=eos)
        except ValueError as e:  # a decoder it cannot read tokens' bytes from (or none)
            raise SpecCompileError(f"structured output needs a tokenizer whose tokens' bytes are known: {e}") from None
        self._compiled: dict[Constraint, object] = {}
        self._lock = threading.Lock()  # requests are made on several threads (a server's and its workers)

    def start(self, constraint: Constraint) -> "GrammarState":
        """A request's state at the start of its output; SpecCompileError names what does not compile."""
        with self._lock:
            matcher = self._compiled.get(constraint)
        if matcher is None:
            matcher = self._compile(constraint)  # outside the lock: a large grammar takes seconds
            with self._lock:
                if len(self._compiled) >= CACHED_GRAMMARS:
                    del self._compiled[next(iter(self._compiled))]
                self._compiled[constraint] = matcher
        with self._lock:
            copy = matcher.deep_copy()
        return GrammarState(copy, self.words, self.tokenizer.eos_tokens)

    def _compile(self, constraint: Constraint):
        from llguidance import LLMatcher

        try:
            grammar = constraint.llguidance_grammar()
        except (ValueError, TypeError) as e:
            raise SpecCompileError(f"the {constraint.kind} does not compile: {e}") from None
        problem = LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem:
            raise SpecCompileError(f"the {constraint.kind} does not compile: {_first_line(problem)}")
        matcher = LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise SpecCompileError(f"the {constraint.kind} does not compile: {_first_line(matcher.get_error())}")
        return matcher


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


class GrammarState:
    """One request's grammar: its committed tokens (the output so far) and a lookahead of drafts."""

    def __init__(self, matcher, words: int, eos_ids):
        self._matcher = matcher
        self.words = words
        # EOS ends the output: it is checked against the mask but never consumed, because a matcher
        # that consumed it does not roll it back (llguidance keeps no state for it), and nothing follows it
        self._eos = frozenset(int(t) for t in eos_ids)
        only_eos = np.zeros(32 * words, bool)
        only_eos[list(self._eos)] = True
        self._after_eos = np.packbits(~only_eos, bitorder="little").view(np.int32)  # after EOS (never read)
        self._ahead: list[int] = []  # drafts consumed past the committed tokens
        self._masks: list[np.ndarray] = []  # forbidden bits at the committed state, then after each of _ahead
        self._allowed = np.empty((1, words), np.int32)  # llguidance's scratch row
        self.broken = False  # a committed token the grammar refused (see commit)
        self.busy_s = 0.0  # time spent in the grammar engine for this request (masks, commits, rollbacks)

    def masks(self, drafted, out: np.ndarray) -> None:
        """Write into out [R, W] the forbidden tokens at positions 0..R-1: after the first r tokens of
        `drafted`. Positions after a token the grammar refuses are left as they are (zeros: they can
        never be accepted, since the token before them is forbidden where it stands)."""
        drafted = [int(t) for t in drafted]
        for r in range(min(len(out), len(drafted) + 1)):
            mask = self.mask_after(drafted[:r])
            if mask is None:
                return
            out[r] = mask

    def valid_prefix(self, tokens) -> int:
        """How many of `tokens`, in a row from the committed state, the grammar allows."""
        tokens = [int(t) for t in tokens]
        for k in range(len(tokens)):
            if self.mask_after(tokens[: k + 1]) is None:
                return k
        return len(tokens)

    def mask_after(self, drafted: list[int]) -> np.ndarray | None:
        """The forbidden bits [W] after the committed tokens and `drafted`; None if the grammar refuses one."""
        began = time.perf_counter()
        try:
            return self._mask_after(drafted)
        finally:
            self.busy_s += time.perf_counter() - began

    def _mask_after(self, drafted: list[int]) -> np.ndarray | None:
        common = self._common(drafted)
        if common == len(drafted) and common < len(self._masks):  # a prefix of the lookahead: known already
            return self._masks[common]
        self._rollback_to(common)
        for k, token in enumerate(drafted[common:], start=common):
            if not self._allows(token):
                return None
            if token in self._eos:
                return self._after_eos if k == len(drafted) - 1 else None
            self._matcher.consume_token(token)
            self._ahead.append(token)
        return self._mask_here()

    def commit(self, kept: list[int]) -> int:
        """Tokens emitted (kept drafts, the target's own token): the committed state moves past them.
        Returns how many of them the grammar allows in a row: fewer than all only where another
        control forbade every token the grammar allowed (min_tokens banning the EOS that must end
        it): the request must end before the refused token, and the state stays broken."""
        began = time.perf_counter()
        try:
            return self._commit(kept)
        finally:
            self.busy_s += time.perf_counter() - began

    def _commit(self, kept: list[int]) -> int:
        if self.broken:
            return 0
        kept = [int(t) for t in kept]
        common = self._common(kept)
        self._rollback_to(common)
        allowed = len(kept)
        for k, token in enumerate(kept[common:], start=common):
            if not self._allows(token):
                self.broken, allowed = True, k
                break
            if token in self._eos:  # the end (or, ignoring EOS, a token the grammar lets pass unconsumed)
                continue
            self._matcher.consume_token(token)
            self._ahead.append(token)
        del self._masks[: len(self._ahead)]  # the mask at the new committed state, if it was computed
        self._ahead = []
        return allowed

    @property
    def finished(self) -> bool:
        """The grammar is complete and nothing may follow (only EOS is allowed)."""
        return self._matcher.is_stopped()

    def _common(self, tokens: list[int]) -> int:
        """The length of the longest common prefix of `tokens` and the lookahead."""
        common = 0
        for ahead, token in zip(self._ahead, tokens):
            if ahead != token:
                break
            common += 1
        return common

    def _rollback_to(self, length: int) -> None:
        """Keep the first `length` tokens of the lookahead (and the masks along them)."""
        if len(self._ahead) > length:
            self._matcher.rollback(len(self._ahead) - length)
            del self._ahead[length:]
            del self._masks[length + 1 :]

    def _mask_here(self) -> np.ndarray:
        """The forbidden bits at the matcher's current state (computed once per state of the lookahead)."""
        if len(self._masks) <= len(self._ahead):
            row = self._allowed[0]
            self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
            self._masks.append(np.invert(row))
        return self._masks[len(self._ahead)]

    def _allows(self, token: int) -> bool:
        forbidden = self._mask_here()
        return 0 <= token < 32 * self.words and not (int(forbidden[token >> 5]) >> (token & 31)) & 1
