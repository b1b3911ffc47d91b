"""`GenerationParams`: everything one request asks for, checked once, the same record on every surface.

The Python API (`Runtime.submit`, `Runtime.generate`), the CLI (`generate`, `bench`, `profile`) and
the server's routes all make one of these and hand it to the runtime, which checks what depends on
the bundle (a γ it verifies at, the vocabulary, the proposers it has, the context length) when it makes the
engine's `Request` (runtime/requests.py). A new option is a field here, with its `Option` metadata:
the keyword API takes every field by name, the CLI makes an option of each field that has a flag
(speccompile/cli_options.py), and the server's body a field of each that has a body name
(serve/protocol.py), so it reaches the engine from every surface without being written out again.

Seeds. A request's random stream is numpy's `default_rng(seed)`. The i-th request of one call (the
prompts in order, each prompt's n samples in turn) uses seed + i (vLLM's rule for n), so
`generate([p], seed=s)`, `submit(p, seed=s)` and the server's `{"seed": s}` draw the same tokens,
and sample i of a seeded request is the request seeded seed + i.
"""

import dataclasses
import typing
from dataclasses import dataclass, field
from enum import StrEnum

from speccompile.bundle import TOP_LOGPROBS
from speccompile.core.grammar import Constraint
from speccompile.core.processors import Processors
from speccompile.core.proposers import DEFAULT_PROPOSER, PROPOSERS
from speccompile.errors import SpecCompileError

AUTO = "auto"  # γ chosen each iteration by the scheduler's policy (core/request.AUTO)


class Mode(StrEnum):
    """Who decodes: the proposers and the target ("speculative": the policy never picks plain
    decoding), or the target alone. Unset (None): γ auto, which may decode plainly where
    speculation does not pay."""

    SPECULATIVE = "speculative"
    AUTOREGRESSIVE = "autoregressive"


class SamplingRule(StrEnum):
    """How sampled drafts are verified (core/acceptance.py): "coupled" (the default with a seed) makes
    a seeded request's tokens the same whatever γ, proposer or company; "rejection" (the default
    without one) is Leviathan et al.'s rule, whose acceptance is higher."""

    COUPLED = "coupled"
    REJECTION = "rejection"


class AcceptanceRule(StrEnum):
    """Medusa trees (core/tree.py): "exact" (lossless) or "typical" (approximate, opt-in)."""

    EXACT = "exact"
    TYPICAL = "typical"


@dataclass(frozen=True)
class Option:
    """Where a field appears besides the keyword API: its CLI flag (None: not on the command line) and
    its name in an OpenAI/vLLM body (None: not in bodies; the routes map OpenAI's own names, such as
    max_tokens and logprobs, themselves: GenerationParams.from_openai). help: one line for both."""

    help: str
    flag: str | None = None
    body: str | None = None


def option(default, help: str, flag: str | None = None, body: str | None = None, factory=None):
    meta = {"option": Option(help, flag, body)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class GenerationParams:
    max_new_tokens: int | None = option(64, "Tokens to generate at most (None: what the context has left).",
                                        "--max-new-tokens")
    temperature: float = option(0.0, "0 is greedy; otherwise sample from the target's distribution.", "--temperature",
                                "temperature")
    top_k: int = option(0, "Keep the k most likely tokens (0: off).", "--top-k", "top_k")
    top_p: float = option(1.0, "Nucleus sampling mass (1: off).", "--top-p", "top_p")
    min_p: float = option(0.0, "Drop tokens below min_p x the most likely one's probability (0: off).", "--min-p",
                          "min_p")
    seed: int | None = option(None, "Random seed: the same seed gives the same tokens (sample i: seed + i).",
                              "--seed", "seed")
    stop: tuple[str, ...] = option((), "Strings that end the text (excluded from it).", "--stop", "stop")
    stop_token_ids: tuple[int, ...] = option((), "Token ids that end the text like EOS (kept).", "--stop-token-id",
                                             "stop_token_ids")
    ignore_eos: bool = option(False, "Go on past the model's end-of-sequence token.", "--ignore-eos", "ignore_eos")
    min_tokens: int = option(0, "EOS and stop tokens cannot end the text before this many tokens.", "--min-tokens",
                             "min_tokens")
    presence_penalty: float = option(0.0, "Subtract this from every generated token's logit (-2..2).",
                                     "--presence-penalty", "presence_penalty")
    frequency_penalty: float = option(0.0, "Subtract this x each token's count so far (-2..2).",
                                      "--frequency-penalty", "frequency_penalty")
    repetition_penalty: float = option(1.0, "Divide seen tokens' positive logits by this (1: off).",
                                       "--repetition-penalty", "repetition_penalty")
    logit_bias: tuple[tuple[int, float], ...] = option((), "Token id -> bias added to its logit (-100..100).", None,
                                                       "logit_bias")
    logprobs: int | None = option(None, "Report each generated token's log-probability, with this many top tokens'.",
                                  "--logprobs")
    prompt_logprobs: int | None = option(None, "Report each prompt token's log-probability (after the first).",
                                         "--prompt-logprobs")
    # speculation
    gamma: int | str | None = option(None, "Drafts per iteration at most: a γ the bundle verifies at, 0 (plain "
                                     "decoding) or \"auto\" (the default: chosen each iteration).", "--gamma",
                                     "num_speculative_tokens")
    mode: Mode | None = option(None, "\"autoregressive\": the target alone; \"speculative\": never plain decoding "
                               "(default: γ auto decides).", "--mode")
    proposer: str = option(DEFAULT_PROPOSER, "Who drafts: " + ", ".join(PROPOSERS) + ".", "--proposer", "proposer")
    p_min: float | None = option(None, "The draft model stops drafting below this confidence (default: the γ "
                                 "profile's, else 0).", "--p-min", "p_min")
    sampling_rule: SamplingRule | None = option(None, "How sampled drafts are verified (default: coupled with a "
                                                "seed, rejection without).", "--sampling-rule", "sampling_rule")
    acceptance: AcceptanceRule = option(AcceptanceRule.EXACT, "Medusa trees: exact, or typical (approximate).",
                                        "--acceptance")
    # structured output (core/grammar.py): json_schema=, json_object=, regex=, choice= or grammar= in `of`
    constraint: Constraint | None = option(None, "Generate under this constraint (core/grammar.Constraint).")
    n: int = option(1, "Samples of each prompt (sample i seeded seed + i).", "--n", "n")

    def __post_init__(self):
        set_ = object.__setattr__.__get__(self)
        set_("max_new_tokens", _max_new_tokens(self.max_new_tokens))
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            set_(name, _number(name, getattr(self, name)))
        set_("top_k", _top_k(self.top_k))
        set_("seed", _seed(self.seed))
        set_("stop", _stop_strings(self.stop))
        set_("stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))
        set_("logit_bias", _logit_bias(self.logit_bias))
        for name in ("logprobs", "prompt_logprobs"):
            _top_logprobs(name, getattr(self, name))
        set_("mode", _choice("mode", Mode, self.mode))
        set_("sampling_rule", _choice("sampling_rule", SamplingRule, self.sampling_rule))
        set_("acceptance", _choice("acceptance", AcceptanceRule, self.acceptance))
        if self.proposer not in PROPOSERS:
            raise SpecCompileError(f"proposer must be one of {', '.join(PROPOSERS)}, not {self.proposer!r}")
        if self.p_min is not None and (isinstance(self.p_min, bool) or not isinstance(self.p_min, (int, float))
                                       or not 0.0 <= self.p_min <= 1.0):
            raise SpecCompileError(f"p_min must be a probability in [0, 1], got {self.p_min!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise SpecCompileError(f"n must be a positive integer, got {self.n!r}")
        if self.temperature < 0:
            raise SpecCompileError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecCompileError(f"top_p must be in (0, 1], got {self.top_p}")
        self.processors()  # penalties' ranges

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def of(cls, params: "GenerationParams | None" = None, **options) -> "GenerationParams":
        """`params` (default: the defaults) with `options` (its fields by name) replacing its values.
        The constraint may be given as one of json_schema=, json_object=, regex=, choice=, grammar=."""
        constraint = {k: options.pop(k) for k in CONSTRAINT_KEYWORDS if k in options}
        unknown = sorted(set(options) - FIELDS)
        if unknown:
            raise SpecCompileError(f"unknown generation option {unknown[0]!r} (options: {', '.join(sorted(FIELDS))})")
        if constraint:
            grammar = constraint.pop("grammar", None)
            options["constraint"] = grammar if isinstance(grammar, Constraint) else Constraint.of(grammar=grammar,
                                                                                                   **constraint)
        base = params if params is not None else cls()
        return dataclasses.replace(base, **options) if options else base

    @classmethod
    def from_openai(cls, body: dict, defaults: "GenerationParams | None" = None,
                    chat: bool = False) -> "GenerationParams":
        """A request from an OpenAI/vLLM body (its fields as a dict, unset ones absent or None): each
        field's body name (`Option.body`) read as it is, then OpenAI's own shapes mapped: max_tokens
        (chat: max_completion_tokens first; 0 with echo: the prompt alone), logprobs (chat: a flag
        with top_logprobs), echo's prompt log-probabilities, and the structured-output fields."""
        options = {f.name: body[meta.body] for f, meta in _options() if meta.body and body.get(meta.body) is not None}
        max_tokens = body.get("max_completion_tokens") if chat else None
        max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
        options["max_new_tokens"] = max_tokens or (1 if max_tokens == 0 else None)  # echo alone: one, unsent
        if chat:
            options["logprobs"] = (body.get("top_logprobs") or 0) if body.get("logprobs") else None
        else:  # completions: the prompt's are scored for vLLM's prompt_logprobs, or echo with logprobs
            options["logprobs"] = body.get("logprobs")
            echoed = body.get("logprobs") if body.get("echo") else None
            asked = body.get("prompt_logprobs")
            options["prompt_logprobs"] = asked if asked is not None else echoed
        options["top_k"] = max(options.get("top_k", 0), 0)  # vLLM's -1: off
        return cls.of(defaults, **options, **openai_constraint(body))

    # -- what the engine takes ------------------------------------------------------------------
    def processors(self) -> Processors:
        return Processors(self.presence_penalty, self.frequency_penalty, self.repetition_penalty, self.logit_bias,
                          self.min_tokens, self.min_p)

    def for_sample(self, index: int) -> "GenerationParams":
        """The params of the index-th request of a call: seeded seed + index (unseeded: unchanged)."""
        if self.seed is None or index == 0:
            return self
        return dataclasses.replace(self, seed=(self.seed + index) % 2**64)

    def default_sampling_rule(self) -> SamplingRule:
        """A seeded request is verified by the coupled rule, whose tokens its seed fixes whatever the
        load; an unseeded one by rejection sampling, which keeps more drafts (on the demo pair at
        temperature 1.0, acceptance 0.64 against 0.56: tools/measure scenario sampling_rules)."""
        if self.sampling_rule is not None:
            return self.sampling_rule
        return SamplingRule.COUPLED if self.seed is not None else SamplingRule.REJECTION

    def to_json(self) -> dict:
        """The fields with JSON values (enums as their strings, the constraint as {kind, source})."""
        out = {}
        for name in FIELD_ORDER:
            value = getattr(self, name)
            if isinstance(value, Constraint):
                value = {"kind": value.kind, "source": value.source}
            elif isinstance(value, tuple):
                value = [list(v) if isinstance(v, tuple) else v for v in value]
            out[name] = value
        return out


CONSTRAINT_KEYWORDS = ("json_schema", "json_object", "regex", "choice", "grammar")
FIELD_ORDER = tuple(f.name for f in dataclasses.fields(GenerationParams))
FIELDS = frozenset(FIELD_ORDER)
HINTS = typing.get_type_hints(GenerationParams)


def _options() -> list[tuple[dataclasses.Field, Option]]:
    return [(f, f.metadata["option"]) for f in dataclasses.fields(GenerationParams)]


def options_with_flags() -> list[tuple[dataclasses.Field, Option]]:
    """The fields the command line takes, with their metadata (what cli_options.py makes options of)."""
    return [(f, meta) for f, meta in _options() if meta.flag]


def options_in_bodies() -> list[tuple[dataclasses.Field, Option]]:
    """The fields an OpenAI/vLLM body carries under their own names (what serve/protocol.py declares)."""
    return [(f, meta) for f, meta in _options() if meta.body]


def openai_constraint(body: dict) -> dict:
    """The constraint keywords (json_schema=, json_object=, regex=, choice=, grammar=) a body asks for,
    one way at most: OpenAI's response_format, vLLM's structured_outputs or its guided_* fields."""
    asked = {}
    response_format = body.get("response_format")
    if response_format and response_format.get("type") != "text":
        schema = response_format.get("json_schema")
        asked["response_format"] = {"json_schema": schema["schema"]} if schema else {"json_object": True}
    structured = {k: v for k, v in (body.get("structured_outputs") or {}).items() if v is not None}
    if structured:
        asked["structured_outputs"] = {("json_schema" if k == "json" else k): v for k, v in structured.items()}
    guided = {key: body[f"guided_{name}"] for key, name in (("json_schema", "json"), ("regex", "regex"),
                                                            ("choice", "choice"), ("grammar", "grammar"))
              if body.get(f"guided_{name}") is not None}
    if guided:
        asked["guided_*"] = guided
    if len(asked) > 1:
        raise SpecCompileError(f"give one of {' and '.join(asked)}, not both")
    return next(iter(asked.values()), {})


# -- checks ---------------------------------------------------------------------------------------
def _max_new_tokens(value):
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise SpecCompileError(f"max_new_tokens must be a positive integer, got {value!r}")
    return value


def _number(name: str, value) -> float:
    import numpy as np

    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise SpecCompileError(f"{name} must be a number, got {value!r}")
    if name == "temperature" and 0 < value < 1e-5:  # greedy, as vLLM's: float32 would round it to 0 anyway
        return 0.0
    return float(value)


def _top_k(value) -> int:
    _number("top_k", value)
    if isinstance(value, float) and not value.is_integer():
        raise SpecCompileError(f"top_k must be an integer, got {value!r}")
    if value < 0:
        raise SpecCompileError(f"top_k must be >= 0 (0 disables it), got {value}")
    return int(value)


def _seed(seed):
    """Any integer (a negative one, as vLLM's seeds may be, is taken modulo 2**64), or None."""
    import numpy as np

    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise SpecCompileError(f"seed must be an integer, got {seed!r}")
    return int(seed) % 2**64


def _stop_strings(stop) -> tuple[str, ...]:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if not all(isinstance(s, str) and s for s in stops):
        raise SpecCompileError("stop must be a non-empty string or a list of non-empty strings")
    return stops


def _token_ids(name: str, ids) -> tuple[int, ...]:
    import numpy as np

    ids = tuple(ids or ())
    if any(isinstance(t, bool) or not isinstance(t, (int, np.integer)) for t in ids):
        raise SpecCompileError("token ids must be integers")
    return tuple(int(t) for t in ids)


def _logit_bias(bias) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: token ids (JSON gives them as strings) to a bias, as sorted pairs."""
    if not bias:
        return ()
    if not isinstance(bias, (dict, tuple, list)):
        raise SpecCompileError("logit_bias must map token ids to biases")
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        return tuple(sorted((int(token), float(value)) for token, value in items))
    except (TypeError, ValueError):
        raise SpecCompileError("logit_bias must map token ids to numbers") from None


def _top_logprobs(name: str, value) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= TOP_LOGPROBS):
        raise SpecCompileError(f"{name} must be an integer in [0, {TOP_LOGPROBS}], got {value!r}")


def _choice(name: str, kind: type[StrEnum], value):
    if value is None or isinstance(value, kind):
        return value
    try:
        return kind(value)
    except ValueError:
        raise SpecCompileError(f"{name} must be one of {', '.join(k.value for k in kind)}, not {value!r}") from None

